"""Windowed attention over the host tier equals full causal attention (no engine needed)."""

import pytest
import torch

from kvstack.streaming.host_tier import HostStore, PagePool, page_hashes
from kvstack.streaming.windowed import attend, attend_reference, torch_merge, windowed_attention

# fp32: exact up to summation order; bf16: inputs and output rounded to bf16 (8 bits mantissa).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference(q, k, v, scale, ctx):
    """Softmax attention of q (positions ctx..) over all of k/v, causal, in float64."""
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    vv = v.double().repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    mask = torch.arange(S)[None, :] > (torch.arange(T)[:, None] + ctx)
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx,new,window,page",
    [(0, 7, 4, 4), (0, 1, 4, 4), (64, 1, 16, 8), (64, 1, 24, 8), (100, 13, 32, 16), (37, 5, 7, 3), (96, 32, 96, 32)],
)
def test_windowed_equals_full(dtype, ctx, new, window, page):
    torch.manual_seed(ctx * 31 + new + window)
    Hq, Hkv, D = 4, 2, 32
    scale = D**-0.5
    q = torch.randn(new, Hq, D).to(dtype)
    k = torch.randn(ctx + new, Hkv, D).to(dtype)
    v = torch.randn(ctx + new, Hkv, D).to(dtype)

    # history lives in a paged host store, pages deliberately out of order
    pool = PagePool(num_pages=64, page_tokens=page)
    pool.ensure("r", ctx + new)
    pool._reqs["r"].pages.reverse()
    store = HostStore(["L"], 64, page, Hkv, D, dtype)
    pages = pool.pages("r")
    if ctx:
        store.write("L", pages, 0, k[:ctx], v[:ctx])
    windows = []

    def history(s, e):
        windows.append((s, e))
        return store.read("L", pages, s, e)

    out = torch.empty(new, Hq, D, dtype=dtype)
    windowed_attention(q, k[ctx:], v[ctx:], history, ctx, window, scale, out=out)
    ref = reference(q, k, v, scale, ctx)
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), **TOL[dtype])
    assert all(e - s <= window for s, e in windows)
    assert sum(e - s for s, e in windows) == ctx


def test_fully_masked_rows_and_merge_fallback_agree():
    torch.manual_seed(0)
    q = torch.randn(3, 4, 32)
    k = torch.randn(5, 2, 32)
    v = torch.randn(5, 2, 32)
    a, la = attend(q, k[:2], v[:2], 0.2)
    b, lb = attend(q, k[2:], v[2:], 0.2)
    o1, l1 = torch.empty_like(a), torch.empty_like(la)
    torch_merge(o1, a, la, b, lb, l1)
    full, lfull = attend(q, k, v, 0.2)
    torch.testing.assert_close(o1, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, lfull, atol=1e-5, rtol=1e-5)
    from kvstack.streaming.windowed import merge

    o2, l2 = torch.empty_like(a), torch.empty_like(la)
    merge(o2, a, la, b, lb, l2)  # vLLM's merge_attn_states (torch fallback on CPU)
    torch.testing.assert_close(o2, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [3, 300])  # 300 x 4 x 8 is above SMALL_PARTIAL: the other sum
@pytest.mark.parametrize("mode", ["pairwise", "grouped, folded every 2", "grouped, one fold"])
def test_partials_merge_by_the_lse_rule(mode, T):
    """Partials (windowed_attention's merge): pairwise (a GPU: vLLM's merge as each partial comes)
    and grouped (the CPU: in groups, folded when a group is full or at the end) both equal the LSE
    rule computed directly in float64, a sink (an LSE without a value) included; leaving one
    partial out (the control) does not."""
    from kvstack.streaming.windowed import SMALL_PARTIAL, Partials

    torch.manual_seed(5)
    H, D = 4, 8
    assert (T * H * D > SMALL_PARTIAL) == (T == 300)
    outs = [torch.randn(T, H, D) for _ in range(7)]
    lses = [torch.randn(H, T) * 3 for _ in range(7)]
    sink = torch.randn(H, 1).expand(H, T)

    def direct(outs, lses, sink):
        lse = torch.stack([x.double() for x in lses] + [sink.double()])
        w = torch.softmax(lse, 0)[:-1]  # [G, H, T]; the sink takes its share of the weight
        return torch.einsum("ght,gthd->thd", w, torch.stack(outs).double())

    def merged(outs, lses):
        grouped = mode != "pairwise"
        group_bytes = T * H * D * 4 * 2 if mode == "grouped, folded every 2" else 1 << 30
        p = Partials(torch.device("cpu"), grouped=grouped, group_bytes=group_bytes)
        for o, lse in zip(outs, lses):
            p.add(o, lse)
        p.add(None, sink)
        return p.result()

    torch.testing.assert_close(merged(outs, lses).double(), direct(outs, lses, sink),
                               atol=1e-5, rtol=1e-5)
    control = merged(outs[:3] + outs[4:], lses[:3] + lses[4:]).double()
    assert not torch.allclose(control, direct(outs, lses, sink), atol=1e-3)


