"""The differences between the vLLM versions the streaming connector runs on (0.25.1, 0.32.0).

One small function per difference, each saying which version needs what. Everything else in
kvstack.streaming is the same code on both; version-independent changes (e.g. beginning a step in
``bind_connector_metadata``, which both versions call before the forward) need no switch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def cpu_attn_isa(layer: Any) -> str:
    """The ISA string of vLLM's CPU attention kernel for `layer` (e.g. "amx", "vec").

    - vLLM 0.25.1: the backend impl computes it at construction (``layer.impl.isa``).
    - vLLM 0.32.0: the impl has none; the CPU metadata builder computes it for its KV cache
      group (from the group's block size) and sets it on each layer (``layer.isa``).
    """
    isa = getattr(layer.impl, "isa", None)
    return isa if isa is not None else layer.isa


def cpu_scheduler_metadata_kwargs(get_scheduler_metadata: Any, impl: Any) -> dict[str, Any]:
    """Extra keyword arguments for ``vllm._custom_ops.cpu_attn_get_scheduler_metadata``.

    - vLLM 0.25.1: none (the function has no ``kv_cache_dtype``).
    - vLLM 0.32.0: ``kv_cache_dtype`` (the impl's), which the kernel's scheduler needs to plan an
      FP8 KV cache; its default "auto" would be wrong for one.
    """
    params = _parameters(get_scheduler_metadata)
    return {"kv_cache_dtype": impl.kv_cache_dtype} if "kv_cache_dtype" in params else {}


@functools.lru_cache(maxsize=None)
def _parameters(fn: Any) -> frozenset[str]:  # once per function: called every step
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()
