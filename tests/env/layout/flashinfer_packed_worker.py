"""Worker for test_flashinfer_packed.py.

Usage: python flashinfer_packed_worker.py BACKEND_PY REFERENCE_0251_PY [CASE...]
Prints one JSON object {case: {"ok": bool, "detail": str}} on the last stdout line.
BACKEND_PY is the flashinfer.py under test (the patched copy, or the unpatched file for the
negative control); REFERENCE_0251_PY is vLLM 0.25.1's unpatched flashinfer.py, used only by
the nvfp4 case that compares the bytes written with those 0.25.1 writes.

Why a separate process: FlashInfer is not installed in the CPU venv (and is CUDA only), so
`flashinfer` and its submodules are stand-in modules here; the checks also register a
stand-in for the compiled op `_C_cache_ops::reshape_and_cache_flash` and set module globals
of the backend. All of that is process-global, so it never happens in the pytest process.
Both backend files are loaded under private module names; everything else they import is
the installed vLLM.

What is real and what is a stand-in (CPU only):
- real: the backend's get_kv_cache_shape / get_kv_cache_stride_order, its split helpers,
  FlashInferImpl (the real __init__, do_kv_cache_update and forward), its Triton fp8
  dequant kernel for the trtllm prefill (run by Triton's interpreter, TRITON_INTERPRET=1,
  set below before Triton is imported), vLLM's nvfp4 data/scale view helper.
- stand-in: `reshape_and_cache_flash` is a torch reference of the CUDA op's contract
  (csrc/libtorch_stable/cache_kernels.cu): slot -> (slot // key_cache.size(1),
  slot % key_cache.size(1)), written through the views the backend passes (so addressed by
  their strides, as the kernel does by stride(0..2)), fp8 as float8_e4m3fn bytes of
  value / scale, slots < 0 skipped. For "nvfp4" it follows the address arithmetic of
  `reshape_and_cache_nvfp4_dispatch` (nvfp4_kv_cache_kernels.cu): block stride from the
  view, HND/NHD from stride(2) > stride(1), inner strides *computed*, the scale region at
  data_ptr + H * N * data_dim of each side. It writes recognisable bytes instead of real FP4
  codes, and V's scales without the trtllm-gen swizzle (the swizzle permutes inside a side's
  scale region of a block; the regions are what the layout decides).
- stand-in: FlashInfer's paged prefill/decode wrappers, trtllm_batch_decode_with_kv_cache
  and trtllm_batch_context_with_kv_cache are float64 torch references that read the
  paged K/V the way FlashInfer documents for a (k_cache, v_cache) tuple: NHD
  (pages, page_size, kv_heads, head_dim), HND (pages, kv_heads, page_size, head_dim).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import importlib.machinery
import json
import sys
import types
from types import SimpleNamespace

import torch
from worker_common import (FP8, CASES, case, load_module, ref_reshape_and_cache_flash,
                           register_store_stand_in, run_cases)
import triton  # noqa: E402  (real Triton, interpreted: TRITON_INTERPRET=1 above)
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402

import vllm.triton_utils as triton_utils  # noqa: E402

# vLLM on a machine without a GPU puts a placeholder in vllm.triton_utils; the backend's
# dequant kernel must be a real (interpreted) Triton kernel, as in layout_worker.py.
triton_utils.HAS_TRITON = True
triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice

PATH = sys.argv[1]
REF_PATH = sys.argv[2]
ONLY = set(sys.argv[3:])

NB, BS, HKV, HQ, D = 8, 16, 2, 4, 64
NV_DATA, NV_SCALE = D // 2, D // 16
NV_FULL = NV_DATA + NV_SCALE


# ---- stand-in flashinfer modules (the package is not installed on CPU) --------------------

class _Wrapper:
    def __init__(self, *args, **kwargs):
        pass


def _install_flashinfer_stubs() -> None:
    names = {
        "flashinfer": ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                       "BatchPrefillWithRaggedKVCacheWrapper", "MultiLevelCascadeAttentionWrapper"],
        "flashinfer.decode": ["fast_decode_plan", "trtllm_batch_decode_with_kv_cache"],
        "flashinfer.prefill": ["trtllm_batch_context_with_kv_cache"],
        "flashinfer.utils": ["FP4Tensor"],
    }
    for mod_name, attrs in names.items():
        mod = types.ModuleType(mod_name)
        mod.__spec__ = importlib.machinery.ModuleSpec(mod_name, None)
        for attr in attrs:
            if attr[0].isupper():
                setattr(mod, attr, type(attr, (_Wrapper,), {}))
            else:
                setattr(mod, attr, _not_on_cpu(attr))
        sys.modules[mod_name] = mod


def _not_on_cpu(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flashinfer.{name} is a stand-in; the case must replace it")
    return fn


try:  # a real FlashInfer would be CUDA-only anyway; never expected on this CPU venv
    import flashinfer  # noqa: F401
    HAVE_FLASHINFER = True
except ImportError:
    HAVE_FLASHINFER = False
    _install_flashinfer_stubs()


# ---- the stand-in for the compiled store op -----------------------------------------------

def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def nvfp4_pattern(x: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """Recognisable non-zero bytes for one (token, head) vector (stand-in for FP4 codes)."""
    return ((x[:n].float() * 37).round().to(torch.int64) + salt).remainder(251).to(torch.uint8) + 1


def ref_nvfp4_store(key, value, key_cache, value_cache, slot_mapping):
    num_heads, head_size = key.size(1), key.size(2)
    data_dim, scale_dim = head_size // 2, head_size // 16
    assert key_cache.dim() == 4 and key_cache.size(3) == data_dim + scale_dim
    block_size = key_cache.size(1)
    is_hnd = key_cache.stride(2) > key_cache.stride(1)
    block_stride = key_cache.stride(0)
    if is_hnd:
        d_head, d_off, s_head, s_off = block_size * data_dim, data_dim, block_size * scale_dim, scale_dim
    else:
        d_head, d_off = data_dim, num_heads * data_dim
        s_head, s_off = scale_dim, num_heads * scale_dim
    data_per_kv = num_heads * block_size * data_dim
    for side, (x, cache) in enumerate(((key, key_cache), (value, value_cache))):
        flat = _storage_bytes(cache)
        base = cache.storage_offset()
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            b, o = divmod(slot, block_size)
            for h in range(num_heads):
                d0 = base + b * block_stride + h * d_head + o * d_off
                flat[d0: d0 + data_dim] = nvfp4_pattern(x[t, h], data_dim, 2 * side)
                s0 = base + data_per_kv + b * block_stride + h * s_head + o * s_off
                flat[s0: s0 + scale_dim] = nvfp4_pattern(x[t, h, data_dim:], scale_dim, 2 * side + 1)


def store_stand_in(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                   k_scale, v_scale):
    """worker_common's stand-in, plus the nvfp4 store (a separate compiled op in vLLM)."""
    if kv_cache_dtype == "nvfp4":
        return ref_nvfp4_store(key, value, key_cache, value_cache, slot_mapping)
    return ref_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                       kv_cache_dtype, k_scale, v_scale)


