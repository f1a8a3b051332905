"""The packed windows of a step (kvstack/streaming/packed.py), no engine needed: the plan covers every
history token once; a step's requests attended through packed windows equal full causal attention
per request (prefill chunks, decode tokens, histories shorter and longer than a window, pages in
runs and out of order) on the synchronous CPU medium and under the fake asynchronous device; the
same pieces as one varlen call per window (the GPU's way, here with a stand-in kernel that runs
the CPU flash kernel per segment of the cumulative lengths) equal them too. Controls: a piece
loaded at the wrong offset, and a window attended before its copies landed, change the output."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvstack.streaming import packed  # noqa: E402
from kvstack.streaming.host_tier import HostStore  # noqa: E402
from kvstack.streaming.packed import Piece, packed_attention, plan  # noqa: E402
from kvstack.streaming.transfer import Medium, Transfer  # noqa: E402
from test_transfer import DeferredMedium, EagerMedium  # noqa: E402
from test_windowed import reference  # noqa: E402

Hq, Hkv, D = 4, 2, 32


def test_the_plan_covers_every_history_token_once():
    rng = random.Random(0)
    for _ in range(500):
        spans = [rng.choice((0, 1, rng.randint(1, 90))) for _ in range(rng.randint(1, 6))]
        window = rng.randint(1, 40)
        windows = plan(spans, window)
        seen = {i: [] for i in range(len(spans))}
        for w in windows:
            assert w and w[0].at == 0
            assert all(a.at + a.end - a.start == b.at for a, b in zip(w, w[1:]))  # back to back
            assert w[-1].at + w[-1].end - w[-1].start <= window
            assert [p.req for p in w] == sorted({p.req for p in w})  # one piece per request
            for p in w:
                seen[p.req].append((p.start, p.end))
        for i, span in enumerate(spans):
            got = sorted(seen[i])
            assert [t for a, b in got for t in range(a, b)] == list(range(span)), (spans, window)
        # every window but the last is full: no staging buffer half empty
        assert all(sum(p.end - p.start for p in w) == window for w in windows[:-1])
    assert plan([5, 0, 3], 4) == [[Piece(0, 0, 4, 0)], [Piece(0, 4, 5, 0), Piece(2, 0, 3, 1)]]


def _step(cases, page, order, seed=0):
    """A step of requests (history ctx, new tokens) with their K/V in a host store: the pools,
    each request's pages and segments, the batch's q/k/v and the full per-request K/V."""
    torch.manual_seed(seed)
    store = HostStore(["L"], 256, page, Hkv, D, torch.float32)
    t0 = Transfer(Medium(torch.device("cpu")))
    free = list(range(256))
    if order == "shuffled":
        random.Random(seed).shuffle(free)
    segments, qs, ks, vs, full = [], [], [], [], []
    row = 0
    for ctx, new in cases:
        n = -(-(ctx + new) // page)
        pages = [free.pop(0) for _ in range(n)]
        q, k, v = torch.randn(new, Hq, D), torch.randn(ctx + new, Hkv, D), torch.randn(ctx + new, Hkv, D)
        t0.write_back(store.k["L"], store.v["L"], pages, 0, k[:ctx], v[:ctx])
        segments.append((row, row + new, SimpleNamespace(start=ctx, pages=pages)))
        row += new
        qs.append(q), ks.append(k[ctx:]), vs.append(v[ctx:]), full.append((q, k, v, ctx))
    return store, segments, torch.cat(qs), torch.cat(ks), torch.cat(vs), full


CASES = [
    [(64, 1), (0, 7), (100, 13), (37, 1), (5, 3)],  # decode, a first chunk, prefill, decode
    [(200, 1), (200, 1), (200, 1)],  # decode tokens, each history over several windows
    [(3, 1), (0, 1), (9, 2), (1, 1)],  # short histories: several requests in one window
    [(96, 32)],  # one request
]


@pytest.mark.parametrize("medium", ["sync", "deferred", "eager"])
@pytest.mark.parametrize("cases", CASES)
@pytest.mark.parametrize("window,page,order", [(24, 8, "runs"), (16, 8, "shuffled"),
                                               (7, 3, "shuffled"), (512, 32, "runs")])
def test_packed_windows_equal_full_attention(medium, cases, window, page, order):
    store, segments, q, k, v, full = _step(cases, page, order)
    m = {"sync": lambda: Medium(torch.device("cpu")), "deferred": DeferredMedium,
         "eager": EagerMedium}[medium]()
    t = Transfer(m)
    out = torch.full_like(q, float("nan"))
    packed_attention(q, k, v, segments, store.k["L"], store.v["L"], t, window, D ** -0.5, out)
    t.sync_writes()
    for (a, b, r), (qr, kr, vr, ctx) in zip(segments, full):
        torch.testing.assert_close(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx),
                                   atol=2e-5, rtol=2e-5)
        # the new tokens' K/V are in the pools now (the next step's history)
        back = torch.cat([store.k["L"][p] for p in r.pages])[:ctx + b - a]
        torch.testing.assert_close(back, kr)
    spans = [ctx + (b - a == 1 and ctx > 0) for (a, b, _), (_, _, _, ctx) in zip(segments, full)]
    assert t.windows_loaded == len(plan(spans, window))


def _varlen_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """A stand-in for FlashAttention's varlen forward where there is no GPU: per segment of the
    cumulative lengths, the CPU flash kernel (no mask: the pieces are history), an empty key range
    giving lse +inf as FlashAttention writes it."""
    from kvstack.streaming.windowed import WindowQuery

    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]]
        if ck[i + 1] == ck[i]:
            outs.append(torch.zeros(qi.shape[0], qi.shape[1], v.shape[-1]))
            lses.append(torch.full((qi.shape[1], qi.shape[0]), float("inf")))
            continue
        o, lse = WindowQuery(qi, scale).attend(k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]])
        outs.append(o), lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("cases", CASES)
def test_one_varlen_call_per_window_equals_full_attention(monkeypatch, cases):
    calls = []

    def kernel(*args):
        calls.append(args[3].tolist())
        return _varlen_on_cpu(*args)

    monkeypatch.setattr(packed, "varlen", kernel)
    store, segments, q, k, v, full = _step(cases, 8, "shuffled", seed=1)
    t = Transfer(DeferredMedium())  # asynchronous: every window in one staging buffer
    out = torch.empty_like(q)
    packed_attention(q, k, v, segments, store.k["L"], store.v["L"], t, 24, D ** -0.5, out,
                     use_varlen=True)
    for (a, b, r), (qr, kr, vr, ctx) in zip(segments, full):
        torch.testing.assert_close(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx),
                                   atol=2e-5, rtol=2e-5)
    assert len(calls) == t.windows_loaded  # one call per window, whatever its requests


def test_a_piece_at_the_wrong_offset_changes_the_output(monkeypatch):
    """Control: the pieces' offsets matter (a window's second piece read from its first's place)."""
    store, segments, q, k, v, full = _step(CASES[2], 8, "runs")
    real = packed.plan

    def shifted(spans, window):
        ws = real(spans, window)
        return [[p if i == 0 else Piece(p.req, p.start, p.end, 0) for i, p in enumerate(w)]
                for w in ws]

    monkeypatch.setattr(packed, "plan", shifted)
    t = Transfer(DeferredMedium())
    out = torch.empty_like(q)
    packed_attention(q, k, v, segments, store.k["L"], store.v["L"], t, 24, D ** -0.5, out)
    diffs = [not torch.allclose(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx), atol=1e-3)
             for (a, b, _), (qr, kr, vr, ctx) in zip(segments, full)]
    assert any(diffs)


