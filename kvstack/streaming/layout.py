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
    anchor_slot: int  # device slot of the first new token in the (first) streaming group
    pages: list[int]
    # the same slot in each further streaming group (vLLM splits many streaming layers over
    # several KV cache groups of one spec; each group has its own block table)
    group_anchors: dict[int, int] = field(default_factory=dict)

    def anchor(self, group: int, first_group: int) -> int:
        return self.anchor_slot if group == first_group else self.group_anchors[group]


@dataclass
class StreamingMetadata(KVConnectorMetadata):
    reqs: list[ReqStep] = field(default_factory=list)


@dataclass(frozen=True)
class _Layout:
    """What both sides derive from the KV cache config: the streaming group and its pools."""

    group: int  # the first streaming group
    block_size: int
    layers: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    num_pages: int
    reuse_ok: bool  # prefix reuse needs no device KV restored
    # every streaming group, and each streaming layer's group (one group: just `group`)
    groups: tuple[int, ...] = ()
    layer_groups: tuple[tuple[str, int], ...] = ()

    def all_groups(self) -> tuple[int, ...]:
        return self.groups or (self.group,)

    def group_of(self, layer_name: str) -> int:
        return dict(self.layer_groups).get(layer_name, self.group)


def _layout(cfg: StreamingConfig, vllm_config: "VllmConfig",
            kv_cache_config: "KVCacheConfig") -> _Layout:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    groups = [gi for gi, g in enumerate(kv_cache_config.kv_cache_groups)
              if isinstance(g.kv_cache_spec, SlidingWindowSpec)
              and g.kv_cache_spec.sliding_window == cfg.device_window_tokens
              and any(selects_layer(cfg, vllm_config.model_config, n) for n in g.layer_names)]
    if not groups:
        raise ValueError(
            "kvstack StreamingConnector: no streaming layer in the KV cache config. Is the "
            "kvstack hooks patch applied, is the hybrid KV cache manager on (Llama-4: "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1), and does "
            "'streaming_layers' match an attention layer?")
    specs = [kv_cache_config.kv_cache_groups[gi].kv_cache_spec for gi in groups]
    spec = specs[0]
    if any((s.block_size, s.num_kv_heads, s.head_size, s.dtype)
           != (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) for s in specs):
        raise ValueError(
            "kvstack StreamingConnector: the streaming layers differ in block size, KV heads, "
            "head size or dtype (groups "
            + ", ".join(f"{gi}: {s}" for gi, s in zip(groups, specs))
            + "); select layers of one shape with 'streaming_layers'")
    layer_groups = tuple((n, gi) for gi in groups
                         for n in kv_cache_config.kv_cache_groups[gi].layer_names
                         if selects_layer(cfg, vllm_config.model_config, n))
    layers = tuple(n for n, _ in layer_groups)
    per_token = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize * len(layers)
    num_pages = int(cfg.host_tier_gib * (1 << 30)) // (per_token * cfg.page_tokens)
    others = [x.kv_cache_spec for gi, x in enumerate(kv_cache_config.kv_cache_groups)
              if gi not in groups]
    # Prefix reuse restores nothing on the device, so every other layer must need no KV from
    # before a page boundary: none (all layers stream) or chunked-local layers whose chunk
    # divides the page (Llama-4: a reused prefix ends where a chunk ends).
    in_groups = sum(len(kv_cache_config.kv_cache_groups[gi].layer_names) for gi in groups)
    reuse_ok = len(layers) == in_groups and all(
        isinstance(o, ChunkedLocalAttentionSpec)
        and cfg.page_tokens % o.attention_chunk_size == 0 for o in others)
    return _Layout(group=groups[0], block_size=spec.block_size, layers=layers,
                   num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype,
                   num_pages=num_pages, reuse_ok=reuse_ok, groups=tuple(groups),
                   layer_groups=layer_groups)
