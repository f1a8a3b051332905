"""Worker for test_flash_attn_packed.py and test_flex_attention_packed.py.

Usage: python packed_backend_worker.py {flash_attn|flex_attention} PATCHED_BACKEND_PY [CASE...]
Prints one JSON object {case: {"ok": bool, "detail": str}} on the last stdout line.

Why a separate process: the checks register a stand-in for the compiled op
`_C_cache_ops::reshape_and_cache_flash` with torch.library and set module globals of the
backend (the CPU wheel has neither that op nor vllm-flash-attn). Both are process-global,
so they are made here, never in the pytest process that other env tests share. The
patched backend is loaded from the given file under a private module name; everything it
imports comes from the installed vLLM.

What runs for real and what is a stand-in (CPU only, no GPU here):
- real: the patched backends' get_kv_cache_shape / get_kv_cache_stride_order, their K/V
  split helpers, FlashAttentionImpl.do_kv_cache_update and .forward, FlexAttentionImpl
  .do_kv_cache_update and .forward, FlexAttentionMetadataBuilder.build (on a stand-in
  `self`), FlexAttentionMetadata, and torch's compiled flex_attention on CPU (inductor).
- stand-in: `reshape_and_cache_flash` is a torch reference of the CUDA op's contract
  (csrc/libtorch_stable/cache_kernels.cu): slot -> (slot // key_cache.size(1),
  slot % key_cache.size(1)), written through the K and V views the backend passes (so it
  addresses the cache by the views' strides exactly as the kernel does by stride(0..2)),
  fp8 stored as float8_e4m3fn bytes of value / scale, slots < 0 skipped. For flash_attn the
  attention kernel (vllm-flash-attn, CUDA only) is a float64 torch reference of
  flash_attn_varlen_func's paged contract, reading K/V through the block table from the
  views forward() passes; the real kernel only runs on a GPU.
"""

from __future__ import annotations

import json
import sys
from types import MethodType, SimpleNamespace

import torch

from worker_common import (FP8, CASES, case, load_module, register_store_stand_in,
                           run_cases)

import vllm._custom_ops as custom_ops
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

BACKEND = sys.argv[1]
PATH = sys.argv[2]
ONLY = set(sys.argv[3:])

NB, BS, HKV, HQ, D = 8, 16, 2, 4, 32


# ---- the stand-in for the compiled store op (worker_common) -------------------------------

_LIB = register_store_stand_in()


# ---- shared helpers -----------------------------------------------------------------------

if BACKEND == "flash_attn":
    M = load_module(PATH, "kvstack_layout_patched_flash_attn")
    Backend = M.FlashAttentionBackend
    Impl = M.FlashAttentionImpl
    # The CPU wheel has no vllm-flash-attn: fa_utils defines neither name. The store goes
    # through vLLM's own Python wrapper (vllm._custom_ops) to the op registered above.
    M.reshape_and_cache_flash = custom_ops.reshape_and_cache_flash
elif BACKEND == "flex_attention":
    M = load_module(PATH, "kvstack_layout_patched_flex_attention")
    Backend = M.FlexAttentionBackend
    Impl = M.FlexAttentionImpl
else:
    raise SystemExit(f"unknown backend {BACKEND}")


def set_layout(layout: str) -> None:
    if hasattr(M, "get_kv_cache_layout"):
        M.get_kv_cache_layout = lambda: layout


def allocate(layout: str, dtype: torch.dtype, cache_dtype_str: str = "auto", *,
             offset: int = 0, order=None):
    """The cache the model runner builds: physical memory permuted to the logical shape."""
    set_layout(layout)
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=cache_dtype_str)
    order = Backend.get_kv_cache_stride_order() if order is None else order
    assert len(order) == len(shape)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    n = 1
    for s in physical:
        n *= s
    flat = torch.zeros(offset + n, dtype=dtype)
    return flat[offset:].view(physical).permute(*inverse)