def test_a_missing_wait_changes_the_output():
    """Control: windows attended without waiting for their copies read unlanded staging buffers."""
    store, segments, q, k, v, full = _step(CASES[1], 8, "runs")
    m = DeferredMedium()
    t = Transfer(m)
    m.compute_waits = lambda event: None  # the bug
    out = torch.zeros_like(q)
    packed_attention(q, k, v, segments, store.k["L"], store.v["L"], t, 24, D ** -0.5, out)
    assert any(not torch.allclose(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx),
                                  atol=1e-3)
               for (a, b, _), (qr, kr, vr, ctx) in zip(segments, full))


def test_the_worker_side_packs_a_steps_requests_without_pinning_or_blocking(monkeypatch):
    """The connector's worker side with two requests in a step (a prefill chunk over a history and
    a decode token), under the fake asynchronous device: their histories go through packed windows
    (fewer window loads than one per request and window), the output equals full attention, and
    nothing pins memory or copies device-to-host blocking. Control: one request alone takes the
    per-request path (windows of its own)."""
    from kvstack.streaming.layout import ReqStep, StreamingMetadata
    from test_transfer import _worker

    def forbidden(what):
        def fail(*a, **kw):
            raise AssertionError(f"{what} on the connector's per-step path")
        return fail

    m = DeferredMedium()
    ws, t = _worker(m, page=8, window=32)
    torch.manual_seed(2)
    layer = SimpleNamespace(layer_name="L", impl=SimpleNamespace(scale=0.3))
    # two requests, each 40 history tokens written by a first step of its own
    qa, ka, va = torch.randn(45, 4, 32), torch.randn(45, 2, 32), torch.randn(45, 2, 32)
    qb, kb, vb = torch.randn(41, 4, 32), torch.randn(41, 2, 32), torch.randn(41, 2, 32)
    pa, pb = [0, 1, 2, 3, 4, 5], [9, 8, 7, 6, 10, 11]

    def step(reqs, q, k, v):
        ws.begin_step(StreamingMetadata(reqs=reqs))
        lens = [r.num_tokens for r in reqs]
        qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))])
        slots = torch.cat([torch.arange(r.anchor_slot, r.anchor_slot + r.num_tokens) for r in reqs])
        out = torch.empty(q.shape[0], 4, 32)
        ws.attention(layer, q, k, v, out, SimpleNamespace(query_start_loc=qsl, slot_mapping=slots))
        ws.end_step()
        return out

    step([ReqStep("a", 0, 40, 1000, pa)], qa[:40], ka[:40], va[:40])
    step([ReqStep("b", 0, 40, 2000, pb)], qb[:40], kb[:40], vb[:40])
    loaded = t.windows_loaded
    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden("pin_memory()"))
    monkeypatch.setattr(torch.Tensor, "cpu", forbidden("a blocking device-to-host copy (.cpu())"))
    out = step([ReqStep("a", 40, 5, 1040, [], known_pages=6), ReqStep("b", 40, 1, 2040, [], known_pages=6)],
               torch.cat([qa[40:], qb[40:]]), torch.cat([ka[40:], kb[40:]]),
               torch.cat([va[40:], vb[40:]]))
    torch.testing.assert_close(out[:5].double(), reference(qa[40:], ka, va, 0.3, 40),
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[5:].double(), reference(qb[40:], kb, vb, 0.3, 40),
                               atol=2e-5, rtol=2e-5)
    # 40 + 41 history tokens (b's decode token read back with its history) in windows of 32:
    # 3 packed windows, against 2 + 2 one request at a time
    assert t.windows_loaded - loaded == len(plan([40, 41], 32)) == 3
    m.sync_writes()
    assert m.landed == m.issued
    # the control: one request alone, windows of its own (the per-request path)
    loaded = t.windows_loaded
    step([ReqStep("a", 45, 1, 1045, [], known_pages=6)], qa[44:45], ka[44:45], va[44:45])
    assert t.windows_loaded - loaded == 2  # 46 tokens in windows of 32


