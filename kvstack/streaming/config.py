"""Configuration of the streaming connector and the choice of streaming layers.

Everything here is a pure function of ``kv_connector_extra_config`` and the model config, so the
class-level hook (consulted while vLLM collects the KV cache specs, before any connector instance
exists), the scheduler-side connector and the worker-side connector all agree on which layers
stream.

Keys of ``kv_connector_extra_config`` (all optional):

- ``streaming_layers``: list of regular expressions matched (``re.search``) against attention layer
  names, or ``"auto"`` (default): the NoPE global layers of iRoPE models (Llama-4:
  ``no_rope_layers[i] == 0``), else every full-attention layer.
- ``window_tokens`` (default 1024): tokens of host-tier history attended per window.
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
  (what a GPU runs) everywhere. ``window_tokens`` applies to the windowed path only.
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
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StreamingConfig:
    streaming_layers: tuple[str, ...] | None = None  # None: auto
    window_tokens: int = 1024
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
            window_tokens=int(extra.get("window_tokens", cls.window_tokens)),
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
        for name in ("window_tokens", "device_window_tokens", "page_tokens"):
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