_LIB = register_store_stand_in(store_stand_in)

M = load_module(PATH, "kvstack_layout_fi_under_test")
Backend = M.FlashInferBackend


def set_layout(mod, layout: str) -> None:
    mod.get_kv_cache_layout = lambda: layout


def allocate(layout: str, dtype: torch.dtype, cache_dtype_str: str = "auto", *, mod=None,
             offset: int = 0, order=None):
    """The cache the model runner builds: physical memory permuted to the logical shape."""
    mod = M if mod is None else mod
    set_layout(mod, layout)
    shape = mod.FlashInferBackend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=cache_dtype_str)
    order = mod.FlashInferBackend.get_kv_cache_stride_order() if order is None else order
    assert len(order) == len(shape), (shape, order)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    n = 1
    for s in physical:
        n *= s
    flat = torch.zeros(offset + n, dtype=dtype)
    return flat[offset:].view(physical).permute(*inverse)


def workload(dtype, seed=0):
    """A decode (position 37 of 38) and a prefill of 20 tokens, on shuffled blocks.

    Decodes come first in the batch (FlashInfer's order). Block 0 (vLLM's null block) and
    two others stay unused, so "nothing else written" is a real check.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [38, 20], [1, 20]
    blocks = (1 + torch.randperm(NB - 1, generator=g)).tolist()
    tables = [blocks[:3], blocks[3:5]]
    slots = []
    for s, L in enumerate(seq_lens):
        for p in range(L):
            slots.append(tables[s][p // BS] * BS + p % BS)
    T = len(slots)
    keys = torch.randn(T, HKV, D, generator=g).to(dtype)
    vals = torch.randn(T, HKV, D, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return SimpleNamespace(seq_lens=seq_lens, q_lens=q_lens, tables=tables,
                           slots=torch.tensor(slots, dtype=torch.int64), keys=keys, vals=vals,
                           q=q, block_table=block_table)


def attend(q, k, v, q_positions):
    """float64 causal attention of one sequence; k, v token-ordered (L, HKV, D)."""
    k = k.double().repeat_interleave(HQ // HKV, dim=1)
    v = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * D**-0.5
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_positions[:, None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def reference(w, keys, vals, seqs=(0, 1)):
    outs, tok0 = [], 0
    q0 = 0
    for s, (L, ql) in enumerate(zip(w.seq_lens, w.q_lens)):
        if s in seqs:
            outs.append(attend(w.q[q0: q0 + ql], keys[tok0: tok0 + L], vals[tok0: tok0 + L],
                               torch.arange(L - ql, L)))
        tok0 += L
        q0 += ql
    return torch.cat(outs)


def gather_paged(kv, layout, table, L):
    """Token-ordered K or V of one sequence from a FlashInfer-layout paged view."""
    rows = []
    for p in range(L):
        page, slot = table[p // BS], p % BS
        rows.append(kv[page, slot] if layout == "NHD" else kv[page, :, slot])
    return torch.stack(rows)


def paged_reference(w, kv_pair, layout, seqs, k_scale=1.0, v_scale=1.0, tables=None):
    """What FlashInfer computes from a (k, v) paged pair (float64)."""
    k_cache, v_cache = kv_pair
    tables = w.tables if tables is None else tables
    outs = []
    q_start = [0, w.q_lens[0]]
    for s in seqs:
        L, ql = w.seq_lens[s], w.q_lens[s]
        kk = gather_paged(k_cache, layout, tables[s], L).double() * k_scale
        vv = gather_paged(v_cache, layout, tables[s], L).double() * v_scale
        outs.append(attend(w.q[q_start[s]: q_start[s] + ql], kk, vv, torch.arange(L - ql, L)))
    return torch.cat(outs)


def make_layer(k_scale=1.0, v_scale=1.0):
    return SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.tensor([k_scale]),
                           _v_scale=torch.tensor([v_scale]), _q_scale_float=1.0,
                           _k_scale_float=k_scale, _v_scale_float=v_scale, _o_scale_float=None)


def make_impl(kv_cache_dtype="auto", mod=None):
    """The real FlashInferImpl.__init__. Its trtllm capability probe needs a vLLM config and a
    GPU; on CPU the answer is "no", so the probe is answered directly."""
    mod = M if mod is None else mod
    mod.can_use_trtllm_attention = lambda *args, **kwargs: False
    return mod.FlashInferImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV,
                            alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype)


def expect_value_error(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in: {exc}"
        return str(exc)
    raise AssertionError("accepted, expected a ValueError")


# ---- shapes and stride orders ----------------------------------------------------------------

@case("shape_auto_and_fp8")
def _():
    for dtype_str in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        for layout in ("NHD", "HND"):
            set_layout(M, layout)
            shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=dtype_str)
            assert shape == (NB, HKV, BS, 2 * D), (dtype_str, layout, shape)


@case("shape_nvfp4_hnd")
def _():
    set_layout(M, "HND")
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str="nvfp4")
    assert shape == (NB, 2 * HKV, BS, NV_FULL), shape
    assert "nvfp4" in Backend.supported_kv_cache_dtypes


@case("shape_nvfp4_nhd_refused")
def _():
    set_layout(M, "NHD")
    expect_value_error(lambda: Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str="nvfp4"),
                       "nvfp4", "HND", "NHD")


@case("stride_orders")
def _():
    expect = {
        ("NHD", False): (NB, BS, HKV, 2 * D),
        ("HND", False): (NB, HKV, BS, 2 * D),
        ("NHD", True): (NB, 3, BS, HKV, 2 * D),
        ("HND", True): (NB, HKV, 3, BS, 2 * D),
    }
    for (layout, layers), physical in expect.items():
        set_layout(M, layout)
        order = Backend.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        shape = ((3,) if layers else ()) + Backend.get_kv_cache_shape(NB, BS, HKV, D)
        assert sorted(order) == list(range(len(shape))), (layout, layers, order)
        assert tuple(shape[i] for i in order) == physical, (layout, layers, order)
    # nvfp4 (HND only): K heads then V heads, each side a dense (H, N, F) region per block
    set_layout(M, "HND")
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str="nvfp4")
    order = Backend.get_kv_cache_stride_order()
    assert tuple(shape[i] for i in order) == (NB, 2 * HKV, BS, NV_FULL)


@case("blocks_first")
def _():
    for layout in ("NHD", "HND"):
        set_layout(M, layout)
        assert Backend.get_kv_cache_block_dim(BS, HKV, D) == 0
        assert Backend.indexes_kv_by_block_stride()


# ---- views --------------------------------------------------------------------------------

@case("store_views_bf16_fp8")
def _():
    C = 2 * D
    strides = {"NHD": (BS * HKV * C, HKV * C, C, 1), "HND": (HKV * BS * C, C, BS * C, 1)}
    for layout in ("NHD", "HND"):
        for dtype, dtype_str in ((torch.bfloat16, "auto"), (torch.uint8, "fp8")):
            cache = allocate(layout, dtype, dtype_str, offset=5)
            k, v = M.split_packed_kv_cache(cache, HKV, D)
            assert k.shape == v.shape == (NB, BS, HKV, D)
            assert k.stride() == v.stride() == strides[layout], (layout, k.stride())
            assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
            assert k.data_ptr() == cache.data_ptr(), "K at content offset 0"
            assert v.data_ptr() - k.data_ptr() == D * cache.element_size(), "V at head_size"
            assert k.dtype == v.dtype == dtype


@case("flashinfer_views_bf16_fp8")
def _():
    C = 2 * D
    expect = {"NHD": ((NB, BS, HKV, D), (BS * HKV * C, HKV * C, C, 1)),
              "HND": ((NB, HKV, BS, D), (HKV * BS * C, BS * C, C, 1))}
    for layout in ("NHD", "HND"):
        for dtype, dtype_str in ((torch.bfloat16, "auto"), (torch.uint8, "fp8")):
            cache = allocate(layout, dtype, dtype_str, offset=3)
            k, v = M.flashinfer_kv_cache_views(cache, HKV, D)
            shape, stride = expect[layout]
            assert k.shape == v.shape == shape and k.stride() == v.stride() == stride, (
                layout, k.shape, k.stride())
            assert k.data_ptr() == cache.data_ptr()
            assert v.data_ptr() - k.data_ptr() == D * cache.element_size()


@case("views_nvfp4_hnd")
def _():
    cache = allocate("HND", torch.uint8, "nvfp4", offset=11)
    side = HKV * BS * NV_FULL
    k, v = M.split_packed_kv_cache(cache, HKV, D, is_nvfp4=True)
    assert k.shape == v.shape == (NB, BS, HKV, NV_FULL)
    assert k.stride() == v.stride() == (2 * side, NV_FULL, BS * NV_FULL, 1)
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() - k.data_ptr() == side
    fk, fv = M.flashinfer_kv_cache_views(cache, HKV, D, is_nvfp4=True)
    assert fk.shape == fv.shape == (NB, HKV, BS, NV_FULL)
    assert fk.stride() == fv.stride() == (2 * side, BS * NV_FULL, NV_FULL, 1)
    assert fk.data_ptr() == cache.data_ptr() and fv.data_ptr() - fk.data_ptr() == side
    # 0.25.1's data/scale view helper splits each side: [data | scale] per side of a block
    from vllm.utils.torch_utils import nvfp4_kv_cache_split_views
    (kd,), (ks,) = nvfp4_kv_cache_split_views(fk)
    (vd,), (vs,) = nvfp4_kv_cache_split_views(fv)
    assert kd.shape == (NB, HKV, BS, NV_DATA) and ks.shape == (NB, HKV, BS, NV_SCALE)
    assert ks.data_ptr() - kd.data_ptr() == HKV * BS * NV_DATA
    assert vd.data_ptr() - kd.data_ptr() == side and vs.data_ptr() - vd.data_ptr() == HKV * BS * NV_DATA


@case("refuses_unpacked_caches")
def _():
    bad = {
        "0.25.1 5-D": torch.zeros(NB, 2, BS, HKV, D),
        "content != 2*head_size": torch.zeros(NB, HKV, BS, 2 * D + 8),
        "wrong num_kv_heads": torch.zeros(NB, HKV + 1, BS, 2 * D),
        "3-D": torch.zeros(NB, BS, 2 * D),
    }
    for what, cache in bad.items():
        for fn in (M.split_packed_kv_cache, M.flashinfer_kv_cache_views):
            try:
                fn(cache, HKV, D)
            except ValueError as exc:
                assert "packed KV cache" in str(exc), (what, str(exc))
            else:
                raise AssertionError(f"a {what} cache was accepted by {fn.__name__}")
    # nvfp4: the 0.25.1 5-D cache and a bf16-shaped cache are refused too
    for cache in (torch.zeros(NB, 2, BS, HKV, NV_FULL, dtype=torch.uint8),
                  torch.zeros(NB, HKV, BS, 2 * D, dtype=torch.uint8)):
        expect_value_error(lambda: M.split_packed_kv_cache(cache, HKV, D, True), "packed KV cache")
    # the backend's own entry points refuse it (before any kernel runs)
    w = workload(torch.bfloat16)
    old = torch.zeros(NB, 2, BS, HKV, D, dtype=torch.bfloat16)
    expect_value_error(lambda: make_impl().do_kv_cache_update(make_layer(), w.keys, w.vals, old,
                                                               w.slots), "packed KV cache")
    meta = forward_meta(w, torch.bfloat16, None, None)
    out = torch.zeros(sum(w.q_lens), HQ, D, dtype=torch.bfloat16)
    impl = make_impl()
    expect_value_error(lambda: impl.forward(make_layer(), w.q, w.keys[:21], w.vals[:21], old,
                                            meta, out), "packed KV cache")


@case("nvfp4_nhd_cache_refused")
def _():
    # An nvfp4 cache laid out token-major (what NHD would give): K and V heads interleave
    # per token, which the compiled nvfp4 kernels cannot address. Refused by both helpers,
    # do_kv_cache_update and forward, with the reason.
    cache = allocate("HND", torch.uint8, "nvfp4", order=(0, 2, 1, 3))
    for fn in (M.split_packed_kv_cache, M.flashinfer_kv_cache_views):
        expect_value_error(lambda: fn(cache, HKV, D, True), "nvfp4", "HND", "NHD")
    w = workload(torch.bfloat16)
    expect_value_error(lambda: make_impl("nvfp4").do_kv_cache_update(
        make_layer(), w.keys, w.vals, cache, w.slots), "nvfp4", "NHD")
    # a cross-layer HND nvfp4 view (sides not dense per block) is refused too
    big = torch.zeros(NB, 2 * HKV, 3, BS, NV_FULL, dtype=torch.uint8)[:, :, 1]
    expect_value_error(lambda: M.split_packed_kv_cache(big, HKV, D, True), "nvfp4")


# ---- round trip through the backend's own do_kv_cache_update ------------------------------

def expected_bytes(x, cache_dtype, kv_cache_dtype, scale):
    if kv_cache_dtype.startswith("fp8"):
        return (x.float() / scale).to(FP8).view(torch.uint8)
    return x.to(cache_dtype)


def store_case(layout, dtype, kv_cache_dtype="auto"):
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        cache_dtype = torch.uint8 if fp8 else dtype
        w = workload(dtype)
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        cache = allocate(layout, cache_dtype, kv_cache_dtype, offset=7)
        slots = torch.cat([w.slots, torch.full((3,), -1, dtype=torch.int64)])  # padded batch
        keys = torch.cat([w.keys, torch.randn(3, HKV, D).to(dtype)])
        vals = torch.cat([w.vals, torch.randn(3, HKV, D).to(dtype)])
        make_impl(kv_cache_dtype).do_kv_cache_update(make_layer(k_scale, v_scale), keys, vals,
                                                     cache, slots)
        written = torch.zeros(NB, BS, dtype=torch.bool)
        fk, fv = M.flashinfer_kv_cache_views(cache, HKV, D)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            written[b, o] = True
            ek = expected_bytes(w.keys[i], cache_dtype, kv_cache_dtype, k_scale)
            ev = expected_bytes(w.vals[i], cache_dtype, kv_cache_dtype, v_scale)
            assert torch.equal(cache[b, :, o, :D], ek), ("K", i)
            assert torch.equal(cache[b, :, o, D:], ev), ("V", i)
            # ... and where FlashInfer reads it (its layout)
            rk, rv = (fk[b, o], fv[b, o]) if layout == "NHD" else (fk[b, :, o], fv[b, :, o])
            assert torch.equal(rk, ek) and torch.equal(rv, ev), i
        untouched = cache.permute(0, 2, 1, 3)[~written]
        assert torch.count_nonzero(untouched) == 0, "write outside the written slots"
        assert torch.count_nonzero(_storage_bytes(cache)[: 7 * cache.element_size()]) == 0
    return check


for _layout in ("NHD", "HND"):
    for _dtype in (torch.bfloat16, torch.float16):
        CASES[f"store_{_layout}_{str(_dtype)[6:]}"] = store_case(_layout, _dtype)
    CASES[f"store_{_layout}_fp8"] = store_case(_layout, torch.bfloat16, "fp8")


@case("store_nvfp4_hnd_same_bytes_as_0251")
def _():
    """nvfp4 HND: the bytes the store writes are where 0.25.1 put them, and where the
    forward's data/scale views read them; other slots stay zero."""
    ref = load_module(REF_PATH, "kvstack_layout_fi_0251")
    w = workload(torch.bfloat16)
    layer = make_layer()
    new = allocate("HND", torch.uint8, "nvfp4", offset=9)
    make_impl("nvfp4").do_kv_cache_update(layer, w.keys, w.vals, new, w.slots)
    old = allocate("HND", torch.uint8, "nvfp4", mod=ref, offset=9)
    assert old.dim() == 5, "the reference must be the unpatched 0.25.1 file"
    make_impl("nvfp4", mod=ref).do_kv_cache_update(layer, w.keys, w.vals, old, w.slots)
    assert torch.count_nonzero(_storage_bytes(new)) > 0
    assert torch.equal(_storage_bytes(new), _storage_bytes(old)), "bytes differ from 0.25.1"
    from vllm.utils.torch_utils import nvfp4_kv_cache_split_views
    fk, fv = M.flashinfer_kv_cache_views(new, HKV, D, is_nvfp4=True)
    written = torch.zeros(NB, BS, dtype=torch.bool)
    for side, (view, x) in enumerate(((fk, w.keys), (fv, w.vals))):
        (data,), (scale,) = nvfp4_kv_cache_split_views(view)
        scale = scale.view(torch.uint8)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            written[b, o] = True
            for h in range(HKV):
                assert torch.equal(data[b, h, o], nvfp4_pattern(x[i, h], NV_DATA, 2 * side))
                assert torch.equal(scale[b, h, o],
                                   nvfp4_pattern(x[i, h, NV_DATA:], NV_SCALE, 2 * side + 1))
        assert torch.count_nonzero(data.permute(0, 2, 1, 3)[~written]) == 0
        assert torch.count_nonzero(scale.permute(0, 2, 1, 3)[~written]) == 0


