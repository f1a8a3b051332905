"""Worker side of the streaming connector: the host-tier K/V pools and the attention of the
streaming layers. On vLLM's CPU backend the pools are in the kernel's layout and attended in place
(cpu_native.py); elsewhere the history is attended in windows + the new tokens, merged by
log-sum-exp (windowed.py), its windows loaded and the new K/V written back as page runs on a copy
stream (transfer.py: no host gather, no per-call pinning, no blocking device-to-host copy)."""

from __future__ import annotations

import os
import sys

import torch

from . import cpu_native, scratch
from .config import StreamingConfig
from .compat import cpu_attn_isa
from .host_tier import HostStore
from .layout import PageTables, ReqStep, StreamingMetadata, _Layout
from .log import logger
from .packed import StepPlan, packed_attention
from .shared_tier import SharedTier, open_for_engine, predict_store_tag, store_tag
from .transfer import PagedHistory, transfers
from .windowed import Features, windowed_attention

# set by ci/gpu/check_scratch.py: measure what the windowed path allocates on a GPU, per layer
# call, beyond what was allocated before it (torch's allocator statistics), against the plan
SCRATCH_PROBE_ENV = "KVSTACK_STREAMING_SCRATCH_PROBE"


class _WorkerSide:
    def __init__(self, cfg: StreamingConfig, layout: _Layout):
        self.cfg = cfg
        self.layout = layout
        self.layers = frozenset(layout.layers)
        self.store: HostStore | None = None  # opened in prepare(), once the layers are known
        self._group_of = {name: layout.group_of(name) for name in layout.layers}
        self.tables = PageTables()  # each request's host pages, kept from the steps' deltas
        self._by_slot: dict[int, dict[int, ReqStep]] = {}  # group -> anchor slot -> request
        self._batches: dict[int, _Batch] = {}  # group -> this step's batch (its first layer's)
        # CPU backend: the host tier in the kernel's layout, attended in place (cpu_native.py)
        self.in_place = False
        self._features: dict[str, Features] = {}  # layers whose backend adds to plain softmax
        self._pending: set[str] = set()  # streaming layers not yet computed in this step
        self.shared: SharedTier | None = None  # the shared tier (LMCache's storage), if any
        self._saves: list[tuple[int, bytes]] = []  # this step's full prompt pages to store
        self.transfer = transfers()  # the windowed path's copies, one Transfer per device
        self.scratch: scratch.ScratchPlan | None = None  # what was reserved for the device scratch
        self._probe: torch.device | None = None  # the scratch probe's device (SCRATCH_PROBE_ENV)
        self._probe_peak = 0
        # the windowed path's window per layer (tokens; StreamingConfig.window: capped at
        # max_model_len in prepare(), smaller for a layer on the float32 reference path) and the
        # largest of them (what the staging buffers hold)
        self._token_bytes = 2 * layout.num_kv_heads * layout.head_size * layout.dtype.itemsize
        self.window = cfg.window(self._token_bytes)
        self._windows: dict[str, int] = {}

    def prepare(self, vllm_config, device: torch.device | None = None) -> None:
        """Start-up, once the model is loaded: pick the path from the layers' backend, open the
        host store in its layout, and read the features (soft-cap, ALiBi slopes, sinks) the
        windowed path must apply. On a GPU (`device`, the KV cache's), allocate the staging
        buffers now, inside the device scratch that kvstack's gpu_worker patch took out of the KV
        cache memory (scratch.py)."""
        ctx = vllm_config.compilation_config.static_forward_context
        layers = [ctx[name] for name in self.layout.layers]
        self.in_place = self.cfg.cpu_native_attention and all(
            cpu_native.fits(layer, self.cfg.page_tokens) for layer in layers)
        for layer in layers:
            impl = layer.impl
            alibi = getattr(impl, "alibi_slopes", None)
            if alibi is not None and not isinstance(alibi, torch.Tensor):
                alibi = torch.tensor(alibi, dtype=torch.float32)
            feat = Features(softcap=float(getattr(impl, "logits_soft_cap", 0) or 0),
                            alibi=alibi, sinks=getattr(impl, "sinks", None))
            if not feat.plain:
                self._features[layer.layer_name] = feat
        max_len = vllm_config.model_config.max_model_len
        self._windows = {
            layer.layer_name: self.cfg.window(
                self._token_bytes, max_len,
                reference=not self._features.get(layer.layer_name, Features()).plain_scores)
            for layer in layers}
        self.window = max(self._windows.values(), default=self.window)  # PP: maybe none here
        self._open_store()
        if device is not None and device.type != "cpu" and not self.in_place:
            self._reserve_scratch(vllm_config, device)
        if self.cfg.lmcache is not None:
            # the shared tier's objects are pages in the host store's layout: the scheduler keys
            # its lookups with the layout predicted from the configuration, so it must be this one
            tag = store_tag(self.in_place, cpu_attn_isa(layers[0]) if self.in_place else None)
            predicted = predict_store_tag(self.cfg, vllm_config, self.layout)
            if tag != predicted:
                raise ValueError(
                    f"kvstack StreamingConnector: the shared tier ('lmcache') cannot key this "
                    f"engine's pages: the host store's layout is {tag!r}, predicted {predicted!r} "
                    "from the configuration; set cpu_native_attention: false (token layout)")
            self.shared = open_for_engine(self.cfg, self.layout, vllm_config, tag)

    def _reserve_scratch(self, vllm_config, device: torch.device) -> None:
        plan = self.scratch = scratch.plan_for(vllm_config)
        first = self.layout.layers[0]
        staged = self.transfer(device).reserve(self.store.k[first], self.window)
        if staged != plan.staging:  # the plan and transfer.py disagree: a bug of ours, say so
            logger.warning("kvstack streaming: staging buffers of %d bytes, planned %d", staged,
                           plan.staging)
        scored = sorted(n for n, f in self._features.items() if not f.plain_scores)
        if scored and not plan.reference:
            logger.warning(
                "kvstack streaming: layers %s change the scores (soft-cap, ALiBi) and take the "
                "float32 reference path, whose scores the device scratch (%s) does not count; "
                "set device_scratch_mib", scored, plan.describe())
        if plan.configured is not None and plan.configured < plan.estimate:
            logger.warning("kvstack streaming: device_scratch_mib is below the estimate: %s",
                           plan.describe())
        if os.environ.get(SCRATCH_PROBE_ENV) == "1" and device.type == "cuda":
            self._probe = device

    def _probe_begin(self) -> int:
        torch.cuda.reset_peak_memory_stats(self._probe)
        return torch.cuda.memory_allocated(self._probe)

    def _probe_end(self, base: int, tokens: int) -> None:
        peak = torch.cuda.max_memory_allocated(self._probe) - base
        if peak > self._probe_peak:
            self._probe_peak = peak
            plan = self.scratch
            print(f"kvstack scratch probe: peak {peak} bytes beyond the layer call's start "
                  f"({tokens} query tokens); planned attention {plan.attention + plan.reference}, "
                  f"staging {plan.staging} allocated at start-up, reserved {plan.total}",
                  file=sys.stderr, flush=True)

    def _open_store(self) -> None:
        # the sink pages after the page table: where a request that could not grow writes its
        # last step's K/V (scheduler_side.build_meta; it is failed after)
        self.store = HostStore(list(self.layout.layers),
                               self.layout.num_pages + self.layout.sink_pages,
                               self.cfg.page_tokens, self.layout.num_kv_heads,
                               self.layout.head_size, self.layout.dtype,
                               path=self.cfg.host_tier_path,
                               layout="cpu_kernel" if self.in_place else "tokens")
        arena = self.store.arena
        if arena is not None and arena.method != "none":  # a GPU host: say how it is pinned
            logger.info("kvstack streaming: host tier of %.2f GiB (%d layers) page-locked by %s%s",
                        arena.tensor.numel() * arena.tensor.element_size() / (1 << 30),
                        len(self.layout.layers), arena.method,
                        f" ({arena.error})" if arena.error else "")

    def begin_step(self, meta: StreamingMetadata) -> None:
        self.tables.apply(meta)
        if meta.loads:
            self._sync_writes()  # a page written back late must not land on what is loaded here
            self._load_pages(meta.loads)  # before the forward attends them
        self._saves = meta.saves
        self._pending = set(self.layers) if meta.reqs else set()
        first = self.layout.group
        if self.layout.groups[1:]:  # several streaming groups: each has its own slots
            self._by_slot = {g: {r.anchor(g, first): r for r in meta.reqs}
                             for g in self.layout.groups}
        else:
            self._by_slot = {first: {r.anchor_slot: r for r in meta.reqs}}
        self._batches = {}

    def end_step(self) -> None:
        """After the forward: every streaming layer of a step with tokens must have been
        computed here. One that was not ran in the backend, over its one-token device window
        (e.g. replayed from a captured CUDA graph): never serve that silently."""
        missed, self._pending = self._pending, set()
        if missed:
            raise RuntimeError(
                "kvstack streaming: streaming layer(s) " + ", ".join(sorted(missed))
                + " were not computed by the connector in this step (captured in a CUDA graph, "
                "or the hooks patch is missing); their output would be wrong. Use cudagraph_mode "
                "PIECEWISE with attention among the splitting ops, or enforce_eager.")
        saves, self._saves = self._saves, []
        if saves and self.shared is not None:
            self._sync_writes()  # the pages' bytes are read on the host
            self.shared.put_pages([(h, self._page_parts(p)) for p, h in saves])

    def _sync_writes(self) -> None:
        for t in self.transfer.made.values():
            t.sync_writes()

    # ---- the shared tier: a page's bytes of every streaming layer, in the store's layout ----
    def _page_parts(self, page: int) -> list[torch.Tensor]:
        parts = []
        for name in self.layout.layers:
            views = ([self.store.kv[name][page]] if self.store.layout == "cpu_kernel"
                     else [self.store.k[name][page], self.store.v[name][page]])
            parts.extend(v.reshape(-1).view(torch.uint8) for v in views)
        return parts

    def _load_pages(self, loads: list[tuple[int, torch.Tensor]]) -> None:
        """Copy pages the scheduler fetched (and checked) from the shared tier into the store."""
        for page, payload in loads:
            off = 0
            for part in self._page_parts(page):
                part.copy_(payload[off:off + part.numel()])
                off += part.numel()

    def _batch(self, name: str, attn_metadata) -> "_Batch":
        """The step's requests in batch order, matched once per step and group (two host
        syncs for the batch layout, not one per layer and request)."""
        group = self._group_of[name]
        batch = self._batches.get(group)
        if batch is not None:
            return batch
        qsl = attn_metadata.query_start_loc.tolist()
        rows = [(qsl[i], qsl[i + 1]) for i in range(len(qsl) - 1) if qsl[i + 1] > qsl[i]]
        slots = attn_metadata.slot_mapping
        if slots.shape[0] <= 256:  # decode-sized: one conversion of the whole mapping is quicker
            every = slots.tolist()
            firsts = [every[a] for a, _ in rows]
        else:
            firsts = slots[torch.tensor([a for a, _ in rows], dtype=torch.long)].tolist()
        by_slot = self._by_slot.get(group, {})
        segments = []
        for (a, b), slot in zip(rows, firsts):
            r = by_slot.get(int(slot))
            if r is None or r.num_tokens != b - a:
                raise RuntimeError(
                    f"kvstack streaming: cannot match the batch rows {a}..{b} (slot {int(slot)}, "
                    f"{b - a} tokens) of {name} to a scheduled request")
            segments.append((a, b, r))
        batch = self._batches[group] = _Batch(segments, qsl[-1] if qsl else 0)
        if self.in_place and segments:
            batch.kernel = cpu_native.kernel_batch(segments, self.cfg.page_tokens)
        return batch

    def attention(self, layer, query, key, value, output, attn_metadata):
        name = layer.layer_name
        self._pending.discard(name)
        batch = self._batch(name, attn_metadata)
        if batch.kernel is not None:
            cpu_native.attend_in_place(layer, query, key, value, output, self.store.kv[name],
                                       batch.kernel)
        else:
            features = self._features.get(name)
            scale = float(layer.impl.scale)
            window = self._windows.get(name, self.window)
            transfer = self.transfer(query.device)
            kp, vp = self.store.k[name], self.store.v[name]
            base = self._probe_begin() if self._probe is not None else 0
            if features is None and len(batch.segments) > 1:
                # several requests, plain scores: their histories packed into shared windows,
                # one load and (on a GPU) one varlen call per window (packed.py)
                packed_attention(query, key, value, batch.segments, kp, vp, transfer, window,
                                 scale, output, step=batch.packed_plan(window, kp.shape[1]))
            else:
                for j, (a, b, r) in enumerate(batch.segments):
                    # the new K/V reach the pools through the history (PagedHistory.append); its
                    # page runs and gather indexes are made by the group's first layer
                    windowed_attention(query[a:b], key[a:b], value[a:b],
                                       PagedHistory(transfer, kp, vp, r.pages, batch.history(j)),
                                       r.start, window, scale, out=output[a:b], features=features)
            if self._probe is not None:
                self._probe_end(base, batch.num_tokens)
        if batch.num_tokens < output.shape[0]:
            output[batch.num_tokens:].zero_()
        return output


class _Batch:
    """A step's batch as a streaming group sees it: (first row, end row, request) per request,
    the rows in use, for the in-place CPU path the kernel's view of it, for packed windows
    their plan per window size, and per request what its windows' loads reuse (made at the
    group's first layer, used by every layer)."""

    def __init__(self, segments: list[tuple[int, int, ReqStep]], num_tokens: int):
        self.segments = segments
        self.num_tokens = num_tokens
        self.kernel: cpu_native.KernelBatch | None = None
        self._plans: dict[tuple[int, int], StepPlan] = {}
        self._histories: dict[int, dict] = {}

    def history(self, j: int) -> dict:
        """Request j's cache for `Transfer.windows` (its page runs, its windows' gather indexes)."""
        got = self._histories.get(j)
        if got is None:
            got = self._histories[j] = {}
        return got

    def packed_plan(self, window: int, page_tokens: int) -> StepPlan:
        plan = self._plans.get((window, page_tokens))
        if plan is None:
            plan = self._plans[(window, page_tokens)] = StepPlan(self.segments, window,
                                                                 page_tokens)
        return plan
