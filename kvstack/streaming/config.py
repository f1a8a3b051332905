"""Configuration of the streaming connector and the choice of streaming layers.

Everything here is a pure function of ``kv_connector_extra_config`` and the model config, so the
class-level hook (consulted while vLLM collects the KV cache specs, before any connector instance
exists), the scheduler-side connector and the worker-side connector all agree on which layers
stream.

Keys of ``kv_connector_extra_config`` (all optional):

- ``streaming_layers``: list of regular expressions matched (``re.search``) against attention layer
  names, or ``"auto"`` (default): the NoPE global layers of iRoPE models (Llama-4:
  ``no_rope_layers[i] == 0``), else every full-attention layer.
- ``window_mib`` (default 256): the windowed path's window in bytes: K+V of one streaming layer's
  window in the KV cache's dtype (the rank's KV heads), rounded down to whole pages and capped at
  ``max_model_len``. Windows are what a device holds of the history at once (two staging buffers of
  a window each, scratch.py), so the per-window fixed costs (a copy and a kernel call) are paid
  once per this many bytes whatever the model: 256 MiB is 65,536 tokens of an 8B model's layer
  (8 KV heads x 128, bf16), 16 windows per layer and step at 1M tokens (the floor bench's
  ``--window-mib`` default, the same constant). Layers whose scores the fused kernel cannot apply
  (soft-cap, ALiBi: the float32 reference path, whose scores grow with the window) take at most
  ``REFERENCE_WINDOW_TOKENS`` (1024) tokens a window.
- ``window_tokens`` (default: from ``window_mib``): the window in tokens, for every streaming
  layer; set one of the two, not both.
- ``device_window_tokens`` (default 1): the sliding window the device KV cache of a streaming layer
  is bounded to. The connector never reads it back (attention runs over the host tier), so the
  minimum is enough; the device then holds only the blocks of the current step.
- ``device_scratch_mib`` (default: estimated): device memory the windowed path may allocate
  after vLLM has profiled memory (two staging buffers of a window, the attention temporaries of
  one window at ``max_num_batched_tokens``; scratch.py). On a GPU, kvstack's gpu_worker patch takes
  it out of the KV cache memory before the cache is allocated and logs it. A value below the
  staging buffers is refused at start-up.
- ``page_tokens`` (default 32): host-tier page size in tokens (the unit of allocation and reuse).
- ``host_tier_gib`` (default 1.0): host-tier capacity.
- ``host_tier_path``: a file to back the host tier (memory-mapped) for more than RAM.
- ``prefix_reuse`` (default true): keep full prompt pages after a request finishes and reuse them.
- ``on_host_tier_full`` (default ``"fail"``): what happens to a new request when the host tier
  cannot hold it now (other requests hold the pages): ``"fail"`` finishes it at once with finish
  reason ``"error"`` and the reason as its stop reason, and the engine keeps serving the others;
  ``"wait"`` keeps it queued until finished requests free enough pages. Waiting is first come,
  first served: the pages a waiting request needs are kept for it, so later requests are admitted
  only into what is left after every earlier waiting request's need (a stream of small requests
  never starves a large one).
- ``wait_timeout_s`` (default none: no limit): with ``"wait"``, a request that has waited this many
  seconds for host-tier room fails alone (finish reason ``"error"``, the reason as its stop reason).
- ``decode_reserve_tokens`` (default 256, or ``"max"``): host-tier room reserved at admission
  beyond the prompt: ``prompt + min(max_tokens, decode_reserve_tokens)``. A request that decodes
  past its reservation takes free pages as it grows; if none is free it fails alone (finish reason
  ``"error"``, its tokens so far kept), and the others go on. ``"max"`` reserves
  ``prompt + max_tokens`` up front, so a request admitted is never failed later, but a server
  request without ``max_tokens`` then reserves all of ``max_model_len``.
- ``cpu_native_attention`` (default true): on vLLM's CPU backend (and a ``page_tokens`` its kernel
  takes as a block size: a multiple of 32 on vLLM 0.32, of 16 on 0.25), the host tier is kept in
  the kernel's cache layout and attended in place by vLLM's own CPU kernel, the whole batch in one
  call per layer, with no windows (see ``cpu_native.py``); false forces the windowed torch path
  (what a GPU runs) everywhere. ``window_mib`` / ``window_tokens`` apply to the windowed path only.
- ``lmcache`` (default none): the **shared tier**, a dict of LMCache config keys: full prompt pages
  of the streaming layers are also written through LMCache's storage (its StorageManager and
  backends) and a new request's prefix is looked up there after the host tier, so another engine
  process or host that shares only the backend reuses it (shared_tier.py). Keys: ``remote_url``
  (``lm://HOST:PORT`` = ``lmcache_server``, ``redis://HOST:PORT``, ...), ``remote_serde``
  (``"naive"`` only), ``local_disk`` + ``max_local_disk_size`` (GB), ``max_local_cpu_size`` (GB of
  LMCache's staging buffer for objects in flight, default 0.5), ``blocking_timeout_secs``,
  ``extra_config``; ``local_cpu`` must stay false (the host tier is the RAM copy). At least one
  backend; anything else is refused at start-up, as are prefix reuse off, layers outside the host
  tier that would need their device KV restored (``prefix_reuse`` impossible) and tensor or
  pipeline parallelism. A backend that is down or goes away costs a recompute and a warning.

Set by vLLM's MultiConnector (kvstack's joint-hits patch), never by a user: ``kv_joint_hits``
(true when the connector runs next to others, e.g. ``LMCacheConnectorV1`` for the layers that do
not stream: every connector then loads the same prefix, so prefix reuse no longer needs the other
layers to need no device KV) and ``kv_paged_layers``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
MIB = 1 << 20
# The windowed path's default window, K+V bytes of one layer's window (bench/streaming_gpu.py's
# --window-mib default too), and the cap of a reference-path layer's window (its float32 scores are
# heads x query tokens x window).
DEFAULT_WINDOW_MIB = 256.0
REFERENCE_WINDOW_TOKENS = 1024
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StreamingConfig:
    streaming_layers: tuple[str, ...] | None = None  # None: auto
    window_tokens: int | None = None  # None: sized by window_mib (`window`)
    window_mib: float = DEFAULT_WINDOW_MIB
    device_window_tokens: int = 1
    page_tokens: int = 32
    host_tier_gib: float = 1.0
    host_tier_path: str | None = None
    prefix_reuse: bool = True
    on_host_tier_full: str = "fail"
    wait_timeout_s: float | None = None  # "wait": fail a request after waiting this long
    cpu_native_attention: bool = True
    decode_reserve_tokens: int | None = 256  # None: "max" (prompt + max_tokens)
    device_scratch_mib: float | None = None  # None: scratch.plan's estimate
    # the shared tier: LMCache config (sorted items; `lmcache_config` gives the dict), or None
    lmcache: tuple[tuple[str, Any], ...] | None = None
    # next to other connectors under MultiConnector's joint prefix hits (set by MultiConnector)
    joint_hits: bool = False

    @property
    def lmcache_config(self) -> dict[str, Any] | None:
        return dict(self.lmcache) if self.lmcache is not None else None

    def window(self, token_bytes: int, max_model_len: int | None = None,
               reference: bool = False) -> int:
        """Tokens of history one window holds: ``window_tokens`` where set, else ``window_mib``
        over `token_bytes` (K+V bytes of one token of one streaming layer, the rank's KV heads)
        in whole pages, at most `max_model_len` rounded up to a page, and for a layer on the
        reference path (`reference`) at most REFERENCE_WINDOW_TOKENS."""
        if self.window_tokens is not None:
            return self.window_tokens
        P = self.page_tokens
        w = int(self.window_mib * MIB) // max(1, token_bytes) // P * P
        if reference:
            w = min(w, REFERENCE_WINDOW_TOKENS)
        if max_model_len:
            w = min(w, -(-max_model_len // P) * P)
        return max(P, w)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "StreamingConfig":
        extra = dict(extra or {})
        layers = extra.get("streaming_layers", AUTO)
        if layers in (None, AUTO):
            patterns = None
        elif isinstance(layers, str):
            patterns = (layers,)
        else:
            patterns = tuple(str(p) for p in layers)
        cfg = cls(
            streaming_layers=patterns,
            window_tokens=_window_tokens(extra),
            window_mib=_positive(extra.get("window_mib", cls.window_mib),
                                 "window_mib must be a positive number of MiB"),
            device_window_tokens=int(extra.get("device_window_tokens", cls.device_window_tokens)),
            page_tokens=int(extra.get("page_tokens", cls.page_tokens)),
            host_tier_gib=float(extra.get("host_tier_gib", cls.host_tier_gib)),
            host_tier_path=extra.get("host_tier_path") or None,
            prefix_reuse=bool(extra.get("prefix_reuse", True)),
            on_host_tier_full=str(extra.get("on_host_tier_full", cls.on_host_tier_full)),
            wait_timeout_s=_seconds(extra.get("wait_timeout_s")),
            cpu_native_attention=bool(extra.get("cpu_native_attention", True)),
            decode_reserve_tokens=_reserve(extra.get("decode_reserve_tokens",
                                                     cls.decode_reserve_tokens)),
            device_scratch_mib=_mib(extra.get("device_scratch_mib")),
            lmcache=_lmcache(extra.get("lmcache")),
            joint_hits=bool(extra.get("kv_joint_hits", False)),
        )
        for name in ("device_window_tokens", "page_tokens"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"kvstack streaming: {name} must be positive")
        if cfg.on_host_tier_full not in ("fail", "wait"):
            raise ValueError("kvstack streaming: on_host_tier_full must be 'fail' or 'wait', "
                             f"not {cfg.on_host_tier_full!r}")
        if cfg.wait_timeout_s is not None and cfg.on_host_tier_full != "wait":
            raise ValueError("kvstack streaming: wait_timeout_s applies to on_host_tier_full="
                             "'wait' only (with 'fail' a request never waits)")
        if cfg.host_tier_gib <= 0:
            raise ValueError("kvstack streaming: host_tier_gib must be positive")
        return cfg

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "StreamingConfig":
        ktc = vllm_config.kv_transfer_config
        return cls.from_extra(ktc.kv_connector_extra_config if ktc is not None else None)


def _window_tokens(extra: dict[str, Any]) -> int | None:
    value = extra.get("window_tokens")
    if value is None:
        return None
    if extra.get("window_mib") is not None:
        raise ValueError("kvstack streaming: set window_tokens or window_mib, not both (window_mib "
                         "sizes the window in bytes, window_tokens in tokens)")
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n <= 0:
        raise ValueError(f"kvstack streaming: window_tokens must be positive, not {value!r}")
    return n


def _lmcache(value: Any) -> tuple[tuple[str, Any], ...] | None:
    if value is None:
        return None
    from .shared_tier import check_config  # no LMCache import: checks the keys only

    checked = check_config(value)
    return tuple(sorted(checked.items())) if checked is not None else None


def _positive(value: Any, message: str) -> float | None:
    """None for None, else a positive float; `message` (with the value appended) otherwise."""
    if value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = -1.0
    if not x > 0:
        raise ValueError(f"kvstack streaming: {message}, not {value!r}")
    return x


def _seconds(value: Any) -> float | None:
    return _positive(value, "wait_timeout_s must be a positive number of seconds (or unset: no "
                            "limit)")


def _mib(value: Any) -> float | None:
    return _positive(value, "device_scratch_mib must be a positive number of MiB (or unset: "
                            "estimated)")


def _reserve(value: Any) -> int | None:
    if value is None or value == "max":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError("kvstack streaming: decode_reserve_tokens must be a number of tokens "
                         f">= 0 or 'max', not {value!r}")
    return n


def layer_index(layer_name: str) -> int | None:
    m = _LAYER_INDEX.search(layer_name)
    return int(m.group(1)) if m else None


def selects_layer(cfg: StreamingConfig, model_config: Any, layer_name: str) -> bool:
    """Whether `layer_name` (an attention layer that would keep a full-attention KV cache)
    streams under `cfg`."""
    if cfg.streaming_layers is not None:
        return any(re.search(p, layer_name) for p in cfg.streaming_layers)
    hf = getattr(model_config, "hf_text_config", None) if model_config is not None else None
    no_rope = getattr(hf, "no_rope_layers", None)
    if no_rope:
        # iRoPE (Llama-4): no_rope_layers[i] == 0 marks the NoPE global layers.
        idx = layer_index(layer_name)
        return idx is not None and idx < len(no_rope) and not no_rope[idx]
    return True  # every full-attention layer
