"""What both sides of the connector share: the per-step metadata and the streaming layout
derived from vLLM's KV cache config (the streaming group, its block size, the host-tier size)."""

from __future__ import annotations

import math
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
    """One request's part of a step. Its page table reaches the worker as deltas (vLLM's block
    tables do the same): the pages added since its last step, so a step costs O(new pages), not
    O(context)."""

    req_id: str
    start: int  # position of the first token computed this step (= tokens already in host)
    num_tokens: int
    anchor_slot: int  # device slot of the first new token in the (first) streaming group
    new_pages: list[int]  # pages appended to the request's page table since its last step
    # the same slot in each further streaming group (vLLM splits many streaming layers over
    # several KV cache groups of one spec; each group has its own block table)
    group_anchors: dict[int, int] = field(default_factory=dict)
    known_pages: int = 0  # pages of the table the worker already holds (before new_pages)
    sink: list[int] = field(default_factory=list)  # this step's sink pages, past the table
    pages: list[int] | None = None  # worker side: the whole table + sink (PageTables.apply)
    page_array: torch.Tensor | None = None  # worker side: the table (no sink), int32

    def anchor(self, group: int, first_group: int) -> int:
        return self.anchor_slot if group == first_group else self.group_anchors[group]


@dataclass
class StreamingMetadata(KVConnectorMetadata):
    reqs: list[ReqStep] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # tables the worker drops (first)
    # shared tier (shared_tier.py): pages fetched from LMCache's storage and checked by the
    # scheduler, for the worker to copy into the host store before the forward: (page, payload);
    # and full prompt pages this step completes, for the worker to store after it: (page, hash)
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


class PageTables:
    """Worker side: every live request's page table, rebuilt from the steps' deltas, as a list
    and as an int32 tensor (grown by doubling), so a step costs O(new pages) here too."""

    def __init__(self):
        self._tables: dict[str, list[int]] = {}
        self._arrays: dict[str, torch.Tensor] = {}

    def apply(self, meta: StreamingMetadata) -> None:
        """Drop the finished requests' tables, extend the others, and give each ReqStep of the
        step its whole table (+ this step's sink pages) as ``pages`` and ``page_array``."""
        for rid in meta.finished:
            self._tables.pop(rid, None)
            self._arrays.pop(rid, None)
        for r in meta.reqs:
            table = self._tables.setdefault(r.req_id, [])
            if len(table) != r.known_pages:
                raise RuntimeError(
                    f"kvstack streaming: the page table of request {r.req_id} is out of step: "
                    f"the worker holds {len(table)} pages, the scheduler sent it {r.known_pages}")
            n = len(table)
            table.extend(r.new_pages)
            array = self._arrays.get(r.req_id)
            if array is None or array.shape[0] < len(table):
                grown = torch.empty(max(16, 2 * len(table)), dtype=torch.int32)
                if array is not None:
                    grown[:n] = array[:n]
                array = self._arrays[r.req_id] = grown
            if r.new_pages:
                array[n:len(table)] = torch.tensor(r.new_pages, dtype=torch.int32)
            r.pages = table + r.sink if r.sink else table
            r.page_array = array[:len(table)]

    def __len__(self) -> int:
        return len(self._tables)


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
    # a reused prefix ends on a multiple of this many tokens (0: of the page): where every
    # chunked-local layer's chunk ends, so those layers need no K/V from before it
    reuse_granule: int = 0
    # every streaming group, and each streaming layer's group (one group: just `group`)
    groups: tuple[int, ...] = ()
    layer_groups: tuple[tuple[str, int], ...] = ()
    # pages past the page table that a step may hand out as sinks (scheduler_side.build_meta):
    # where a request that cannot grow writes its last step's K/V, one distinct page each, since
    # the CPU path attends the new tokens from the pages they were written to
    sink_pages: int = 1

    def all_groups(self) -> tuple[int, ...]:
        return self.groups or (self.group,)

    def group_of(self, layer_name: str) -> int:
        return dict(self.layer_groups).get(layer_name, self.group)