# ---- forward: what FlashInfer gets, and attention through it --------------------------------

class RecordingWrapper:
    """Stand-in for FlashInfer's paged prefill/decode wrappers (float64 reference)."""

    def __init__(self, w, layout, seqs, causal=True):
        self.w, self.layout, self.seqs = w, layout, seqs
        self._window_left, self._logits_soft_cap, self._sm_scale = -1, 0.0, D**-0.5
        self._causal = causal
        self.seen = None

    def run(self, q, paged_kv_cache, *, q_scale=1.0, k_scale=1.0, v_scale=1.0, out=None,
            kv_cache_sf=None, **_):
        assert isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2, type(paged_kv_cache)
        self.seen = paged_kv_cache
        k, v = paged_kv_cache
        if k.dtype == FP8:
            k, v = k.float(), v.float()
        ref = paged_reference(self.w, (k, v), self.layout, self.seqs, k_scale, v_scale)
        out.copy_(ref.to(out.dtype))
        return out


def forward_meta(w, dtype, decode, prefill):
    return SimpleNamespace(
        num_actual_tokens=sum(w.q_lens), use_cascade=False, cascade_wrapper=None,
        num_decode_tokens=1, num_prefill_tokens=w.q_lens[1], num_decodes=1, num_prefills=1,
        decode=decode, prefill=prefill, q_data_type_prefill=dtype, q_data_type_decode=dtype,
        causal=True)


