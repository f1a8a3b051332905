"""Worker for test_rocm_turboquant_packed.py: ROCm AITER and TurboQuant backends on CPU.

Usage:
  python rocm_tq_worker.py rocm_aiter_fa PATCHED_ROCM_AITER_FA_PY
  python rocm_tq_worker.py rocm_aiter_unified_attn PATCHED_ROCM_AITER_UNIFIED_ATTN_PY
  TRITON_INTERPRET=1 python rocm_tq_worker.py turboquant_attn PATCHED_TURBOQUANT_ATTN_PY \
      PATCHED_TRITON_TURBOQUANT_STORE_PY
Prints one JSON object {case: {"ok": bool, "detail": str}} on the last stdout line.
KVSTACK_LAYOUT_CASES=a,b (environment) runs only those cases. Run on the unpatched
turboquant_attn.py, the store cases write out of bounds (the 0.25.1 code takes the packed
cache's head dim for the block size), which the interpreter does not catch: the negative
control runs only the cases that do not launch a kernel.

Why a separate process: the checks register a stand-in for the compiled op
`_C_cache_ops::reshape_and_cache_flash`, replace methods of vLLM's `rocm_aiter_ops`, put a
stand-in `aiter` package into sys.modules and (TurboQuant) run the Triton kernels under
TRITON_INTERPRET=1. All of that is process-global, so it happens here, never in the pytest
process. The patched backend is loaded from the given file under a private module name;
everything else comes from the installed vLLM. For TurboQuant the patched store launcher
(`vllm.v1.attention.ops.triton_turboquant_store`, also touched by the patch) is loaded
under its real name in this process only; the reference is 0.25.1's launcher (the 4th
argument, a file, under a private name; else the installed one).

What is real and what is a stand-in (no ROCm and no AITER here, CPU only):
- real: the patched backends' get_kv_cache_shape / get_kv_cache_stride_order, their split
  helpers, AiterFlashAttentionImpl.__init__ / do_kv_cache_update /
  do_rope_and_kv_cache_update, RocmAiterUnifiedAttentionImpl.do_kv_cache_update /
  do_rope_and_kv_cache_update / forward, TurboQuantAttentionImpl.do_kv_cache_update /
  forward (decode) with vLLM's real TurboQuant Triton store and decode kernels
  (interpreted, unmodified kernels), and vLLM's `rocm_aiter_ops` class itself.
- stand-ins, only where the real module cannot run here:
  * `reshape_and_cache_flash` (compiled, absent from the CPU wheel): a torch reference of
    the op's contract, written through the K/V views the backend passes (addressed by
    their strides as the kernel does);
  * `rocm_aiter_ops.is_shuffle_kv_cache_enabled` (returns None off ROCm by design): set to
    return True/False for the shuffle-mode cases;
  * `rocm_aiter_ops.triton_rope_and_cache` (AITER Triton, AITER not installed): records
    the cache views and writes K/V through them (no rotary embedding);
  * `aiter.ops.triton.unified_attention` (AITER not installed; the real __init__ imports
    it, so the impl state is a stand-in object whose `unified_attention` attribute is this
    reference; the methods are the patched ones): a float64 torch reference of the paged
    contract, reading K/V through the block table from the views forward() passes.
AiterFlashAttentionImpl.forward is not run: its decode/prefill/extend paths call AITER's
compiled kernels directly (flash_attn_varlen_func, paged_attention_v1), so a CPU run
would test only stand-ins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import MethodType, SimpleNamespace

BACKEND = sys.argv[1]
PATH = sys.argv[2]
OPS_PATH = sys.argv[3] if len(sys.argv) > 3 else None
REF_OPS_PATH = sys.argv[4] if len(sys.argv) > 4 else None  # 0.25.1's store launcher

if BACKEND == "turboquant_attn":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run TurboQuant with TRITON_INTERPRET=1"
    import torch
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    import vllm.triton_utils as triton_utils

    # Real Triton (interpreted) instead of vLLM's no-GPU placeholder, before any kernel
    # module is imported (as layout_worker.py does for triton_attn).
    triton_utils.HAS_TRITON = True
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

import torch  # noqa: E402
from worker_common import (  # noqa: E402
    FP8, CASES, case, load_module, register_store_stand_in, run_cases)

from vllm._aiter_ops import rocm_aiter_ops  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402

NB, BS, HKV, HQ, D = 8, 16, 2, 4, 64


# ---- the stand-in for the compiled store op (worker_common) -------------------------------

if BACKEND != "turboquant_attn":
    _LIB = register_store_stand_in()


def set_shuffle(enabled: bool) -> None:
    rocm_aiter_ops.is_shuffle_kv_cache_enabled = classmethod(lambda cls: enabled)


set_shuffle(False)

ROPE_CALLS: list = []


def fake_triton_rope_and_cache(query, key, value, positions, cos_sin_cache, is_neox,
                               key_cache, value_cache, slot_mapping, k_scale, v_scale,
                               flash_layout, is_fp8_kv_cache):
    """Stand-in for AITER's fused rope + cache write: records the views, writes K/V."""
    ROPE_CALLS.append(SimpleNamespace(key_cache=key_cache, value_cache=value_cache,
                                      flash_layout=flash_layout, fp8=is_fp8_kv_cache))
    slots = slot_mapping.to(torch.int64)
    blocks, offsets = slots // key_cache.size(1), slots % key_cache.size(1)
    key_cache[blocks, offsets] = key[: len(slots)].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[: len(slots)].to(value_cache.dtype)


