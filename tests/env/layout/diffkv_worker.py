"""Worker for test_diffkv_packed.py: the DiffKV backends on a packed KV cache, on CPU.

Usage: TRITON_INTERPRET=1 python diffkv_worker.py {triton_attn_diffkv|flash_attn_diffkv}
           OVERLAY_DIR [CASE...]
Prints one JSON object {case: {"ok": bool, "detail": str}} on the last stdout line.

OVERLAY_DIR holds copies of the vLLM files under test (`vllm/v1/attention/...`), patched
or not: the store-kernel module, the parent backend and the DiffKV backend. They are
loaded under their real module names, in that order, before anything imports them, so
the DiffKV backend (which imports its parent with a relative import) and the store
kernel it calls are the overlay's; everything else comes from the installed vLLM, which
is never modified.

Why a separate process: the Triton kernels must be created with TRITON_INTERPRET=1 and
vLLM on a machine without a GPU replaces `triton` by a placeholder (as in
layout_worker.py), and the overlay modules replace installed ones in sys.modules. All of
that is process-global.

What runs for real and what is a stand-in:
- real: get_kv_cache_shape / get_kv_cache_stride_order, the split helpers, the impls'
  do_kv_cache_update and forward (on a stand-in `self` holding the state they read), the
  DiffKV Triton store kernel `triton_reshape_and_cache_flash_diffkv` (both backends
  write through it) and, for TRITON_ATTN_DIFFKV, the Triton attention kernel
  `unified_attention_diffkv`, all interpreted on CPU at tiny shapes.
- stand-in: for FLASH_ATTN_DIFFKV the attention kernel (vllm-flash-attn FA3/FA4, CUDA
  only) is a float64 torch reference of flash_attn_varlen_func's paged contract, reading
  K/V through the block table from the views forward() passes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import MethodType, SimpleNamespace

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from worker_common import FP8, CASES, case, load_module, run_cases  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402

import vllm.triton_utils as triton_utils  # noqa: E402

triton_utils.HAS_TRITON = True
triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

from vllm.v1.attention.backend import AttentionType  # noqa: E402

BACKEND = sys.argv[1]
OVERLAY = Path(sys.argv[2])
ONLY = set(sys.argv[3:])

OPS = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
PARENT = {"triton_attn_diffkv": "triton_attn", "flash_attn_diffkv": "flash_attn"}[BACKEND]
FILES = [OPS, f"vllm/v1/attention/backends/{PARENT}.py",
         f"vllm/v1/attention/backends/{BACKEND}.py"]


def load_overlay(rel: str):
    name = rel.removesuffix(".py").replace("/", ".")
    parent, _, leaf = name.rpartition(".")
    importlib.import_module(parent)  # the package __init__ only, not the module
    mod = load_module(OVERLAY / rel, name)
    setattr(sys.modules[parent], leaf, mod)
    return mod


for _rel in FILES:
    M = load_overlay(_rel)  # the last one is the DiffKV backend

# Tiny shapes: the interpreter runs every program instance in Python. DV > DK on purpose:
# a split by head_size alone would give three pieces.
NB, BS, HKV, HQ, DK, DV = 6, 16, 2, 4, 32, 64
C = DK + DV
if BACKEND == "triton_attn_diffkv":
    Backend, Impl = M.TritonAttentionDiffKVBackend, M.TritonAttentionDiffKVImpl
    NAME = "TRITON_ATTN_DIFFKV"
else:
    Backend, Impl = M.FlashAttentionDiffKVBackend, M.FlashAttentionDiffKVImpl
    NAME = "FLASH_ATTN_DIFFKV"
Backend.set_head_size_v(DV)


def set_layout(layout: str) -> None:
    M.get_kv_cache_layout = lambda: layout


def allocate(layout, dtype, cache_dtype_str="auto", *, offset=0):
    """The cache the model runner builds: physical memory permuted to the logical shape."""
    set_layout(layout)
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, DK, cache_dtype_str=cache_dtype_str)
    order = Backend.get_kv_cache_stride_order()
    assert len(order) == len(shape)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    n = 1
    for s in physical:
        n *= s
    flat = torch.zeros(offset + n, dtype=dtype)
    return flat[offset:].view(physical).permute(*inverse)


def allocate_old(layout, dtype):
    """vLLM 0.25.1's DiffKV cache: (B, N, H, DK+DV), NHD or HND order; K/V by slicing."""
    order = (0, 1, 2, 3) if layout == "NHD" else (0, 2, 1, 3)
    shape = (NB, BS, HKV, C)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    return torch.zeros(physical, dtype=dtype).permute(*inverse)