def fill_cache(layout, dtype, kv_cache_dtype, k_scale, v_scale, w):
    fp8 = kv_cache_dtype.startswith("fp8")
    cache = allocate(layout, torch.uint8 if fp8 else dtype, kv_cache_dtype, offset=1)
    impl = make_impl(kv_cache_dtype)
    layer = make_layer(k_scale, v_scale)
    impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
    return cache, impl, layer


def quantised(w, fp8, k_scale, v_scale):
    if not fp8:
        return w.keys, w.vals
    return ((w.keys.float() / k_scale).to(FP8).double() * k_scale,
            (w.vals.float() / v_scale).to(FP8).double() * v_scale)


def native_forward_case(layout, kv_cache_dtype):
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        dtype = torch.bfloat16
        w = workload(dtype, seed=1)
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        set_layout(M, layout)
        cache, impl, layer = fill_cache(layout, dtype, kv_cache_dtype, k_scale, v_scale, w)
        dec = RecordingWrapper(w, layout, [0])
        pre = RecordingWrapper(w, layout, [1])
        M.BatchPrefillWithPagedKVCacheWrapper = RecordingWrapper
        M.BatchDecodeWithPagedKVCacheWrapper = RecordingWrapper
        meta = forward_meta(w, dtype, M.FIDecode(wrapper=dec), M.FIPrefill(wrapper=pre))
        output = torch.zeros(sum(w.q_lens), HQ, D, dtype=dtype)
        impl.forward(layer, w.q, w.keys[:21], w.vals[:21], cache, meta, output)
        views = M.flashinfer_kv_cache_views(cache, HKV, D)
        for seen in (dec.seen, pre.seen):
            for got, view in zip(seen, views):
                assert got.data_ptr() == view.data_ptr() and got.stride() == view.stride()
                assert got.shape == view.shape and got.dtype == (FP8 if fp8 else dtype)
        keys, vals = quantised(w, fp8, k_scale, v_scale)
        err = (output.double() - reference(w, keys, vals)).abs().max().item()
        assert err < 2e-2, f"max error vs float64 reference {err}"
    return check