rocm_aiter_ops.triton_rope_and_cache = staticmethod(fake_triton_rope_and_cache)


def ref_unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                          max_seqlen_k, softmax_scale, causal, alibi_slopes, window_size,
                          block_table, softcap, q_descale, k_descale, v_descale,
                          sinks=None, output_scale=None):
    """float64 reference of the paged unified-attention contract, reading k/v views."""
    assert causal
    UNIFIED_CALLS.append(SimpleNamespace(k=k, v=v))
    kd = k.double() * (k_descale.double() if k.dtype == FP8 else 1.0)
    vd = v.double() * (v_descale.double() if v.dtype == FP8 else 1.0)
    bs = k.shape[1]
    for s in range(len(seqused_k)):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        L = int(seqused_k[s])
        pos = torch.arange(L)
        blocks = block_table[s].long()[pos // bs]
        ks = kd[blocks, pos % bs].repeat_interleave(q.shape[1] // k.shape[2], dim=1)
        vs = vd[blocks, pos % bs].repeat_interleave(q.shape[1] // k.shape[2], dim=1)
        scores = torch.einsum("thd,shd->hts", q[q0:q1].double(), ks) * softmax_scale
        qpos = torch.arange(L - (q1 - q0), L)[:, None]
        scores = scores.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
        out[q0:q1] = torch.einsum("hts,shd->thd", scores.softmax(-1), vs).to(out.dtype)


UNIFIED_CALLS: list = []
# AITER is not installed here. A stand-in `aiter` package in sys.modules would make vLLM
# believe AITER is present (vllm.kernels.aiter_ops probes find_spec("aiter")), so none is
# installed: the impl's `unified_attention` attribute, which the real __init__ imports from
# aiter.ops.triton.unified_attention, is set to the reference on the stand-in impl instead.
AITER_IMPORTABLE = importlib.util.find_spec("aiter") is not None


# ---- load the backend under test -------------------------------------------------------

if BACKEND == "rocm_aiter_fa":
    M = load_module(PATH, "kvstack_layout_patched_rocm_aiter_fa")
    Backend, Impl = M.AiterFlashAttentionBackend, M.AiterFlashAttentionImpl
    NAME = "ROCM_AITER_FA"
elif BACKEND == "rocm_aiter_unified_attn":
    M = load_module(PATH, "kvstack_layout_patched_rocm_aiter_unified_attn")
    Backend, Impl = M.RocmAiterUnifiedAttentionBackend, M.RocmAiterUnifiedAttentionImpl
    NAME = "ROCM_AITER_UNIFIED_ATTN"
elif BACKEND == "turboquant_attn":
    import vllm.v1.attention.ops.triton_turboquant_decode as tq_decode
    if REF_OPS_PATH:  # the installed launcher may be patched: 0.25.1's comes as a file
        ref_store_mod = load_module(REF_OPS_PATH, "kvstack_layout_ref_turboquant_store")
    else:
        import vllm.v1.attention.ops.triton_turboquant_store as ref_store_mod
    REF_STORE = ref_store_mod.triton_turboquant_store  # the 0.25.1 launcher
    if OPS_PATH:
        load_module(OPS_PATH, "vllm.v1.attention.ops.triton_turboquant_store")
    M = load_module(PATH, "kvstack_layout_patched_turboquant_attn")
    Backend, Impl = M.TurboQuantAttentionBackend, M.TurboQuantAttentionImpl
    NAME = "TURBOQUANT"
else:
    raise SystemExit(f"unknown backend {BACKEND}")


def split(kv_cache, head_size=D):
    if BACKEND == "turboquant_attn":
        return M.tq_token_major_view(kv_cache, HKV, head_size)
    return M.split_packed_kv_cache(kv_cache, head_size)


def allocate(shape, dtype, *, offset=0, order=None):
    """The model runner's allocation: physical memory permuted to the logical shape."""
    order = tuple(range(len(shape))) if order is None else order
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    n = 1
    for s in physical:
        n *= s
    flat = torch.zeros(offset + n, dtype=dtype)
    return flat[offset:].view(physical).permute(*inverse), flat


def physical_order():
    try:
        return Backend.get_kv_cache_stride_order()
    except NotImplementedError:
        return None  # the runner then uses the logical order


def workload(dtype, seed=0, dim=D):
    """Two sequences (a prefill of 20 tokens, a decode at position 37) on shuffled blocks.

    Block 0 (vLLM's null block) and two others stay unused.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [20, 38], [20, 1]
    blocks = (1 + torch.randperm(NB - 1, generator=g)).tolist()
    tables = [blocks[:2], blocks[2:5]]
    slots = [tables[s][p // BS] * BS + p % BS for s, L in enumerate(seq_lens)
             for p in range(L)]
    T = len(slots)
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return SimpleNamespace(
        seq_lens=seq_lens, q_lens=q_lens, slots=torch.tensor(slots, dtype=torch.int64),
        keys=torch.randn(T, HKV, dim, generator=g).to(dtype),
        vals=torch.randn(T, HKV, dim, generator=g).to(dtype),
        q=torch.randn(sum(q_lens), HQ, dim, generator=g).to(dtype),
        block_table=block_table, used=set(blocks[:5]),
    )


def reference(w, keys, vals):
    out = torch.zeros(w.q.shape, dtype=torch.float64)
    tok0, q0 = 0, 0
    for L, ql in zip(w.seq_lens, w.q_lens):
        k = keys[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        v = vals[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("thd,shd->hts", w.q[q0: q0 + ql].double(), k) * D**-0.5
        qpos = torch.arange(L - ql, L)[:, None]
        scores = scores.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
        out[q0: q0 + ql] = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
        tok0 += L
        q0 += ql
    return out


def fake_layer(k_scale=1.0, v_scale=1.0):
    return SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.tensor([k_scale]),
                           _v_scale=torch.tensor([v_scale]))


def fake_impl(kv_cache_dtype="auto"):
    """The state the impl's methods read; the methods themselves are the patched ones."""
    impl = SimpleNamespace(
        attn_type=AttentionType.DECODER, kv_cache_dtype=kv_cache_dtype, head_size=D,
        num_heads=HQ, num_kv_heads=HKV, scale=D**-0.5, sliding_window=(-1, -1),
        alibi_slopes=None, logits_soft_cap=0.0, sinks=None, fp8_dtype=FP8,
        unified_attention=ref_unified_attention,
    )
    for name in ("do_kv_cache_update", "do_rope_and_kv_cache_update", "forward",
                 "_split_kv_cache", "_ensure_on_device", "_store_kv", "_decode_attention"):
        if hasattr(Impl, name):
            setattr(impl, name, MethodType(getattr(Impl, name), impl))
    return impl


def expected(x, kv_cache_dtype, cache_dtype, scale=1.0):
    if kv_cache_dtype.startswith("fp8"):
        return (x.float() / scale).to(FP8).view(torch.uint8)
    return x.to(cache_dtype)


# ---- ROCm AITER FA and unified attention ------------------------------------------------

if BACKEND in ("rocm_aiter_fa", "rocm_aiter_unified_attn"):

    @case("shape_and_block_size")
    def _():
        for dt in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
            got = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=dt)
            assert got == (NB, HKV, BS, 2 * D), (dt, got)
        try:
            Backend.get_kv_cache_shape(NB, 8, HKV, D)
        except ValueError:
            pass
        else:
            raise AssertionError("block size 8 accepted")

    @case("physical_order_is_logical")
    def _():
        # Upstream 0.26.0 declares no stride order for these backends: the runner keeps
        # the logical (num_blocks, num_kv_heads, block_size, 2*hs) order, head-major.
        assert physical_order() is None, physical_order()
        assert Backend.get_kv_cache_block_dim(BS, HKV, D) == 0

    @case("split_views")
    def _():
        C = 2 * D
        for dtype in (torch.bfloat16, torch.uint8):
            cache, flat = allocate((NB, HKV, BS, C), dtype, offset=7)
            k, v = split(cache)
            for x in (k, v):
                assert x.shape == (NB, BS, HKV, D), x.shape
                assert x.stride() == (HKV * BS * C, C, BS * C, 1), x.stride()
                assert x.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            es = cache.element_size()
            assert k.data_ptr() == cache.data_ptr() == flat.data_ptr() + 7 * es
            assert v.data_ptr() == cache.data_ptr() + D * es

    @case("split_refuses_unpacked_cache")
    def _():
        bad = {
            "0.25.1 (B, 2, N, H, D)": torch.zeros(NB, 2, BS, HKV, D),
            "ROCM_ATTN (2, B, N, H, D)": torch.zeros(2, NB, BS, HKV, D),
            "content dim != 2*D": torch.zeros(NB, HKV, BS, D),
            "3-D": torch.zeros(NB, BS, 2 * D),
        }
        for what, t in bad.items():
            try:
                split(t)
            except ValueError as e:
                assert NAME in str(e) and "packed KV cache" in str(e), str(e)
            else:
                raise AssertionError(f"{what} accepted")
            try:
                fake_impl().do_kv_cache_update(fake_layer(), torch.zeros(1, HKV, D),
                                               torch.zeros(1, HKV, D), t,
                                               torch.zeros(1, dtype=torch.int64))
            except ValueError as e:
                assert NAME in str(e), str(e)
            else:
                raise AssertionError(f"do_kv_cache_update took {what}")

    def store_case(dtype, kv_cache_dtype="auto", rope=False):
        cache_dtype = torch.uint8 if kv_cache_dtype.startswith("fp8") else dtype
        w = workload(dtype)
        cache, flat = allocate((NB, HKV, BS, 2 * D), cache_dtype, offset=5)
        slots = torch.cat([w.slots, torch.tensor([-1, -1])])  # padded slots are skipped
        keys = torch.cat([w.keys, torch.zeros(2, HKV, D, dtype=dtype)])
        vals = torch.cat([w.vals, torch.zeros(2, HKV, D, dtype=dtype)])
        ks, vs = (0.5, 0.25) if kv_cache_dtype.startswith("fp8") else (1.0, 1.0)
        impl, layer = fake_impl(kv_cache_dtype), fake_layer(ks, vs)
        ROPE_CALLS.clear()
        if rope:
            # only the store part: the stand-in writes K/V through the views it gets
            impl.do_rope_and_kv_cache_update(layer, w.q, keys[: len(w.slots)],
                                             vals[: len(w.slots)], None, None, True,
                                             cache, w.slots)
            (call,) = ROPE_CALLS
            k, v = split(cache)
            assert call.flash_layout is True
            for got, want in ((call.key_cache, k), (call.value_cache, v)):
                assert got.data_ptr() == want.data_ptr() and got.stride() == want.stride()
                assert got.dtype == (FP8 if kv_cache_dtype.startswith("fp8") else dtype)
            # fp8 caches are retyped by the backend; compare stored values as fp8 bytes
            want_k = w.keys.to(FP8).view(torch.uint8) if call.fp8 else w.keys
            want_v = w.vals.to(FP8).view(torch.uint8) if call.fp8 else w.vals
        else:
            impl.do_kv_cache_update(layer, keys, vals, cache, slots)
            want_k = expected(w.keys, kv_cache_dtype, cache_dtype, ks)
            want_v = expected(w.vals, kv_cache_dtype, cache_dtype, vs)
        b, o = w.slots // BS, w.slots % BS
        got = cache[b, :, o]  # (T, H, 2D): token-ordered read of the packed cache
        assert torch.equal(got[..., :D], want_k), "K not where the packed layout puts it"
        assert torch.equal(got[..., D:], want_v), "V not where the packed layout puts it"
        written = torch.zeros(NB, BS, dtype=torch.bool)
        written[b, o] = True
        rest = cache.permute(0, 2, 1, 3)[~written]
        assert not rest.any(), "slots outside the slot mapping were written"
        assert not flat[:5].any(), "bytes before the storage offset were written"

    for dt in ("bfloat16", "float16"):
        CASES[f"store_{dt}"] = (lambda d: lambda: store_case(getattr(torch, d)))(dt)
        CASES[f"rope_store_{dt}"] = (
            lambda d: lambda: store_case(getattr(torch, d), rope=True))(dt)
    CASES["store_fp8"] = lambda: store_case(torch.bfloat16, "fp8")
    CASES["rope_store_fp8"] = lambda: store_case(torch.bfloat16, "fp8", rope=True)

if BACKEND == "rocm_aiter_fa":

    def make_real_impl():
        return Impl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV,
                    alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")

    @case("shuffle_mode_refused")
    def _():
        set_shuffle(True)
        try:
            try:
                make_real_impl()
            except ValueError as e:
                assert "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT" in str(e), str(e)
                assert "packed KV cache" in str(e), str(e)
            else:
                raise AssertionError("AiterFlashAttentionImpl built in shuffle mode")
            cache, _ = allocate((NB, HKV, BS, 2 * D), torch.bfloat16)
            try:
                fake_impl().do_kv_cache_update(fake_layer(), torch.zeros(1, HKV, D),
                                               torch.zeros(1, HKV, D), cache,
                                               torch.zeros(1, dtype=torch.int64))
            except ValueError as e:
                assert "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT" in str(e), str(e)
            else:
                raise AssertionError("do_kv_cache_update ran in shuffle mode")
            assert not cache.any()
        finally:
            set_shuffle(False)

    @case("impl_builds_without_shuffle")
    def _():
        impl = make_real_impl()
        assert impl.head_size == D and impl.num_kv_heads == HKV

if BACKEND == "rocm_aiter_unified_attn":

    def forward_case(dtype, kv_cache_dtype="auto"):
        fp8 = kv_cache_dtype.startswith("fp8")
        cache_dtype = torch.uint8 if fp8 else dtype
        w = workload(dtype, seed=1)
        cache, _ = allocate((NB, HKV, BS, 2 * D), cache_dtype, offset=3)
        ks, vs = (0.5, 0.25) if fp8 else (1.0, 1.0)
        impl, layer = fake_impl(kv_cache_dtype), fake_layer(ks, vs)
        impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
        qsl = torch.tensor([0, 20, 21], dtype=torch.int32)
        md = SimpleNamespace(
            use_cascade=False, num_actual_tokens=21, query_start_loc=qsl,
            seq_lens=torch.tensor(w.seq_lens, dtype=torch.int32), max_query_len=20,
            max_seq_len=38, block_table=w.block_table, causal=True)
        out = torch.zeros(21, HQ, D, dtype=dtype)
        UNIFIED_CALLS.clear()
        impl.forward(layer, w.q, None, None, cache, md, out)
        (call,) = UNIFIED_CALLS
        k, v = split(cache)
        assert call.k.data_ptr() == k.data_ptr() and call.k.stride() == k.stride()
        assert call.v.data_ptr() == v.data_ptr() and call.v.stride() == v.stride()
        assert call.k.dtype == (FP8 if fp8 else dtype)
        if fp8:
            keys = (w.keys.float() / ks).to(FP8).double() * ks
            vals = (w.vals.float() / vs).to(FP8).double() * vs
        else:
            keys, vals = w.keys, w.vals
        ref = reference(w, keys, vals)
        err = (out.double() - ref).abs().max().item()
        assert err < 2e-2, f"max abs error {err}"

    CASES["forward_bfloat16"] = lambda: forward_case(torch.bfloat16)
    CASES["forward_float16"] = lambda: forward_case(torch.float16)
    CASES["forward_fp8"] = lambda: forward_case(torch.bfloat16, "fp8")

    @case("no_stride_order_in_rocm_attn_parent")
    def _():
        from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
        # ROCM_ATTN keeps its 0.25.1 (2, num_blocks, ...) layout, as upstream did.
        assert RocmAttentionBackend.get_kv_cache_shape(NB, BS, HKV, D) == (2, NB, BS, HKV, D)
        assert issubclass(Backend, RocmAttentionBackend)

# ---- TurboQuant -------------------------------------------------------------------------

if BACKEND == "turboquant_attn":
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    TQ_DTYPES = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                 "turboquant_3bit_nc")
    TQ_H, TQ_BS = 2, 16  # TQ_BS != TQ_H, so a 0.25.1 token-major cache is told apart

    def slot(dt):
        return TurboQuantConfig.from_cache_dtype(dt, D).slot_size_aligned

    @case("shape_head_major")
    def _():
        for dt in TQ_DTYPES:
            got = Backend.get_kv_cache_shape(NB, TQ_BS, TQ_H, D, cache_dtype_str=dt)
            assert got == (NB, TQ_H, TQ_BS, slot(dt)), (dt, got)

    @case("physical_order_is_logical")
    def _():
        assert physical_order() is None, physical_order()
        for dt in TQ_DTYPES:
            assert Backend.get_kv_cache_block_dim(TQ_BS, TQ_H, D, cache_dtype_str=dt) == 0

    @case("token_major_view")
    def _():
        S = slot("turboquant_4bit_nc")
        cache, flat = allocate((NB, TQ_H, TQ_BS, S), torch.uint8, offset=9)
        view = M.tq_token_major_view(cache, TQ_H, S)
        assert view.shape == (NB, TQ_BS, TQ_H, S)
        assert view.stride() == (TQ_H * TQ_BS * S, S, TQ_BS * S, 1), view.stride()
        assert view.data_ptr() == flat.data_ptr() + 9

    @case("refuses_unpacked_cache")
    def _():
        S = slot("turboquant_4bit_nc")
        bad = {
            "0.25.1 token-major (B, N, H, slot)": torch.zeros(NB, TQ_BS, TQ_H, S,
                                                              dtype=torch.uint8),
            "wrong slot size": torch.zeros(NB, TQ_H, TQ_BS, S + 2, dtype=torch.uint8),
            "5-D": torch.zeros(NB, 2, TQ_BS, TQ_H, S, dtype=torch.uint8),
        }
        for what, t in bad.items():
            for call in ("helper", "do_kv_cache_update", "forward"):
                try:
                    if call == "helper":
                        M.tq_token_major_view(t, TQ_H, S)
                    else:
                        impl, layer = tq_impl("turboquant_4bit_nc"), SimpleNamespace()
                        x = torch.zeros(1, TQ_H * D)
                        md = SimpleNamespace(num_actual_tokens=1)
                        if call == "forward":
                            impl.forward(layer, torch.zeros(1, HQ * D), x, x, t, md,
                                         torch.zeros(1, HQ * D))
                        else:
                            impl.do_kv_cache_update(layer, x, x, t,
                                                    torch.zeros(1, dtype=torch.int64))
                except ValueError as e:
                    assert "TURBOQUANT expects" in str(e), str(e)
                else:
                    raise AssertionError(f"{call} took {what}")

    def tq_impl(dt):
        impl = fake_impl(dt)
        impl.num_kv_heads = TQ_H
        impl.num_kv_groups = HQ // TQ_H
        impl.tq_config = TurboQuantConfig.from_cache_dtype(dt, D)
        impl.max_num_kv_splits = 2
        return impl

    def tq_store(dt, seed=0):
        """Store through the patched backend and, for reference, through the installed
        0.25.1 launcher into a contiguous token-major cache; compare per (block, slot, head)."""
        w = workload(torch.float16, seed=seed)
        w.keys, w.vals = w.keys[:, :TQ_H], w.vals[:, :TQ_H]
        T = len(w.slots)
        S = slot(dt)
        impl, layer = tq_impl(dt), SimpleNamespace()
        cache, flat = allocate((NB, TQ_H, TQ_BS, S), torch.uint8, offset=11)
        impl.do_kv_cache_update(layer, w.keys.reshape(T, -1), w.vals.reshape(T, -1),
                                cache, w.slots)
        ref = torch.zeros(NB, TQ_BS, TQ_H, S, dtype=torch.uint8)
        cfg = impl.tq_config
        REF_STORE(w.keys, w.vals, ref, w.slots, layer._tq_PiT, layer._tq_midpoints,
                  mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                  value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        assert ref.any(), "the reference store wrote nothing"
        assert torch.equal(cache.transpose(1, 2), ref), "packed bytes differ from 0.25.1's"
        assert not flat[:11].any(), "bytes before the storage offset were written"
        return w, impl, layer, cache, ref

    for dt in ("turboquant_4bit_nc", "turboquant_k8v4"):
        CASES[f"store_{dt}"] = (lambda d: lambda: tq_store(d))(dt)

    @case("decode_forward_turboquant_4bit_nc")
    def _():
        dt = "turboquant_4bit_nc"
        w, impl, layer, cache, ref = tq_store(dt, seed=2)
        # decode of both sequences' last token through the patched forward()
        q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3)).half()
        md = SimpleNamespace(
            num_actual_tokens=2, is_prefill=False, num_decodes=2, num_decode_tokens=2,
            seq_lens=torch.tensor(w.seq_lens, dtype=torch.int32),
            block_table=w.block_table, max_seq_len=max(w.seq_lens))
        out = torch.zeros(2, HQ * D, dtype=torch.float16)
        impl.forward(layer, q.reshape(2, -1), None, None, cache, md, out)
        cfg = impl.tq_config
        want = tq_decode.triton_turboquant_decode_attention(
            query=q, kv_cache=ref, block_table=w.block_table, seq_lens=md.seq_lens,
            Pi=layer._tq_Pi, centroids=layer._tq_centroids, scale=impl.scale,
            mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, PiT=layer._tq_PiT,
            buf_holder=SimpleNamespace(), max_num_kv_splits=2)
        assert out.abs().sum() > 0
        assert torch.equal(out, want.reshape(2, -1).to(out.dtype)), (
            f"max diff {(out.float() - want.reshape(2, -1).float()).abs().max()}")


def main() -> None:
    only = set(filter(None, os.environ.get("KVSTACK_LAYOUT_CASES", "").split(",")))
    results = run_cases(only)
    results["_meta"] = {"ok": True, "detail": f"aiter_importable={AITER_IMPORTABLE}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
