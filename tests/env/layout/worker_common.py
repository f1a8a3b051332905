"""What the layout workers (*_worker.py, each run in its own process) share: the case registry
and its runner, loading a patched file as a module, and the torch stand-in for the compiled
`_C_cache_ops.reshape_and_cache_flash` (not in the CPU wheel). Import it after the worker has set
its environment (TRITON_INTERPRET=1 ...): it imports torch."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
CASES: dict[str, Callable[[], object]] = {}


def case(name: str):
    """Register the decorated function as the case `name` (a failure is an exception)."""
    def deco(fn):
        CASES[name] = fn
        return fn
    return deco


def run_cases(only: set[str] | None = None, *, limit: int = 6) -> dict[str, dict]:
    """Run the registered cases (only those named in `only`, when given) in order: name ->
    {"ok", "detail"}, the detail being the traceback of a failing case."""
    results = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            fn()
            results[name] = {"ok": True, "detail": ""}
        except Exception:  # noqa: BLE001 - every case is reported to the test
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=limit)}
    return results


def load_module(path, name: str):
    """Execute the file at `path` as module `name` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def ref_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                kv_cache_dtype, k_scale, v_scale):
    """The compiled store op's contract in torch: write each token's K and V at its slot
    (block = slot // block_size) through the given (num_blocks, block_size, heads, dim) views,
    whatever their strides; slots < 0 are padding; fp8 quantizes with the scales."""
    assert key_cache.stride(0) == value_cache.stride(0), "the compiled op checks this"
    assert key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:], key_cache.shape
    n = slot_mapping.shape[0]  # the op uses the slot mapping's length, not key's
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    block_size = key_cache.size(1)
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size

    def convert(x, scale, cache):
        x = x[:n][valid]
        if kv_cache_dtype.startswith("fp8"):
            q = (x.float() / scale.float()).to(FP8)
            return q.view(torch.uint8) if cache.dtype == torch.uint8 else q.to(cache.dtype)
        return x.to(cache.dtype)

    key_cache[blocks, offsets] = convert(key, k_scale, key_cache)
    value_cache[blocks, offsets] = convert(value, v_scale, value_cache)


def register_store_stand_in(impl=ref_reshape_and_cache_flash) -> torch.library.Library:
    """Define `_C_cache_ops.reshape_and_cache_flash` for CPU with `impl`. Keep the returned
    library alive for as long as the op is used."""
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    lib.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, "
        "Tensor v_scale) -> ()"
    )
    lib.impl("reshape_and_cache_flash", impl, "CPU")
    return lib