def test_page_pool_reuse_and_free():
    pool = PagePool(num_pages=8, page_tokens=4)
    toks = list(range(20))
    hs = page_hashes(toks, 4)
    pool.start("a", hs, 0)
    pool.ensure("a", 20)
    pool.register_full_pages("a", hs, 20)
    assert pool.num_used() == 5
    pool.finish("a")
    assert pool.num_used() == 0 and pool.num_available() == 8
    assert pool.match_prefix(hs) == 5
    pool.start("b", hs, 4)
    assert pool.stats.prefix_hit_tokens == 16
    pool.ensure("b", 21)
    assert len(pool.pages("b")) == 6
    pool.finish("b")
    # many requests: no growth
    for i in range(50):
        pool.start(f"x{i}", [], 0)
        pool.ensure(f"x{i}", 30)
        pool.finish(f"x{i}")
    assert pool.num_used() == 0
    from kvstack.streaming.host_tier import HostTierFull

    pool.start("big", [], 0)
    with pytest.raises(HostTierFull):
        pool.ensure("big", 33)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_kernel_path_equals_reference(causal):
    torch.manual_seed(3)
    q, k, v = torch.randn(9, 4, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32)
    off = 0 if causal else None
    o1, l1 = attend(q, k, v, 0.3, off)
    o2, l2 = attend_reference(q, k, v, 0.3, off)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
def test_a_lone_new_token_equals_the_reference(dtype, heads):
    """A decode step's new token over itself (windowed._self_only, no kernel call): its value per
    query head and its score as the LSE, as the reference computes them; the control: another
    token's key changes the LSE."""
    torch.manual_seed(5)
    Hq, Hkv = heads
    q, k, v = (torch.randn(1, h, 32).to(dtype) for h in (Hq, Hkv, Hkv))
    o1, l1 = attend(q, k, v, 0.3, 0)
    o2, l2 = attend_reference(q, k, v, 0.3, 0)
    assert o1.shape == (1, Hq, 32) and l1.shape == (Hq, 1) and o1.dtype == l1.dtype == torch.float32
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attend(q, torch.randn_like(k), v, 0.3, 0)[1], l1)


def test_file_backed_host_store(tmp_path):
    path = tmp_path / "tier.bin"
    store = HostStore(["A", "B"], 4, 8, 2, 16, torch.bfloat16, path=str(path))
    k = torch.randn(20, 2, 16).bfloat16()
    v = torch.randn(20, 2, 16).bfloat16()
    store.write("B", [3, 0, 2], 1, k, v)
    rk, rv = store.read("B", [3, 0, 2], 1, 21)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert path.stat().st_size == 2 * 2 * 4 * 8 * 2 * 16 * 2  # layers x (K,V) x pages x ...


def test_config_and_auto_layer_selection():
    from types import SimpleNamespace

    from kvstack.streaming.config import StreamingConfig, selects_layer

    llama4 = SimpleNamespace(hf_text_config=SimpleNamespace(no_rope_layers=[1, 1, 1, 0]))
    cfg = StreamingConfig.from_extra({})
    assert [selects_layer(cfg, llama4, f"model.layers.{i}.self_attn.attn") for i in range(4)] == [
        False, False, False, True]
    plain = SimpleNamespace(hf_text_config=SimpleNamespace())
    assert selects_layer(cfg, plain, "model.layers.0.self_attn.attn")
    cfg = StreamingConfig.from_extra({"streaming_layers": [r"layers\.1\."], "window_tokens": 64})
    assert cfg.window_tokens == 64
    assert [selects_layer(cfg, llama4, f"model.layers.{i}.self_attn.attn") for i in range(4)] == [
        False, True, False, False]
    with pytest.raises(ValueError):
        StreamingConfig.from_extra({"window_tokens": 0})


def test_new_tokens_attend_gqa_without_repeating_kv_on_the_cpu(monkeypatch):
    """Issue 32 point 4: the new tokens' causal partial takes GQA as it is on the CPU (query head
    h over KV head h // rep), no K/V repeated per query head; equal to full attention. Control:
    the new tokens' two KV heads swapped change the output (the grouping is checked, not
    assumed)."""
    torch.manual_seed(11)
    Hq, Hkv, D, ctx, new = 8, 2, 32, 40, 9
    q = torch.randn(new, Hq, D)
    k, v = torch.randn(ctx + new, Hkv, D), torch.randn(ctx + new, Hkv, D)
    ref = reference(q, k, v, D ** -0.5, ctx)  # repeats K/V itself: before the patch below

    def forbidden(*a, **kw):
        raise AssertionError("K/V repeated per query head on the CPU")

    history = lambda s, e: (k[s:e], v[s:e])  # noqa: E731
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    out = windowed_attention(q, k[ctx:], v[ctx:], history, ctx, 16, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    swapped = k[ctx:].flip(1), v[ctx:].flip(1)
    out2 = windowed_attention(q, *swapped, history, ctx, 16, D ** -0.5)
    assert (out2.double() - ref).abs().max() > 1e-2