for _layout in ("NHD", "HND"):
    CASES[f"forward_native_{_layout}_bfloat16"] = native_forward_case(_layout, "auto")
    CASES[f"forward_native_{_layout}_fp8"] = native_forward_case(_layout, "fp8")


def trtllm_forward_case(kv_cache_dtype):
    """trtllm-gen decode + trtllm prefill (HND, as 0.25.1 requires); fp8 prefill with a bf16
    query goes through the backend's Triton dequant kernel (interpreted on CPU)."""
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        dtype = torch.bfloat16
        w = workload(dtype, seed=2)
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        set_layout(M, "HND")
        cache, impl, layer = fill_cache("HND", dtype, kv_cache_dtype, k_scale, v_scale, w)
        M._get_trtllm_workspace_buffer = lambda: torch.zeros(64, dtype=torch.uint8)
        seen = {}

        def decode_ref(*, query, kv_cache, block_tables, seq_lens, bmm1_scale, bmm2_scale,
                       out, kv_layout, q_len_per_req, **_):
            assert kv_layout == "HND" and q_len_per_req == 1
            assert isinstance(kv_cache, tuple) and len(kv_cache) == 2, type(kv_cache)
            seen["decode"] = kv_cache
            tables = [block_tables[0].tolist()]
            k, v = (t.float() if t.dtype == FP8 else t for t in kv_cache)
            # bmm1 = scale * q_scale * k_scale, bmm2 = v_scale (0.25.1's contract)
            ref = paged_reference(w, (k, v), "HND", [0], k_scale, v_scale, tables=tables)
            out.copy_(ref.to(out.dtype))

        def context_ref(*, query, kv_cache, block_tables, seq_lens, out, **_):
            seen["prefill"] = kv_cache
            tables = [None, block_tables[0].tolist()]
            if isinstance(kv_cache, tuple):
                k, v = (t.float() if t.dtype == FP8 else t for t in kv_cache)
                ks, vs = k_scale, v_scale
            else:  # fp8 dequantised mock cache (pages, 2, H, N, D), already scaled
                assert kv_cache.dim() == 5 and kv_cache.is_contiguous()
                k, v = kv_cache[:, 0], kv_cache[:, 1]
                ks = vs = 1.0
            ref = paged_reference(w, (k, v), "HND", [1], ks, vs, tables=tables)
            out.copy_(ref.to(out.dtype))

        M.trtllm_batch_decode_with_kv_cache = decode_ref
        M.trtllm_batch_context_with_kv_cache = context_ref
        decode = M.FlashInferTrtllmAPIDecode(
            kernel=M.FlashInferDecodeKernel.TRTLLM_GEN, block_tables=w.block_table[:1].clone(),
            seq_lens=torch.tensor(w.seq_lens[:1], dtype=torch.int32), max_seq_len=38)
        prefill = M.TRTLLMPrefill(
            block_tables=w.block_table[1:].clone(),
            seq_lens=torch.tensor(w.seq_lens[1:], dtype=torch.int32),
            cum_seq_lens_q=torch.tensor([0, 20], dtype=torch.int32),
            cum_seq_lens_kv=torch.tensor([0, 20], dtype=torch.int32), max_q_len=20,
            max_seq_len=20)
        meta = forward_meta(w, dtype, decode, prefill)
        output = torch.zeros(sum(w.q_lens), HQ, D, dtype=dtype)
        impl.forward(layer, w.q, w.keys[:21], w.vals[:21], cache, meta, output)
        views = M.flashinfer_kv_cache_views(cache, HKV, D)
        for got, view in zip(seen["decode"], views):
            assert got.data_ptr() == view.data_ptr() and got.stride() == view.stride()
        if fp8:
            assert not isinstance(seen["prefill"], tuple), "fp8 prefill must use the mock cache"
        keys, vals = quantised(w, fp8, k_scale, v_scale)
        err = (output.double() - reference(w, keys, vals)).abs().max().item()
        assert err < 2e-2, f"max error vs float64 reference {err}"
    return check