def test_the_plan_is_made_once_per_step_for_every_layer_of_a_group(monkeypatch):
    """Two streaming layers of one group, two steps of two requests each: the packed plan (windows
    and slot runs) is made once per step, at the group's first layer, and both layers' outputs
    equal full attention in both steps. Control: the second step (other requests, other lengths)
    gets a plan of its own, not the first step's (which would not cover its histories)."""
    from kvstack.streaming.layout import ReqStep, StreamingMetadata
    from test_transfer import _worker

    made = []
    real = packed.StepPlan.__init__

    def counting(self, segments, window, page_tokens):
        real(self, segments, window, page_tokens)
        made.append(list(self.spans))

    monkeypatch.setattr(packed.StepPlan, "__init__", counting)
    m = DeferredMedium()
    ws, t = _worker(m, page=8, window=32, layers=("L", "M"))
    layers = [SimpleNamespace(layer_name=n, impl=SimpleNamespace(scale=0.3)) for n in "LM"]
    torch.manual_seed(4)
    n = {"a": 52, "b": 44, "c": 30}
    qkv = {(r, ln): (torch.randn(n[r], 4, 32), torch.randn(n[r], 2, 32), torch.randn(n[r], 2, 32))
           for r in n for ln in "LM"}
    pages = {"a": [0, 1, 2, 3, 4, 5, 6], "b": [13, 12, 11, 10, 9, 8], "c": [20, 21, 22, 23]}
    anchor = {"a": 1000, "b": 2000, "c": 3000}

    def step(reqs):
        ws.begin_step(StreamingMetadata(reqs=reqs))
        lens = [r.num_tokens for r in reqs]
        qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))])
        slots = torch.cat([torch.arange(r.anchor_slot, r.anchor_slot + r.num_tokens) for r in reqs])
        outs = {}
        for layer in layers:
            rows = [qkv[(r.req_id, layer.layer_name)] for r in reqs]
            q, k, v = (torch.cat([x[i][r.start:r.start + r.num_tokens] for x, r in zip(rows, reqs)])
                       for i in range(3))
            out = torch.empty(q.shape[0], 4, 32)
            ws.attention(layer, q, k, v, out,
                         SimpleNamespace(query_start_loc=qsl, slot_mapping=slots))
            outs[layer.layer_name] = out
        ws.end_step()
        return outs

    def check(outs, reqs):
        a = 0
        for r in reqs:
            for ln in "LM":
                q, k, v = qkv[(r.req_id, ln)]
                end = r.start + r.num_tokens
                torch.testing.assert_close(
                    outs[ln][a:a + r.num_tokens].double(),
                    reference(q[r.start:end], k[:end], v[:end], 0.3, r.start),
                    atol=2e-5, rtol=2e-5)
            a += r.num_tokens

    for r in ("a", "b", "c"):  # each request's first 40 (c: 24) tokens, a step of its own
        first = 24 if r == "c" else 40
        step([ReqStep(r, 0, first, anchor[r], pages[r])])
    made.clear()
    reqs = [ReqStep("a", 40, 12, anchor["a"] + 40, [], known_pages=7),
            ReqStep("b", 40, 1, anchor["b"] + 40, [], known_pages=6)]
    check(step(reqs), reqs)
    assert made == [[40, 41]]  # once for both layers
    reqs = [ReqStep("b", 41, 1, anchor["b"] + 41, [], known_pages=6),
            ReqStep("c", 24, 6, anchor["c"] + 24, [], known_pages=4)]
    check(step(reqs), reqs)
    assert made == [[40, 41], [42, 24]]  # the control: a plan of its own
    m.sync_writes()
    assert m.landed == m.issued


