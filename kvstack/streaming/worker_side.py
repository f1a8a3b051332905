"""Worker side of the streaming connector: the host-tier K/V pools and the attention of the
streaming layers (history in windows + the new tokens, merged by log-sum-exp)."""

from __future__ import annotations

from . import cpu_native
from .config import StreamingConfig
from .host_tier import HostStore
from .layout import ReqStep, StreamingMetadata, _Layout
from .windowed import windowed_attention


class _WorkerSide:
    def __init__(self, cfg: StreamingConfig, layout: _Layout):
        self.cfg = cfg
        self.layout = layout
        self.layers = frozenset(layout.layers)
        self.store = HostStore(list(layout.layers), layout.num_pages, cfg.page_tokens,
                               layout.num_kv_heads, layout.head_size, layout.dtype,
                               path=cfg.host_tier_path)
        self._group_of = {name: layout.group_of(name) for name in layout.layers}
        self._by_slot: dict[int, dict[int, ReqStep]] = {}  # group -> anchor slot -> request
        # CPU: one-window histories go through vLLM's own CPU kernel (cpu_native.py); decided
        # at the first streaming layer (None: not yet), off when the layers use another backend.
        self._native: bool | None = None if cfg.cpu_native_attention else False

    def begin_step(self, meta: StreamingMetadata) -> None:
        first = self.layout.group
        self._by_slot = {g: {r.anchor(g, first): r for r in meta.reqs}
                         for g in self.layout.all_groups()}

    def attention(self, layer, query, key, value, output, attn_metadata):
        name = layer.layer_name
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
                                   scale, out=output[a:b])
            self.store.write(name, pages, r.start, key[a:b], value[a:b])
        if qsl[-1] < output.shape[0]:
            output[qsl[-1]:].zero_()
        return output
