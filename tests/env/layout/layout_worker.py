"""Worker for test_triton_attn_packed.py: runs every check in a fresh interpreter.

Usage: python layout_worker.py PATCHED_TRITON_ATTN_PY
Prints one JSON object {case: {"ok": bool, "detail": str}} on the last stdout line.

Why a separate process: the Triton kernels must be created with TRITON_INTERPRET=1 (read
when `triton.jit` wraps them, i.e. at import), and vLLM on a machine without a GPU
replaces `triton` by a placeholder in `vllm.triton_utils`. Both changes are
process-global, so they are made here, never in the pytest process that other env tests
share.

The patched backend module is loaded from the given file under a private module name;
the Triton kernels come from the installed vLLM (the patch does not touch them: it is the
point of the check that the unmodified 0.25.1 kernels take the packed views).
"""

from __future__ import annotations

import json
import os
import sys
from types import MethodType, SimpleNamespace

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from worker_common import CASES, case, load_module, run_cases  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402

import vllm.triton_utils as triton_utils  # noqa: E402

# Real Triton (interpreted) instead of vLLM's no-GPU placeholder, before any kernel module
# is imported. The kernel wrappers ask for the CUDA capability to pick a tile size.
triton_utils.HAS_TRITON = True
triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.ops.triton_unified_attention import unified_attention  # noqa: E402
from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode  # noqa: E402

MODULE_NAME = "kvstack_layout_patched_triton_attn"


TA = load_module(sys.argv[1], MODULE_NAME)
Backend = TA.TritonAttentionBackend

# Tiny shapes: the interpreter runs every program instance in Python.
NB, BS, HKV, HQ, D = 6, 16, 2, 4, 32


def set_layout(layout: str) -> None:
    TA.get_kv_cache_layout = lambda: layout


def allocate(layout: str, dtype: torch.dtype, cache_dtype_str: str = "auto", *, offset: int = 0):
    """The KV cache the model runner builds: logical shape permuted from physical memory.

    `offset` > 0 puts the cache at a non-zero storage offset (as when layers share one
    allocation) to check that nothing assumes offset 0.
    """
    set_layout(layout)
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str=cache_dtype_str)
    order = Backend.get_kv_cache_stride_order()
    assert len(order) == len(shape)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    n = 1
    for s in physical:
        n *= s
    flat = torch.zeros(offset + n, dtype=dtype)
    return flat[offset:].view(physical).permute(*inverse)


def allocate_old(layout: str, dtype: torch.dtype):
    """vLLM 0.25.1's TRITON_ATTN cache: (B, 2, N, H, D), NHD or HND order; K/V = unbind(1)."""
    order = (0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4)
    shape = (NB, 2, BS, HKV, D)
    physical = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    return torch.zeros(physical, dtype=dtype).permute(*inverse)


def fake_impl(kv_cache_dtype: str = "auto"):
    """Just the state TritonAttentionImpl's cache methods read; the methods are the real ones."""
    mode = get_kv_quant_mode(kv_cache_dtype)
    impl = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=kv_cache_dtype,
        _kv_quant_mode=mode,
        _is_per_token_head_quant=mode.is_per_token_head,
        fp8_dtype=torch.float8_e4m3fn,
        _k_scale_cache=None,
        _v_scale_cache=None,
    )
    for name in ("_ensure_scale_caches", "_pth_key_value_caches", "do_kv_cache_update"):
        setattr(impl, name, MethodType(getattr(TA.TritonAttentionImpl, name), impl))
    return impl


def fake_layer():
    return SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))