CASES["forward_trtllm_HND_bfloat16"] = trtllm_forward_case("auto")
CASES["forward_trtllm_HND_fp8"] = trtllm_forward_case("fp8")


@case("fp8_dequant_kernel_reads_packed_views")
def _():
    """The Triton dequant kernel (interpreted) gathers exactly the pages of the block table."""
    w = workload(torch.bfloat16, seed=3)
    k_scale, v_scale = 0.5, 0.25
    cache, _, _ = fill_cache("HND", torch.bfloat16, "fp8", k_scale, v_scale, w)
    views = M.flashinfer_kv_cache_views(cache.view(FP8), HKV, D)
    table = w.block_table.clone()
    mock, mock_table = M.trtllm_prefill_attn_kvfp8_dequant(
        views, table, torch.tensor([k_scale]), torch.tensor([v_scale]), torch.bfloat16)
    assert mock.shape == (table.numel() + 1, 2, HKV, BS, D) and mock.is_contiguous()
    for s in range(table.shape[0]):
        for j in range(table.shape[1]):
            page = int(table[s, j])
            if page <= 0:
                continue
            m = int(mock_table[s, j])
            for side, view, scale in ((0, views[0], k_scale), (1, views[1], v_scale)):
                want = (view[page].float() * scale).to(torch.bfloat16)
                assert torch.equal(mock[m, side], want), (s, j, side)


def main() -> None:
    print(json.dumps({"_flashinfer_installed": HAVE_FLASHINFER, **run_cases(ONLY)}))

if __name__ == "__main__":
    main()