def test_a_step_makes_its_varlen_lengths_once_for_all_layers(monkeypatch):
    """Two layers of one step with one StepPlan: every window's cumulative lengths are views of
    one tensor made at the first call, the second layer's calls get the same ones, and both
    layers' outputs equal full attention. Control: without the shared plan each layer makes its
    own."""
    calls = []

    def kernel(*args):
        calls.append((args[3], args[4]))
        return _varlen_on_cpu(*args)

    monkeypatch.setattr(packed, "varlen", kernel)
    store, segments, q, k, v, full = _step(CASES[0], 8, "shuffled", seed=1)
    pools = (store.k["L"].clone(), store.v["L"].clone())

    def layers(step):
        for _ in range(2):
            out = torch.empty_like(q)
            packed_attention(q, k, v, segments, pools[0].clone(), pools[1].clone(),
                             Transfer(DeferredMedium()), 24, D ** -0.5, out, use_varlen=True,
                             step=step)
            for (a, b, _), (qr, kr, vr, ctx) in zip(segments, full):
                torch.testing.assert_close(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx),
                                           atol=2e-5, rtol=2e-5)

    step = packed.StepPlan(segments, 24, 8)
    layers(step)
    n = len(step.windows)
    assert len(calls) == 2 * n > 2
    one, two = calls[:n], calls[n:]
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(one, two))
    assert len({t.untyped_storage().data_ptr() for c in one for t in c}) == 1  # one tensor
    calls.clear()
    layers(None)
    assert not any(a[0] is b[0] for a, b in zip(calls[:n], calls[n:]))


def test_the_varlen_kernel_is_used_only_where_it_checks_out(monkeypatch):
    """varlen_usable: the stand-in kernel (right) is accepted; one that drops the last request's
    keys (wrong) and one that raises (missing) are not, and packed windows go per piece."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(packed, "_VARLEN_OK", {})
    monkeypatch.setattr(packed, "varlen", _varlen_on_cpu)
    assert packed.varlen_usable(cpu, torch.float32, Hq, Hkv, D)

    def wrong(q, k, v, cu_q, cu_k, *rest):
        cu_k = cu_k.clone()
        cu_k[-1] = cu_k[-2] + 1  # the last request sees one key of its range
        return _varlen_on_cpu(q, k, v, cu_q, cu_k, *rest)

    def missing(*a):
        raise RuntimeError("no FlashAttention on this device")

    for kernel in (wrong, missing):
        monkeypatch.setattr(packed, "_VARLEN_OK", {})
        monkeypatch.setattr(packed, "varlen", kernel)
        assert not packed.varlen_usable(cpu, torch.float32, Hq, Hkv, D)
