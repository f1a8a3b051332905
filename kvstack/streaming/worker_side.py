"""Worker side of the streaming connector: the host-tier K/V pools and the attention of the
streaming layers (history in windows + the new tokens, merged by log-sum-exp)."""

from __future__ import annotations

import torch

from . import cpu_native
from .config import StreamingConfig
from .host_tier import HostStore
from .layout import ReqStep, StreamingMetadata, _Layout
from .windowed import Features, windowed_attention


class _WorkerSide:
    def __init__(self, cfg: StreamingConfig, layout: _Layout):
        self.cfg = cfg
        self.layout = layout
        self.layers = frozenset(layout.layers)
        # one page more than the page table hands out: the sink, where a request that could
        # not grow writes its last step's K/V (scheduler_side._grow; it is failed after)
        self.store = HostStore(list(layout.layers), layout.num_pages + 1, cfg.page_tokens,
                               layout.num_kv_heads, layout.head_size, layout.dtype,
                               path=cfg.host_tier_path)
        self._group_of = {name: layout.group_of(name) for name in layout.layers}
        self._by_slot: dict[int, dict[int, ReqStep]] = {}  # group -> anchor slot -> request
        # CPU: one-window histories go through vLLM's own CPU kernel (cpu_native.py); decided
        # at the first streaming layer (None: not yet), off when the layers use another backend.
        self._native: bool | None = None if cfg.cpu_native_attention else False
        self._features: dict[str, Features] = {}  # layers whose backend adds to plain softmax
        self._pending: set[str] = set()  # streaming layers not yet computed in this step

    def read_layer_features(self, vllm_config) -> None:
        """Soft-cap, ALiBi slopes and sinks of each streaming layer's backend (start-up)."""
        ctx = vllm_config.compilation_config.static_forward_context
        for name in self.layout.layers:
            impl = ctx[name].impl
            alibi = getattr(impl, "alibi_slopes", None)
            if alibi is not None and not isinstance(alibi, torch.Tensor):
                alibi = torch.tensor(alibi, dtype=torch.float32)
            feat = Features(softcap=float(getattr(impl, "logits_soft_cap", 0) or 0),
                            alibi=alibi, sinks=getattr(impl, "sinks", None))
            if not feat.plain:
                self._features[name] = feat

    def begin_step(self, meta: StreamingMetadata) -> None:
        self._pending = set(self.layers) if meta.reqs else set()
        first = self.layout.group
        self._by_slot = {g: {r.anchor(g, first): r for r in meta.reqs}
                         for g in self.layout.all_groups()}

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

    def attention(self, layer, query, key, value, output, attn_metadata):
        name = layer.layer_name
        self._pending.discard(name)
        features = self._features.get(name)
        qsl = attn_metadata.query_start_loc.tolist()
        slots = attn_metadata.slot_mapping
        scale = float(layer.impl.scale)
        window = self.cfg.window_tokens
        by_slot = self._by_slot.get(self._group_of[name], {})
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            r = by_slot.get(int(slots[a]))
            if r is None or r.num_tokens != b - a:
                raise RuntimeError(
                    f"kvstack streaming: cannot match batch segment {i} (slot {int(slots[a])}, "
                    f"{b - a} tokens) of {name} to a scheduled request")
            pages = r.pages
            if self._native is None:
                self._native = cpu_native.usable(layer)
            if self._native and r.start <= window:
                # the whole history is one window: vLLM's own CPU kernel, no LSE merge needed
                hk, hv = self.store.read(name, pages, 0, r.start) if r.start else (None, None)
                cpu_native.attend_one_window(layer, query[a:b], hk, hv, key[a:b], value[a:b],
                                             output[a:b], self.layout.block_size)
            else:

                def history(s, e, _p=pages):
                    return self.store.read(name, _p, s, e)

                windowed_attention(query[a:b], key[a:b], value[a:b], history, r.start, window,
                                   scale, out=output[a:b], features=features)
            self.store.write(name, pages, r.start, key[a:b], value[a:b])
        if qsl[-1] < output.shape[0]:
            output[qsl[-1]:].zero_()
        return output