def workload(dtype, seed=0):
    """Two sequences (a prefill of 20 tokens, a decode at position 37) on shuffled blocks.

    Block 0 is vLLM's reserved null block (the block table pads with it; FlexAttention's
    block-mask builder drops it), so it is never used. Blocks 0 and two others stay unused,
    so "nothing else written" is a real check.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [20, 38], [20, 1]
    blocks = (1 + torch.randperm(NB - 1, generator=g)).tolist()
    tables = [blocks[:2], blocks[2:5]]
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
    return SimpleNamespace(
        seq_lens=seq_lens, q_lens=q_lens, slots=torch.tensor(slots, dtype=torch.int64),
        keys=keys, vals=vals, q=q, block_table=block_table,
    )


def reference(w, keys, vals, q=None):
    """Causal attention in float64 from token-ordered K/V (GQA: 2 q heads per kv head)."""
    q_all = w.q if q is None else q
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    tok0, q0 = 0, 0
    for L, ql in zip(w.seq_lens, w.q_lens):
        k = keys[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        v = vals[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        qq = q_all[q0: q0 + ql].double()
        scores = torch.einsum("thd,shd->hts", qq, k) * D**-0.5
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
        num_heads=HQ, num_kv_heads=HKV, scale=D**-0.5, sliding_window=None,
        alibi_slopes=None, logits_soft_cap=0.0, sinks=None,
        # flash_attn
        vllm_flash_attn_version=3, supports_quant_query_input=False, dcp_world_size=1,
        # flex_attention
        block_m=None, block_n=None, mm_prefix_range=None,
    )
    for name in ("do_kv_cache_update", "forward", "view_as_4d"):
        if hasattr(Impl, name):
            setattr(impl, name, MethodType(getattr(Impl, name), impl)
                    if name != "view_as_4d" else getattr(Impl, name))
    return impl


def expected_bytes(x, cache_dtype, kv_cache_dtype, scale):
    if kv_cache_dtype.startswith("fp8"):
        return (x.float() / scale).to(FP8).view(torch.uint8)
    return x.to(cache_dtype)


# ---- shapes, stride orders, views (both backends) ------------------------------------------

@case("shape_auto")
def _():
    assert Backend.get_kv_cache_shape(NB, BS, HKV, D) == (NB, HKV, BS, 2 * D)


LAYOUTS = ("NHD", "HND") if BACKEND == "flash_attn" else ("NHD",)


@case("stride_orders")
def _():
    if BACKEND == "flash_attn":
        expect = {
            ("NHD", False): (NB, BS, HKV, 2 * D),
            ("HND", False): (NB, HKV, BS, 2 * D),
            ("NHD", True): (NB, 3, BS, HKV, 2 * D),
            ("HND", True): (NB, HKV, 3, BS, 2 * D),
        }
    else:  # flex ignores the layout setting: always token-major
        expect = {
            (lay, False): (NB, BS, HKV, 2 * D) for lay in ("NHD", "HND")
        } | {(lay, True): (NB, 3, BS, HKV, 2 * D) for lay in ("NHD", "HND")}
    for (layout, layers), physical in expect.items():
        set_layout(layout)
        order = Backend.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        shape = ((3,) if layers else ()) + Backend.get_kv_cache_shape(NB, BS, HKV, D)
        assert sorted(order) == list(range(len(shape))), (layout, layers, order)
        got = tuple(shape[i] for i in order)
        assert got == physical, (layout, layers, got, physical)


@case("blocks_first_and_cross_layer")
def _():
    for layout in LAYOUTS:
        set_layout(layout)
        assert Backend.get_kv_cache_block_dim(BS, HKV, D) == 0
        assert Backend.indexes_kv_by_block_stride()


@case("split_views")
def _():
    C = 2 * D
    expect_strides = {
        "NHD": (BS * HKV * C, HKV * C, C, 1),
        "HND": (HKV * BS * C, C, BS * C, 1),
    }
    for layout in LAYOUTS:
        dtypes = [(torch.bfloat16, "auto")]
        if BACKEND == "flash_attn":  # fp8 caches: uint8 storage, the same shape
            dtypes.append((torch.uint8, "fp8"))
        for dtype, dtype_str in dtypes:
            cache = allocate(layout, dtype, dtype_str, offset=5)
            k, v = M.split_packed_kv_cache(cache, D)
            assert k.shape == v.shape == (NB, BS, HKV, D)
            assert k.stride() == v.stride() == expect_strides[layout], (layout, k.stride())
            assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
            assert k.data_ptr() == cache.data_ptr(), "K at content offset 0"
            assert v.data_ptr() - k.data_ptr() == D * cache.element_size(), "V at head_size"
            assert k.dtype == v.dtype == dtype


@case("split_refuses_unpacked_cache")
def _():
    bad = {
        "0.25.1 5-D": torch.zeros(NB, 2, BS, HKV, D),
        "content != 2*head_size": torch.zeros(NB, HKV, BS, 2 * D + 8),
        "3-D": torch.zeros(NB, BS, 2 * D),
    }
    for what, cache in bad.items():
        try:
            M.split_packed_kv_cache(cache, D)
        except ValueError as exc:
            assert "packed KV cache" in str(exc), str(exc)
        else:
            raise AssertionError(f"a {what} cache was accepted")
    # the backend's own entry point refuses it too (before any kernel runs)
    w = workload(torch.bfloat16)
    try:
        fake_impl().do_kv_cache_update(fake_layer(), w.keys, w.vals,
                                       torch.zeros(NB, 2, BS, HKV, D, dtype=torch.bfloat16),
                                       w.slots)
    except ValueError as exc:
        assert "packed KV cache" in str(exc), str(exc)
    else:
        raise AssertionError("do_kv_cache_update accepted a 5-D cache")


# ---- round trip through the backend's own do_kv_cache_update ------------------------------

def store_case(layout, dtype, kv_cache_dtype="auto"):
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        cache_dtype = torch.uint8 if fp8 else dtype
        w = workload(dtype)
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        cache = allocate(layout, cache_dtype, kv_cache_dtype, offset=7)
        # a padded batch: the last slots are -1 and must be skipped
        slots = torch.cat([w.slots, torch.full((3,), -1, dtype=torch.int64)])
        keys = torch.cat([w.keys, torch.randn(3, HKV, D).to(dtype)])
        vals = torch.cat([w.vals, torch.randn(3, HKV, D).to(dtype)])
        fake_impl(kv_cache_dtype).do_kv_cache_update(
            fake_layer(k_scale, v_scale), keys, vals, cache, slots)
        written = torch.zeros(NB, BS, dtype=torch.bool)
        k_view, v_view = M.split_packed_kv_cache(cache, D)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            written[b, o] = True
            ek = expected_bytes(w.keys[i], cache_dtype, kv_cache_dtype, k_scale)
            ev = expected_bytes(w.vals[i], cache_dtype, kv_cache_dtype, v_scale)
            # read back through the packed cache directly ...
            assert torch.equal(cache[b, :, o, :D], ek), ("K", i)
            assert torch.equal(cache[b, :, o, D:], ev), ("V", i)
            # ... and through the backend's views
            assert torch.equal(k_view[b, o], ek) and torch.equal(v_view[b, o], ev), i
        if fp8:  # dequantised values are close to the input
            deq = k_view[w.slots // BS, w.slots % BS].view(FP8).float() * k_scale
            assert (deq - w.keys.float()).abs().max() <= 0.07 * w.keys.float().abs().max()
        untouched = cache.permute(0, 2, 1, 3)[~written]
        assert torch.count_nonzero(untouched) == 0, "write outside the written slots"
        # the storage before the cache (offset) is untouched too
        base = torch.tensor([], dtype=cache_dtype).set_(cache.untyped_storage())
        assert torch.count_nonzero(base[:7]) == 0
    return check


# ---- forward over the packed cache ---------------------------------------------------------

def fa_forward_case(layout, dtype, kv_cache_dtype="auto"):
    """FlashAttentionImpl.forward with a float64 torch reference for flash_attn_varlen_func."""
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        w = workload(dtype, seed=1)
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        cache = allocate(layout, torch.uint8 if fp8 else dtype, kv_cache_dtype)
        impl = fake_impl(kv_cache_dtype)
        layer = fake_layer(k_scale, v_scale)
        impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
        seen = {}

        def varlen_ref(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, k_descale,
                       v_descale, causal, window_size, softmax_scale, **_):
            seen.update(k=k, v=v)
            assert causal is True and window_size is None
            kk, vv = [], []
            for s, L in enumerate(seqused_k.tolist()):
                for p in range(L):
                    b = int(block_table[s, p // BS])
                    kk.append(k[b, p % BS].double() * k_descale[s].double()[:, None])
                    vv.append(v[b, p % BS].double() * v_descale[s].double()[:, None])
            out.copy_(reference(w, torch.stack(kk), torch.stack(vv), q).to(out.dtype))

        M.flash_attn_varlen_func = varlen_ref
        qsl = torch.tensor([0, w.q_lens[0], sum(w.q_lens)], dtype=torch.int32)
        meta = SimpleNamespace(
            num_actual_tokens=sum(w.q_lens), use_cascade=False, query_start_loc=qsl,
            seq_lens=torch.tensor(w.seq_lens, dtype=torch.int32),
            max_query_len=max(w.q_lens), max_seq_len=max(w.seq_lens),
            block_table=w.block_table, scheduler_metadata=None, sliding_window=None,
            causal=True, mm_prefix_range_tensor=None, rswa_prefix_lens=None,
            max_num_splits=0,
        )
        output = torch.zeros(sum(w.q_lens), HQ, D, dtype=dtype)
        impl.forward(layer, w.q, w.keys, w.vals, cache, meta, output)
        k_view, v_view = M.split_packed_kv_cache(cache, D)
        for got, view in ((seen["k"], k_view), (seen["v"], v_view)):
            assert got.data_ptr() == view.data_ptr() and got.stride() == view.stride()
            assert got.dtype == (FP8 if fp8 else dtype)
        if fp8:
            keys = (w.keys.float() / k_scale).to(FP8).double() * k_scale
            vals = (w.vals.float() / v_scale).to(FP8).double() * v_scale
        else:
            keys, vals = w.keys, w.vals
        err = (output.double() - reference(w, keys, vals)).abs().max().item()
        assert err < 2e-2, f"max error vs float64 reference {err}"
    return check


def flex_metadata(w):
    """FlexAttentionMetadataBuilder.build (the real method) on a stand-in builder."""
    FX = M
    max_model_len, max_batched, q_block = 64, 64, 16
    builder = SimpleNamespace(
        block_size=BS, kv_cache_spec=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        cache_config=SimpleNamespace(num_gpu_blocks=NB),
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)),
        device=torch.device("cpu"), direct_build=True, q_block_size=q_block,
        kv_block_size=BS, rswa_window=None, custom_logical_mask_mod=None,
        max_num_query_groups=max_batched // q_block,
        max_num_kv_indices=q_block * (max_model_len // BS),
        max_num_rswa_query_groups=max_batched,
        max_num_rswa_kv_indices=max_model_len // BS + 1,
        persistent_kv_num_blocks=torch.empty(max_batched // q_block, dtype=torch.int32),
        persistent_rswa_kv_num_blocks=torch.empty(max_batched, dtype=torch.int32),
        persistent_offset_tensor=torch.empty(4, dtype=torch.int32),
        persistent_rswa_prefix_lens=None,
        persistent_doc_ids=torch.empty(max_batched, dtype=torch.int32),
        persistent_physical_to_logical=None, persistent_kv_indices=None,
        persistent_rswa_kv_indices=None,
        _uses_full_cudagraphs=lambda: False,
    )
    qsl = torch.tensor([0, w.q_lens[0], sum(w.q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor(w.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        num_reqs=2, num_actual_tokens=sum(w.q_lens), max_query_len=max(w.q_lens),
        max_seq_len=max(w.seq_lens), block_table_tensor=w.block_table,
        slot_mapping=w.slots, causal=True,
    )
    return FX.FlexAttentionMetadataBuilder.build(builder, 0, common)


def flex_forward_case(dtype):
    """End to end on CPU: real builder + FlexAttentionImpl.forward + compiled flex_attention."""
    def check():
        w = workload(dtype, seed=1)
        cache = allocate("NHD", dtype, offset=3)
        impl = fake_impl()
        layer = SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
        # the tokens this step computes are the ones stored (all of the prefill, the
        # decode's newest token); the decode's context was written by earlier steps
        impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
        meta = flex_metadata(w)
        output = torch.zeros(sum(w.q_lens), HQ, D, dtype=dtype)
        impl.forward(layer, w.q, w.keys, w.vals, cache, meta, output)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = (output.double() - reference(w, w.keys, w.vals)).abs().max().item()
        assert err < tol, f"max error vs float64 reference {err}"
    return check


def _tag(dtype):
    return str(dtype).removeprefix("torch.")


if BACKEND == "flash_attn":
    @case("shape_fp8_and_block_size")
    def _():
        for dtype_str in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=dtype_str)
            assert shape == (NB, HKV, BS, 2 * D), (dtype_str, shape)
        try:
            Backend.get_kv_cache_shape(NB, 8, HKV, D)
        except ValueError:
            pass
        else:
            raise AssertionError("block size 8 accepted (0.25.1 refuses it)")

    for _layout in ("NHD", "HND"):
        for _dtype in (torch.bfloat16, torch.float16):
            CASES[f"store_{_layout}_{_tag(_dtype)}"] = store_case(_layout, _dtype)
        CASES[f"store_{_layout}_fp8"] = store_case(_layout, torch.bfloat16, "fp8")
        CASES[f"forward_{_layout}_bfloat16"] = fa_forward_case(_layout, torch.bfloat16)
        CASES[f"forward_{_layout}_fp8"] = fa_forward_case(_layout, torch.bfloat16, "fp8")
else:
    @case("no_fp8_cache")
    def _():
        # FlexAttention supports no fp8 KV cache in 0.25.1; the patch does not add one.
        assert "fp8" not in Backend.supported_kv_cache_dtypes
        assert not Backend.supports_kv_cache_dtype("fp8")

    @case("flatten_refuses_head_major_order")
    def _():
        hnd = allocate("HND", torch.float32, order=(0, 1, 2, 3))
        k, _ = M.split_packed_kv_cache(hnd, D)
        try:
            M.flatten_packed_kv_view(k)
        except ValueError as exc:
            assert "token-major" in str(exc), str(exc)
        else:
            raise AssertionError("a head-major packed cache was flattened")
        nhd = allocate("NHD", torch.float32)
        k, v = M.split_packed_kv_cache(nhd, D)
        flat = M.flatten_packed_kv_view(k)
        assert flat.shape == (NB * BS, HKV, D) and flat.data_ptr() == nhd.data_ptr()
        assert flat.stride() == (HKV * 2 * D, 2 * D, 1)

    for _dtype in (torch.float32, torch.float16, torch.bfloat16):
        CASES[f"store_NHD_{_tag(_dtype)}"] = store_case("NHD", _dtype)
    for _dtype in (torch.float32, torch.bfloat16):
        CASES[f"forward_NHD_{_tag(_dtype)}"] = flex_forward_case(_dtype)


def main() -> None:
    print(json.dumps(run_cases(ONLY)))

if __name__ == "__main__":
    main()