def split(cache):
    """The backend's own K/V views."""
    res = M.split_packed_diffkv_cache(cache, DK, DV)
    return res[-2:]


def workload(dtype, seed=0):
    """Two sequences (a prefill of 20 tokens, a decode at position 37) on shuffled blocks.

    Block 0 (vLLM's null block) and one other block stay unused.
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
    keys = torch.randn(T, HKV, DK, generator=g).to(dtype)
    vals = torch.randn(T, HKV, DV, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), HQ, DK, generator=g).to(dtype)
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
    out = torch.zeros(q_all.shape[0], HQ, DV, dtype=torch.float64)
    tok0, q0 = 0, 0
    for L, ql in zip(w.seq_lens, w.q_lens):
        k = keys[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        v = vals[tok0: tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        qq = q_all[q0: q0 + ql].double()
        scores = torch.einsum("thd,shd->hts", qq, k) * DK**-0.5
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
    """The state the impl's methods read; the methods themselves are the overlay's."""
    impl = SimpleNamespace(
        attn_type=AttentionType.DECODER, kv_cache_dtype=kv_cache_dtype, head_size=DK,
        num_heads=HQ, num_kv_heads=HKV, scale=DK**-0.5, alibi_slopes=None,
        use_alibi_sqrt=False, logits_soft_cap=0.0, sinks=None,
        sliding_window=(-1, -1) if BACKEND == "triton_attn_diffkv" else None,
        vllm_flash_attn_version=3, dcp_world_size=1,
    )
    for name in ("do_kv_cache_update", "forward"):
        setattr(impl, name, MethodType(getattr(Impl, name), impl))
    return impl


def fp8_bytes(x, scale):
    return (x.float() / scale).to(FP8).view(torch.uint8)


def on_fp8_grid(w, k_scale, v_scale):
    """Snap the workload's K/V to values that are exact in fp8 after scaling.

    The Triton interpreter converts to fp8 by truncation where the GPU rounds to
    nearest even, so only values exact in fp8 make a byte-exact check about placement
    rather than rounding. The scales are powers of two: the snapped values are exact in
    bf16 and fp16 too.
    """
    for name, scale in (("keys", k_scale), ("vals", v_scale)):
        x = getattr(w, name)
        setattr(w, name, ((x.float() / scale).to(FP8).float() * scale).to(x.dtype))
    return w


# ---- shapes, stride orders, views ----------------------------------------------------------

@case("shape")
def _():
    dtypes = ["auto", "bfloat16"] + (["fp8"] if BACKEND == "flash_attn_diffkv" else [])
    for dtype_str in dtypes:
        got = Backend.get_kv_cache_shape(NB, BS, HKV, DK, cache_dtype_str=dtype_str)
        assert got == (NB, HKV, BS, C), (dtype_str, got)
    try:
        Backend.get_kv_cache_shape(NB, 8, HKV, DK)
    except ValueError:
        pass
    else:
        raise AssertionError("block size 8 accepted")


@case("stride_orders")
def _():
    expect = {  # physical shapes, from the logical (L,) B, H, N, C
        ("NHD", False): (NB, BS, HKV, C),
        ("HND", False): (NB, HKV, BS, C),
        ("NHD", True): (NB, 3, BS, HKV, C),
        ("HND", True): (NB, HKV, 3, BS, C),
    }
    for (layout, layers), physical in expect.items():
        set_layout(layout)
        order = Backend.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        shape = ((3,) if layers else ()) + Backend.get_kv_cache_shape(NB, BS, HKV, DK)
        assert sorted(order) == list(range(len(shape))), (layout, layers, order)
        got = tuple(shape[i] for i in order)
        assert got == physical, (layout, layers, got, physical)


@case("blocks_first")
def _():
    for layout in ("NHD", "HND"):
        set_layout(layout)
        assert Backend.get_kv_cache_block_dim(BS, HKV, DK) == 0
        assert Backend.indexes_kv_by_block_stride()


@case("split_views")
def _():
    expect_strides = {"NHD": (BS * HKV * C, HKV * C, C, 1), "HND": (HKV * BS * C, C, BS * C, 1)}
    dtypes = [torch.bfloat16] + ([torch.uint8] if BACKEND == "flash_attn_diffkv" else [])
    for layout in ("NHD", "HND"):
        for dtype in dtypes:
            cache = allocate(layout, dtype, offset=5)
            k, v = split(cache)
            assert k.shape == (NB, BS, HKV, DK) and v.shape == (NB, BS, HKV, DV)
            assert k.stride() == v.stride() == expect_strides[layout], (layout, k.stride())
            assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
            assert k.data_ptr() == cache.data_ptr(), "K at content offset 0"
            assert v.data_ptr() - k.data_ptr() == DK * cache.element_size(), "V at head_size"
            assert k.dtype == v.dtype == dtype
            if BACKEND == "flash_attn_diffkv":  # the store kernel's token-major view
                tm = M.split_packed_diffkv_cache(cache, DK, DV)[0]
                assert tm.shape == (NB, BS, HKV, C) and tm.data_ptr() == cache.data_ptr()
                assert tm.stride() == expect_strides[layout]


@case("refuses_unpacked_cache")
def _():
    bad = {
        "0.25.1-style 5-D": torch.zeros(NB, 2, BS, HKV, DK),
        "content 2*head_size": torch.zeros(NB, HKV, BS, 2 * DK),
        "content != head_size + head_size_v": torch.zeros(NB, HKV, BS, C + 8),
        "3-D": torch.zeros(NB, BS, C),
        "non-contiguous content": torch.zeros(NB, HKV, C, BS).transpose(2, 3),
    }
    for what, cache in bad.items():
        try:
            split(cache)
        except ValueError as exc:
            assert "packed KV cache" in str(exc) and NAME in str(exc), str(exc)
        else:
            raise AssertionError(f"a {what} cache was accepted")
    # the backend's own entry points refuse it too (before any kernel runs)
    w = workload(torch.float32)
    impl, layer = fake_impl(), fake_layer()
    for what, cache in bad.items():
        try:
            impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
        except ValueError as exc:
            assert "packed KV cache" in str(exc), str(exc)
        else:
            raise AssertionError(f"do_kv_cache_update accepted a {what} cache")


# ---- round trip through do_kv_cache_update (the real Triton store kernel) -----------------

def store_case(layout, dtype, kv_cache_dtype="auto"):
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        cache_dtype = torch.uint8 if fp8 else dtype
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        w = workload(dtype)
        if fp8:
            w = on_fp8_grid(w, k_scale, v_scale)
        cache = allocate(layout, cache_dtype, kv_cache_dtype, offset=7)
        # a padded batch: the last slots are -1 and must be skipped
        slots = torch.cat([w.slots, torch.full((3,), -1, dtype=torch.int64)])
        keys = torch.cat([w.keys, torch.randn(3, HKV, DK).to(dtype)])
        vals = torch.cat([w.vals, torch.randn(3, HKV, DV).to(dtype)])
        fake_impl(kv_cache_dtype).do_kv_cache_update(
            fake_layer(k_scale, v_scale), keys, vals, cache, slots)
        k_view, v_view = split(cache)
        written = torch.zeros(NB, BS, dtype=torch.bool)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            written[b, o] = True
            if fp8:
                ek, ev = fp8_bytes(w.keys[i], k_scale), fp8_bytes(w.vals[i], v_scale)
            else:
                ek, ev = w.keys[i], w.vals[i]
            assert torch.equal(cache[b, :, o, :DK], ek), ("K", i)
            assert torch.equal(cache[b, :, o, DK:], ev), ("V", i)
            assert torch.equal(k_view[b, o], ek) and torch.equal(v_view[b, o], ev), i
        untouched = cache.permute(0, 2, 1, 3)[~written]
        assert torch.count_nonzero(untouched) == 0, "write outside the written slots"
        base = torch.tensor([], dtype=cache_dtype).set_(cache.untyped_storage())
        assert torch.count_nonzero(base[:7]) == 0, "write before the storage offset"
    return check


# ---- forward over the packed cache ---------------------------------------------------------

def triton_forward_case(layout, dtype):
    """TritonAttentionDiffKVImpl.forward: the real unified_attention_diffkv kernel."""
    from vllm.v1.attention.ops.triton_unified_attention_diffkv import unified_attention_diffkv

    def metadata(w):
        return SimpleNamespace(
            num_actual_tokens=sum(w.q_lens), use_cascade=False,
            query_start_loc=torch.tensor([0, w.q_lens[0], sum(w.q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(w.seq_lens, dtype=torch.int32),
            max_query_len=max(w.q_lens), block_table=w.block_table,
            seq_threshold_3D=None, num_par_softmax_segments=None, softmax_segm_output=None,
            softmax_segm_max=None, softmax_segm_expsum=None,
        )

    def check():
        w = workload(dtype, seed=1)
        cache = allocate(layout, dtype)
        impl, layer = fake_impl(), fake_layer()
        impl.do_kv_cache_update(layer, w.keys, w.vals, cache, w.slots)
        out = torch.zeros(sum(w.q_lens), HQ, DV, dtype=dtype)
        impl.forward(layer, w.q, w.keys, w.vals, cache, metadata(w), out)
        # the same tokens in vLLM 0.25.1's layout, read through its slicing
        old = allocate_old(layout, dtype)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            old[b, o, :, :DK], old[b, o, :, DK:] = w.keys[i], w.vals[i]
        out_old = torch.zeros_like(out)
        m = metadata(w)
        unified_attention_diffkv(
            q=w.q, k=old[..., :DK], v=old[..., DK:], out=out_old,
            cu_seqlens_q=m.query_start_loc, seqused_k=m.seq_lens, softmax_scale=DK**-0.5,
            causal=True, window_size=(-1, -1), block_table=w.block_table, softcap=0.0,
            max_seqlen_q=m.max_query_len,
        )
        assert torch.equal(out, out_old), f"vs 0.25.1 layout: {(out - out_old).abs().max()}"
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = (out.double() - reference(w, w.keys, w.vals)).abs().max().item()
        assert err < tol, f"max error vs float64 reference {err}"
    return check


def fa_forward_case(layout, dtype, kv_cache_dtype="auto"):
    """FlashAttentionDiffKVImpl.forward, float64 torch stand-in for flash_attn_varlen_func."""
    def check():
        fp8 = kv_cache_dtype.startswith("fp8")
        k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        w = workload(dtype, seed=1)
        if fp8:
            w = on_fp8_grid(w, k_scale, v_scale)
        cache = allocate(layout, torch.uint8 if fp8 else dtype, kv_cache_dtype)
        impl, layer = fake_impl(kv_cache_dtype), fake_layer(k_scale, v_scale)
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
        meta = SimpleNamespace(
            num_actual_tokens=sum(w.q_lens), use_cascade=False,
            query_start_loc=torch.tensor([0, w.q_lens[0], sum(w.q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(w.seq_lens, dtype=torch.int32),
            max_query_len=max(w.q_lens), max_seq_len=max(w.seq_lens),
            block_table=w.block_table, scheduler_metadata=None, causal=True,
            max_num_splits=0,
        )
        out = torch.zeros(sum(w.q_lens), HQ, DV, dtype=dtype)
        impl.forward(layer, w.q, w.keys, w.vals, cache, meta, out)
        k_view, v_view = split(cache)
        for got, view in ((seen["k"], k_view), (seen["v"], v_view)):
            assert got.data_ptr() == view.data_ptr() and got.stride() == view.stride()
            assert got.shape == view.shape and got.dtype == (FP8 if fp8 else dtype)
        if fp8:
            keys = fp8_bytes(w.keys, k_scale).view(FP8).double() * k_scale
            vals = fp8_bytes(w.vals, v_scale).view(FP8).double() * v_scale
        else:
            keys, vals = w.keys, w.vals
        err = (out.double() - reference(w, keys, vals)).abs().max().item()
        assert err < 2e-2, f"max error vs float64 reference {err}"
    return check


for _layout in ("NHD", "HND"):
    if BACKEND == "triton_attn_diffkv":
        for _dt in (torch.float32, torch.float16, torch.bfloat16):
            CASES[f"store_{_layout}_{str(_dt)[6:]}"] = store_case(_layout, _dt)
        # No bfloat16 attention: the Triton interpreter computes through numpy, which has
        # no bfloat16 (see layout_worker.py).
        for _dt in (torch.float32, torch.float16):
            CASES[f"forward_{_layout}_{str(_dt)[6:]}"] = triton_forward_case(_layout, _dt)
    else:
        for _dt in (torch.bfloat16, torch.float16):
            CASES[f"store_{_layout}_{str(_dt)[6:]}"] = store_case(_layout, _dt)
        CASES[f"store_{_layout}_fp8"] = store_case(_layout, torch.bfloat16, "fp8")
        CASES[f"forward_{_layout}_bfloat16"] = fa_forward_case(_layout, torch.bfloat16)
        CASES[f"forward_{_layout}_fp8"] = fa_forward_case(_layout, torch.bfloat16, "fp8")


def main() -> None:
    print(json.dumps(run_cases(ONLY, limit=4)))

if __name__ == "__main__":
    main()