def workload(dtype, seed=0):
    """Two sequences (a prefill of 20 tokens, a decode at position 37) on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [20, 38]
    q_lens = [20, 1]
    blocks = torch.randperm(NB, generator=g).tolist()
    tables = [blocks[:2], blocks[2:5]]
    # every token of both sequences is written (the decode's context too)
    slots, keys, vals, positions = [], [], [], []
    for s, L in enumerate(seq_lens):
        for p in range(L):
            slots.append(tables[s][p // BS] * BS + p % BS)
            positions.append((s, p))
    T = len(slots)
    keys = torch.randn(T, HKV, D, generator=g).to(dtype)
    vals = torch.randn(T, HKV, D, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return SimpleNamespace(
        seq_lens=seq_lens, q_lens=q_lens, slots=torch.tensor(slots, dtype=torch.int64),
        positions=positions, keys=keys, vals=vals, q=q, block_table=block_table,
    )


def run_attention(w, key_cache, value_cache, dtype, **quant):
    out = torch.zeros_like(w.q)
    cu = torch.tensor([0, w.q_lens[0], w.q_lens[0] + w.q_lens[1]], dtype=torch.int32)
    ones = torch.ones(1).expand(2, HKV)
    unified_attention(
        q=w.q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu,
        max_seqlen_q=max(w.q_lens), seqused_k=torch.tensor(w.seq_lens, dtype=torch.int32),
        max_seqlen_k=max(w.seq_lens), softmax_scale=D**-0.5, causal=True,
        window_size=(-1, -1), block_table=w.block_table, softcap=0,
        q_descale=None, k_descale=ones, v_descale=ones, **quant,
    )
    return out


def reference(w, keys=None, vals=None):
    """Causal attention in float64 from the token-ordered K/V (GQA: 2 q heads per kv head)."""
    keys = w.keys if keys is None else keys
    vals = w.vals if vals is None else vals
    out = torch.zeros(w.q.shape, dtype=torch.float64)
    tok0, q0 = 0, 0
    for s, (L, ql) in enumerate(zip(w.seq_lens, w.q_lens)):
        k = keys[tok0 : tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        v = vals[tok0 : tok0 + L].double().repeat_interleave(HQ // HKV, dim=1)
        q = w.q[q0 : q0 + ql].double()
        scores = torch.einsum("thd,shd->hts", q, k) * D**-0.5
        qpos = torch.arange(L - ql, L)[:, None]
        scores = scores.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
        out[q0 : q0 + ql] = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
        tok0 += L
        q0 += ql
    return out


# ---- shapes and stride orders (no kernel) -------------------------------------------------

@case("shape_auto")
def _():
    assert Backend.get_kv_cache_shape(NB, BS, HKV, D) == (NB, HKV, BS, 2 * D)


@case("shape_int8_per_token_head")
def _():
    # int8: 4 bytes of float32 scale after each K and each V head vector
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str="int8_per_token_head")
    assert shape == (NB, HKV, BS, 2 * (D + 4)), shape


@case("shape_int4_per_token_head")
def _():
    # int4: D/2 bytes of packed data + 4 bytes of scale per side (uint8 storage)
    shape = Backend.get_kv_cache_shape(NB, BS, HKV, D, cache_dtype_str="int4_per_token_head")
    assert shape == (NB, HKV, BS, 2 * (D // 2 + 4)), shape


@case("stride_orders")
def _():
    expect = {  # physical shapes, from the logical (L,) B, H, N, C
        ("NHD", False): (NB, BS, HKV, 2 * D),
        ("HND", False): (NB, HKV, BS, 2 * D),
        ("NHD", True): (NB, 3, BS, HKV, 2 * D),
        ("HND", True): (NB, HKV, 3, BS, 2 * D),
    }
    for (layout, layers), physical in expect.items():
        set_layout(layout)
        order = Backend.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        shape = ((3,) if layers else ()) + Backend.get_kv_cache_shape(NB, BS, HKV, D)
        assert sorted(order) == list(range(len(shape))), (layout, layers, order)
        got = tuple(shape[i] for i in order)
        assert got == physical, (layout, layers, got, physical)


@case("blocks_first_and_cross_layer")
def _():
    for layout in ("NHD", "HND"):
        set_layout(layout)
        assert Backend.get_kv_cache_block_dim(BS, HKV, D) == 0
        assert Backend.indexes_kv_by_block_stride()


@case("split_views_are_views")
def _():
    for layout in ("NHD", "HND"):
        cache = allocate(layout, torch.float32)
        k, v = TA.split_packed_kv_cache(cache)
        assert k.shape == v.shape == (NB, BS, HKV, D)
        assert k.stride() == v.stride() and k.stride(-1) == 1
        assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert v.data_ptr() - k.data_ptr() == D * cache.element_size()


@case("split_refuses_unpacked_cache")
def _():
    try:
        TA.split_packed_kv_cache(torch.zeros(NB, 2, BS, HKV, D))
    except ValueError as exc:
        assert "packed KV cache" in str(exc)
    else:
        raise AssertionError("a 5-D (0.25.1-layout) cache was accepted")


# ---- store and attention through the unmodified Triton kernels ---------------------------

def store_case(layout, dtype):
    def check():
        w = workload(dtype)
        cache = allocate(layout, dtype, offset=7)
        fake_impl().do_kv_cache_update(fake_layer(), w.keys, w.vals, cache, w.slots)
        written = torch.zeros(NB, BS, dtype=torch.bool)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            written[b, o] = True
            assert torch.equal(cache[b, :, o, :D], w.keys[i]), ("K", i)
            assert torch.equal(cache[b, :, o, D:], w.vals[i]), ("V", i)
        untouched = cache.permute(0, 2, 1, 3)[~written]
        assert torch.count_nonzero(untouched) == 0, "write outside the written slots"
    return check


def attention_case(layout, dtype):
    def check():
        w = workload(dtype, seed=1)
        cache = allocate(layout, dtype)
        fake_impl().do_kv_cache_update(fake_layer(), w.keys, w.vals, cache, w.slots)
        new = run_attention(w, *TA.split_packed_kv_cache(cache), dtype)
        # the same tokens in vLLM 0.25.1's layout, read through unbind(1)
        old_cache = allocate_old(layout, dtype)
        k_old, v_old = old_cache.unbind(1)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            k_old[b, o], v_old[b, o] = w.keys[i], w.vals[i]
        old = run_attention(w, k_old, v_old, dtype)
        assert torch.equal(new, old), f"max diff vs old layout {(new - old).abs().max()}"
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = (new.double() - reference(w)).abs().max().item()
        assert err < tol, f"max error vs float64 reference {err}"
    return check


def per_token_head_case(layout):
    def check():
        dtype_str = "int8_per_token_head"
        w = workload(torch.float32, seed=2)
        cache = allocate(layout, torch.int8, dtype_str, offset=16)
        impl = fake_impl(dtype_str)
        impl.do_kv_cache_update(fake_layer(), w.keys, w.vals, cache, w.slots)
        k_scale, v_scale = impl._k_scale_cache, impl._v_scale_cache
        assert k_scale.shape == v_scale.shape == (NB, BS, HKV)
        half = cache.shape[-1] // 2
        deq_k = torch.empty_like(w.keys)
        deq_v = torch.empty_like(w.vals)
        for i, slot in enumerate(w.slots.tolist()):
            b, o = divmod(slot, BS)
            for h in range(HKV):
                row = cache[b, h, o]
                # the scale views point at the bytes right after each side's data
                ks = row[D:half].contiguous().view(torch.float32).item()
                vs = row[half + D:].contiguous().view(torch.float32).item()
                assert ks == k_scale[b, o, h].item() and vs == v_scale[b, o, h].item()
                deq_k[i, h] = row[:D].float() * ks
                deq_v[i, h] = row[half:half + D].float() * vs
        assert (deq_k - w.keys).abs().max() <= w.keys.abs().max() / 127
        assert (deq_v - w.vals).abs().max() <= w.vals.abs().max() / 127
        key_cache, value_cache = impl._pth_key_value_caches(cache)
        out = run_attention(
            w, key_cache, value_cache, torch.float32,
            kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
            k_scale_cache=k_scale, v_scale_cache=v_scale,
        )
        err = (out.double() - reference(w, deq_k, deq_v)).abs().max().item()
        assert err < 1e-3, f"max error vs float64 reference on dequantised K/V {err}"
    return check


def _tag(layout, dtype):
    return f"{layout}_{str(dtype).removeprefix('torch.')}"


for _layout in ("NHD", "HND"):
    for _dtype in (torch.float32, torch.float16, torch.bfloat16):
        CASES[f"store_{_tag(_layout, _dtype)}"] = store_case(_layout, _dtype)
    # No bfloat16 attention: the Triton interpreter computes through numpy, which has no
    # bfloat16, and returns garbage for bf16 inputs in the old layout as well.
    for _dtype in (torch.float32, torch.float16):
        CASES[f"attention_{_tag(_layout, _dtype)}"] = attention_case(_layout, _dtype)
    CASES[f"int8_per_token_head_{_layout}"] = per_token_head_case(_layout)


def main() -> None:
    print(json.dumps(run_cases(set(sys.argv[2:]), limit=4)))

if __name__ == "__main__":
    main()
