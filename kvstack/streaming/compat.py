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


def align_cpu_attention_isa(vllm_config: Any, layers: dict[str, Any]) -> list[str]:
    """Re-pick the ISA of vLLM's CPU attention for the block size in effect; the layers changed.

    - vLLM 0.25.1: the impl picks its ISA at construction, from ``cache_config.block_size`` (AMX
      needs a multiple of 32), and the hybrid KV cache manager may lower the block size afterwards:
      with a streaming layer's one-token window next to sliding-window layers (tiny Gemma-3,
      block size 32 asked for) the KV cache got 16-token blocks, the impls kept "amx", and the AMX
      kernel failed its block-size check at the first step on AMX CPUs (the 0.25 hooks patch now
      keeps the user's block size for paged layers, so this is a second guard, which no engine test
      reaches since that fix; tests/env/streaming/test_compat_isa.py pins it without an engine). The KV cache is allocated
      but not yet written here, so the ISA (and the cache layout its kernels write) can still
      change; the metadata builders read the block size in effect.
    - vLLM 0.32.0: the builder sets ``layer.isa`` per KV cache group from the group's block size
      (no ``impl.isa``): nothing to do.
    """
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        return []
    pick = getattr(cpu_attn, "_get_attn_isa", None)
    if pick is None:
        return []
    block = vllm_config.cache_config.block_size
    dtype = vllm_config.model_config.dtype
    changed = []
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        isa = getattr(impl, "isa", None)
        if isa is None or type(impl).__module__ != cpu_attn.__name__:
            continue
        want = pick(dtype, block, getattr(impl, "head_size", None),
                    getattr(impl, "kv_cache_dtype", None))
        if want != isa:
            impl.isa = want
            changed.append(name)
    return changed