def _max_stage_layers(cfg: StreamingConfig, vllm_config: "VllmConfig", pp: int) -> int:
    """Pipeline parallelism: the most streaming layers one stage may hold, from the model config
    and vLLM's own layer partition (``get_pp_indices``), the same number on every side (a KV
    cache config names only its stage's layers). Exact for ``streaming_layers: "auto"`` on iRoPE
    models (their NoPE layers) and on models whose config lists ``layer_types`` (their
    ``full_attention`` layers); otherwise every layer of the stage, an upper bound."""
    from vllm.distributed.utils import get_pp_indices

    model = vllm_config.model_config
    total = model.get_total_num_hidden_layers()
    hf = getattr(model, "hf_text_config", None)
    streams = [True] * total
    if cfg.streaming_layers is None:
        no_rope = getattr(hf, "no_rope_layers", None)
        types = getattr(hf, "layer_types", None)
        if no_rope:
            streams = [i < len(no_rope) and not no_rope[i] for i in range(total)]
        elif types and len(types) == total:
            streams = [t == "full_attention" for t in types]
    return max(1, max(sum(streams[slice(*get_pp_indices(total, rank, pp))])
                      for rank in range(pp)))


def _layout(cfg: StreamingConfig, vllm_config: "VllmConfig",
            kv_cache_config: "KVCacheConfig") -> _Layout:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    # Pipeline parallelism: each KV cache config names only its own stage's layers (the
    # scheduler's is the first stage's), so another stage's streaming group is here, empty.
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1
    groups = [gi for gi, g in enumerate(kv_cache_config.kv_cache_groups)
              if isinstance(g.kv_cache_spec, SlidingWindowSpec)
              and g.kv_cache_spec.sliding_window == cfg.device_window_tokens
              and (any(selects_layer(cfg, vllm_config.model_config, n) for n in g.layer_names)
                   or (pp > 1 and not g.layer_names))]
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
    # host_tier_gib is what one rank holds at most; every side of an engine must agree on the
    # page count, so under pipeline parallelism it is sized for the largest stage
    per_layer = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    stage_layers = len(layers) if pp == 1 else _max_stage_layers(cfg, vllm_config, pp)
    num_pages = int(cfg.host_tier_gib * (1 << 30)) // (per_layer * stage_layers * cfg.page_tokens)
    others = [x.kv_cache_spec for gi, x in enumerate(kv_cache_config.kv_cache_groups)
              if gi not in groups]
    # Prefix reuse restores nothing on the device, so every other layer must need no KV from
    # before the end of the reused prefix: none (all layers stream) or chunked-local layers
    # (Llama-4), whose attention starts afresh at each chunk: a reused prefix then ends where
    # a page and every chunk end (the least common multiple; Llama-4-Scout's 8,192-token chunk
    # with 32-token pages: hits in steps of 8,192 tokens, at most 8,191 tokens recomputed).
    # Next to other connectors (MultiConnector's joint prefix hits), a sibling restores the
    # other layers' device KV of the same prefix.
    in_groups = sum(len(kv_cache_config.kv_cache_groups[gi].layer_names) for gi in groups)
    reuse_ok = len(layers) == in_groups and (cfg.joint_hits or all(
        isinstance(o, ChunkedLocalAttentionSpec) for o in others))
    reuse_granule = math.lcm(cfg.page_tokens, *(o.attention_chunk_size for o in others
                                                if isinstance(o, ChunkedLocalAttentionSpec)))
    sched = vllm_config.scheduler_config
    # a step's tokens span at most one page more per request than they fill
    sink_pages = -(-sched.max_num_batched_tokens // cfg.page_tokens) + sched.max_num_seqs
    return _Layout(group=groups[0], block_size=spec.block_size, layers=layers,
                   num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype,
                   num_pages=num_pages, reuse_ok=reuse_ok, reuse_granule=reuse_granule,
                   groups=tuple(groups),
                   layer_groups=layer_groups, sink_pages=sink_pages)
