"""What both sides of the connector share: the per-step metadata and the streaming layout
derived from vLLM's KV cache config (the streaming group, its block size, the host-tier size)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .config import StreamingConfig, selects_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class ReqStep:
    req_id: str
    start: int  # position of the first token computed this step (= tokens already in host)
    num_tokens: int
    anchor_slot: int  # device slot of the first new token in the streaming group
    pages: list[int]


@dataclass
class StreamingMetadata(KVConnectorMetadata):
    reqs: list[ReqStep] = field(default_factory=list)


@dataclass(frozen=True)
class _Layout:
    """What both sides derive from the KV cache config: the streaming group and its pools."""

    group: int
    block_size: int
    layers: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    num_pages: int
    reuse_ok: bool  # prefix reuse needs no device KV restored


def _layout(cfg: StreamingConfig, vllm_config: "VllmConfig",
            kv_cache_config: "KVCacheConfig") -> _Layout:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    group = None
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if (isinstance(spec, SlidingWindowSpec)
                and spec.sliding_window == cfg.device_window_tokens
                and any(selects_layer(cfg, vllm_config.model_config, n) for n in g.layer_names)):
            group = gi
            break
    if group is None:
        raise ValueError(
            "kvstack StreamingConnector: no streaming layer in the KV cache config. Is the "
            "kvstack hooks patch applied, is the hybrid KV cache manager on (Llama-4: "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1), and does "
            "'streaming_layers' match an attention layer?")
    g = kv_cache_config.kv_cache_groups[group]
    spec = g.kv_cache_spec
    layers = tuple(n for n in g.layer_names if selects_layer(cfg, vllm_config.model_config, n))
    per_token = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize * len(layers)
    num_pages = int(cfg.host_tier_gib * (1 << 30)) // (per_token * cfg.page_tokens)
    others = [x.kv_cache_spec for gi, x in enumerate(kv_cache_config.kv_cache_groups)
              if gi != group]
    # Prefix reuse restores nothing on the device, so every other layer must need no KV from
    # before a page boundary: none (all layers stream) or chunked-local layers whose chunk
    # divides the page (Llama-4: a reused prefix ends where a chunk ends).
    reuse_ok = len(layers) == len(g.layer_names) and all(
        isinstance(o, ChunkedLocalAttentionSpec)
        and cfg.page_tokens % o.attention_chunk_size == 0 for o in others)
    return _Layout(group=group, block_size=spec.block_size, layers=layers,
                   num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype,
                   num_pages=num_pages, reuse_ok=reuse_ok)
