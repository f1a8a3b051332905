"""The windowed path's copies (kvstack/streaming/transfer.py), no engine needed: page runs and slot
runs, windowed attention through staging buffers equal to full attention, and the connector's
per-step path under a fake asynchronous device.

The fake device (`DeferredMedium`) is a copy stream the way a GPU runs one: a copy is queued when it
is issued and lands only when something waits for it (the compute stream waiting for a window's
event, or the host syncing the write-backs); `EagerMedium` lands each copy at once. The attention
reads the staging buffers whatever has landed: a missing wait (a window attended before it is
loaded) or a buffer reused too early changes the output, and the comparison with full attention
fails. Issue 32's acceptance: no `pin_memory()` call and no blocking device-to-host copy on the
per-step path (both patched to raise while the connector's worker side runs two steps), every
pool <-> device copy issued as an asynchronous copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvstack.streaming.host_tier import HostStore, PagePool  # noqa: E402
from kvstack.streaming.transfer import (  # noqa: E402
    Medium, PagedHistory, Transfer, clip_runs, page_runs, slot_runs)
from kvstack.streaming.windowed import windowed_attention  # noqa: E402
from test_windowed import reference  # noqa: E402  (full causal attention in float64)


class _Event:
    def __init__(self, medium, upto):
        self.medium, self.upto = medium, upto


class DeferredMedium(Medium):
    """A fake asynchronous device: copies queue on the "copy stream" and land when waited for."""

    is_async = True

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.landed = 0  # copies landed so far (queue positions)
        self.issued = 0
        self.non_blocking = []

    def copy(self, dst, src):
        # read and written when it lands, in issue order, as on one copy stream
        self.queue.append((dst, src))
        self.issued += 1

    def _land(self, upto):
        while self.landed < upto:
            dst, src = self.queue[self.landed]
            dst.copy_(src)
            self.landed += 1

    def copy_event(self):
        return _Event(self, self.issued)

    def compute_waits(self, event):
        if event is not None:
            self._land(event.upto)

    def note_writes(self):
        self._written = self.issued

    def sync_writes(self):
        self._land(getattr(self, "_written", 0))


class EagerMedium(DeferredMedium):
    """Copies land as soon as they are issued (a copy stream far ahead of the compute stream)."""

    def copy(self, dst, src):
        super().copy(dst, src)
        self._land(self.issued)


def test_page_runs_and_slot_runs():
    assert page_runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert page_runs([]) == []
    # tokens 3..11 of a request with pages [7, 8, 2] of 4 tokens: slots 31, 32..35, 8..11
    assert slot_runs([7, 8, 2], 4, 3, 9) == [(31, 0, 5), (8, 5, 4)]
    assert slot_runs([1, 2], 4, 0, 8) == [(4, 0, 8)]
    assert slot_runs([5], 4, 2, 1) == [(22, 0, 1)]


def test_a_windows_runs_are_the_requests_runs_cut_to_it():
    """clip_runs (the runs of a request's pages computed once per call, cut per window) equals
    page_runs of the window's pages, on random page lists: consecutive, sorted with gaps, shuffled."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 40)
        kind = rng.choice(("consecutive", "sorted", "shuffled"))
        pages = (list(range(5, 5 + n)) if kind == "consecutive"
                 else sorted(rng.sample(range(60), n)) if kind == "sorted"
                 else rng.sample(range(60), n))
        a = rng.randint(0, n - 1)
        b = rng.randint(a, n - 1)
        assert clip_runs(page_runs(pages), a, b) == page_runs(pages[a:b + 1]), (pages, a, b)
    # the control: a window cut one page short is another list of runs
    assert clip_runs(page_runs([4, 5, 6]), 0, 1) != page_runs([4, 5, 6])


@pytest.mark.parametrize("medium", [Medium, DeferredMedium, EagerMedium])
@pytest.mark.parametrize("ctx,new,window,page,order", [
    (64, 1, 16, 8, "reversed"), (100, 13, 32, 16, "runs"), (37, 5, 7, 3, "reversed"),
    (96, 32, 96, 32, "runs"), (200, 3, 24, 8, "runs"), (0, 7, 4, 4, "runs"),
    (37, 1, 7, 3, "reversed"), (96, 1, 96, 32, "runs"), (95, 1, 200, 32, "runs")])
def test_windows_through_staging_equal_full_attention(medium, ctx, new, window, page, order):
    torch.manual_seed(ctx + new + window)
    Hq, Hkv, D = 4, 2, 32
    scale = D ** -0.5
    q = torch.randn(new, Hq, D)
    k = torch.randn(ctx + new, Hkv, D)
    v = torch.randn(ctx + new, Hkv, D)
    npages = -(-(ctx + new) // page)
    pages = list(range(npages))[::-1] if order == "reversed" else (
        list(range(40, 40 + npages // 2)) + list(range(2, 2 + npages - npages // 2)))
    store = HostStore(["L"], 64, page, Hkv, D, torch.float32)
    m = medium() if medium is not Medium else Medium(torch.device("cpu"))
    t = Transfer(m)
    t.write_back(store.k["L"], store.v["L"], pages, 0, k[:ctx], v[:ctx])
    t.sync_writes()
    out = torch.empty(new, Hq, D)
    windowed_attention(q, k[ctx:], v[ctx:], PagedHistory(t, store.k["L"], store.v["L"], pages),
                       ctx, window, scale, out=out)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale, ctx), atol=2e-5, rtol=2e-5)
    # a decode token's own K/V are read back with the history (windowed_attention)
    assert t.windows_loaded == -(-(ctx + (new == 1 and ctx > 0)) // window)


@pytest.mark.parametrize("medium", [Medium, DeferredMedium])
@pytest.mark.parametrize("ctx,window", [(96, 256), (96, 32), (70, 24)])
def test_a_decode_tokens_own_kv_is_read_back_with_its_history(monkeypatch, medium, ctx, window):
    """A decode token (one query, plain scores): its K/V are written to the pools first
    (PagedHistory.append) and attended as the last row of the history's last window, with no
    partial of its own (windowed.attend is never called); the output equals full attention, under
    the fake asynchronous device too (the write and the window's load on one copy stream, in
    order). The control: other K/V written, the row read back is not the token's."""
    from kvstack.streaming import windowed

    torch.manual_seed(ctx + window)
    Hq, Hkv, D, page = 4, 2, 32, 8
    q, k, v = torch.randn(1, Hq, D), torch.randn(ctx + 1, Hkv, D), torch.randn(ctx + 1, Hkv, D)
    k[ctx] = 2 * q[0].view(Hkv, Hq // Hkv, D).mean(1)  # the token attends mostly to itself
    pages = list(range(-(-(ctx + 1) // page)))[::-1]

    def run(history_cls=PagedHistory):
        store = HostStore(["L"], 64, page, Hkv, D, torch.float32)
        t = Transfer(medium() if medium is not Medium else Medium(torch.device("cpu")))
        t.write_back(store.k["L"], store.v["L"], pages, 0, k[:ctx], v[:ctx])
        t.sync_writes()
        out = windowed_attention(q, k[ctx:], v[ctx:],
                                 history_cls(t, store.k["L"], store.v["L"], pages), ctx, window,
                                 D ** -0.5)
        t.sync_writes()
        return out, t, store

    def no_partial(*a, **kw):
        raise AssertionError("a decode token's own partial was computed")

    monkeypatch.setattr(windowed, "attend", no_partial)
    out, t, store = run()
    torch.testing.assert_close(out.double(), reference(q, k, v, D ** -0.5, ctx), atol=2e-5,
                               rtol=2e-5)
    assert t.windows_loaded == -(-(ctx + 1) // window)
    slot = pages[ctx // page] * page + ctx % page
    assert torch.equal(store.k["L"].view(-1, Hkv, D)[slot], k[ctx])  # the pools hold it after

    class Unwritten(PagedHistory):
        def append(self, start, k, v):  # the control: the token's slot gets other K/V
            super().append(start, torch.zeros_like(k), torch.zeros_like(v))

    lost, _, _ = run(Unwritten)
    assert not torch.allclose(lost.double(), reference(q, k, v, D ** -0.5, ctx), atol=1e-3)


def test_a_cpu_window_of_one_page_run_is_a_view_of_the_pools():
    """On the CPU, where the kernel takes the pools' dtype (bf16 here, as a bf16 model's prefill
    windows on a CPU with AMX), a window whose pages are one run is a slice of the pools, nothing
    copied; pages out of order are copied into the staging buffer; in another dtype (float32
    staging) every window is copied; the fake asynchronous device never shares the pools' memory."""
    page, Hkv, D = 8, 2, 32
    store = HostStore(["L"], 16, page, Hkv, D, torch.bfloat16)
    kp, vp = store.k["L"], store.v["L"]
    base, end = kp.data_ptr(), kp.data_ptr() + kp.numel() * kp.element_size()
    t = Transfer(Medium(torch.device("cpu")))
    got = list(t.windows(kp, vp, [3, 4, 5, 6], 30, 16, torch.bfloat16))
    assert [s for s, _, _ in got] == [0, 16] and t.copies == 0
    assert all(base <= kw.data_ptr() < end for _, kw, _ in got)
    assert got[0][1].data_ptr() == kp[3].data_ptr()  # page 3, token 0
    got = list(t.windows(kp, vp, [3, 9, 5, 6], 30, 16, torch.bfloat16))
    assert t.copies == 4 and not base <= got[0][1].data_ptr() < end  # the first window copied
    t2 = Transfer(Medium(torch.device("cpu")))
    list(t2.windows(kp, vp, [3, 4, 5, 6], 30, 16))  # float32 staging: copied
    assert t2.copies == 4
    t3 = Transfer(DeferredMedium())
    list(t3.windows(kp, vp, [3, 4, 5, 6], 30, 16, torch.bfloat16))
    assert t3.copies == 4


@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_models_prefill_windows_run_in_bf16_on_amx(monkeypatch, amx):
    """On a CPU with AMX a bf16 model's windows of >= BF16_MIN_ROWS query rows are staged and
    attended in bf16 (torch's CPU flash kernel runs them on AMX tiles, ~2x float32), a decode
    token's and every other dtype's in float32; the result stays within bf16's rounding of full
    attention (forced either way here, whatever this CPU has). The control: the same comparison
    with the history's first window left out fails."""
    from kvstack.streaming import windowed

    monkeypatch.setattr(windowed, "_AMX", amx)
    rows = windowed.BF16_MIN_ROWS
    bf16_when_amx = torch.bfloat16 if amx else torch.float32
    assert windowed.cpu_kernel_dtype(torch.bfloat16, rows) == bf16_when_amx
    assert windowed.cpu_kernel_dtype(torch.bfloat16, rows - 1) == torch.float32
    assert windowed.cpu_kernel_dtype(torch.float16, 4 * rows) == torch.float32
    torch.manual_seed(11)
    Hq, Hkv, D, ctx, new, window, page = 4, 2, 32, 200, 16, 64, 16  # 16 tokens x 2 = 32 rows
    q, k, v = (torch.randn(n, h, D).bfloat16() for n, h in ((new, Hq), (ctx + new, Hkv),
                                                            (ctx + new, Hkv)))
    pages = list(range(-(-(ctx + new) // page)))[::-1]
    store = HostStore(["L"], 64, page, Hkv, D, torch.bfloat16)
    t = Transfer(Medium(torch.device("cpu")))
    t.write_back(store.k["L"], store.v["L"], pages, 0, k[:ctx], v[:ctx])
    out = torch.empty(new, Hq, D, dtype=torch.bfloat16)
    windowed_attention(q, k[ctx:], v[ctx:], PagedHistory(t, store.k["L"], store.v["L"], pages),
                       ctx, window, D ** -0.5, out=out)
    assert {dtype for _, dtype in t._staging} == {bf16_when_amx}
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), reference(q, k, v, D ** -0.5, ctx), **tol)
    with pytest.raises(AssertionError):  # the control
        torch.testing.assert_close(out.double(), reference(q, k[window:], v[window:], D ** -0.5,
                                                           ctx - window), **tol)


def test_a_missing_wait_is_caught_by_the_fake_device():
    """The negative control: windows attended without waiting for their copies (the compute
    stream not told to wait) read staging buffers the copies have not reached."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 32), torch.randn(67, 2, 32), torch.randn(67, 2, 32)
    store = HostStore(["L"], 16, 8, 2, 32, torch.float32)
    pages = list(range(9))
    m = DeferredMedium()
    t = Transfer(m)
    t.write_back(store.k["L"], store.v["L"], pages, 0, k[:64], v[:64])
    t.sync_writes()
    m.compute_waits = lambda event: None  # the bug
    out = windowed_attention(q, k[64:], v[64:], PagedHistory(t, store.k["L"], store.v["L"], pages),
                             64, 16, 0.2)
    assert not torch.allclose(out.double(), reference(q, k, v, 0.2, 64), atol=1e-3)


def _worker(medium, page=8, window=16, layers=("L",)):
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import _Layout
    from kvstack.streaming.worker_side import _WorkerSide

    cfg = StreamingConfig(streaming_layers=list(layers), page_tokens=page, window_tokens=window,
                          cpu_native_attention=False)
    layout = _Layout(group=0, block_size=16, layers=tuple(layers), num_kv_heads=2, head_size=32,
                     dtype=torch.float32, num_pages=32, reuse_ok=True)
    ws = _WorkerSide(cfg, layout)
    ws._open_store()
    t = Transfer(medium)
    ws.transfer.made[torch.device("cpu")] = t  # the fake device's Transfer, for the cpu tensors
    return ws, t


def test_the_workers_windows_per_layer():
    """prepare() sizes each streaming layer's window (StreamingConfig.window): window_mib capped at
    max_model_len for a plain layer, at most 1024 tokens for a soft-capped one (the reference
    path), the staging buffers for the largest."""
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import _Layout
    from kvstack.streaming.worker_side import _WorkerSide

    layout = _Layout(group=0, block_size=16, layers=("A", "B"), num_kv_heads=2, head_size=32,
                     dtype=torch.float32, num_pages=8, reuse_ok=True)

    def prepared(max_model_len, **extra):
        ws = _WorkerSide(StreamingConfig(page_tokens=8, cpu_native_attention=False, **extra),
                         layout)
        ctx = {"A": SimpleNamespace(layer_name="A", impl=SimpleNamespace()),
               "B": SimpleNamespace(layer_name="B", impl=SimpleNamespace(logits_soft_cap=30.0))}
        ws.prepare(SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx),
                                   model_config=SimpleNamespace(max_model_len=max_model_len)))
        return ws

    ws = prepared(5000)
    assert ws._windows == {"A": 5000, "B": 1024} and ws.window == 5000
    ws = prepared(300)
    assert ws._windows == {"A": 304, "B": 304}
    ws = prepared(5000, window_tokens=64)
    assert ws._windows == {"A": 64, "B": 64} and ws.window == 64
    # a pipeline stage without streaming layers (its rank's layout holds none) starts too
    layout = _Layout(group=0, block_size=16, layers=(), num_kv_heads=2, head_size=32,
                     dtype=torch.float32, num_pages=8, reuse_ok=True)
    ws = prepared(5000)
    assert ws._windows == {} and ws.window > 0


def test_the_connectors_step_path_never_pins_nor_blocks(monkeypatch):
    """Two steps of the worker side (a 70-token prefill over pages out of order, then a one-token
    decode step) under the fake asynchronous device: the output equals full attention, every pool
    <-> device copy went through the medium's asynchronous copy, and nothing pinned memory,
    gathered on the host or copied device-to-host blocking."""
    from kvstack.streaming.layout import ReqStep, StreamingMetadata

    def forbidden(what):
        def fail(*a, **kw):
            raise AssertionError(f"{what} on the connector's per-step path")
        return fail

    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden("pin_memory()"))
    monkeypatch.setattr(torch.Tensor, "cpu", forbidden("a blocking device-to-host copy (.cpu())"))
    monkeypatch.setattr(HostStore, "read", forbidden("a host-side gather (HostStore.read)"))
    monkeypatch.setattr(HostStore, "write", forbidden("a blocking write (HostStore.write)"))
    m = DeferredMedium()
    ws, t = _worker(m)
    torch.manual_seed(1)
    total = 71
    q, k, v = torch.randn(total, 4, 32), torch.randn(total, 2, 32), torch.randn(total, 2, 32)
    layer = SimpleNamespace(layer_name="L", impl=SimpleNamespace(scale=0.3))
    pages = [9, 10, 11, 3, 4, 5, 6, 20, 21]  # runs of consecutive pages, out of order
    outs = []
    for start, n, new_pages, known in ((0, 70, pages, 0), (70, 1, [], 9)):
        ws.begin_step(StreamingMetadata(reqs=[ReqStep("r", start, n, anchor_slot=1000 + start,
                                                      new_pages=new_pages, known_pages=known)]))
        md = SimpleNamespace(query_start_loc=torch.tensor([0, n]),
                             slot_mapping=torch.arange(1000 + start, 1000 + start + n))
        out = torch.empty(n, 4, 32)
        ws.attention(layer, q[start:start + n], k[start:start + n], v[start:start + n], out, md)
        ws.end_step()
        outs.append(out)
    got = torch.cat(outs)
    want = torch.cat([reference(q[:70], k[:70], v[:70], 0.3, 0),
                      reference(q[70:], k, v, 0.3, 70)])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # step 1 wrote 70 tokens in 3 slot runs (pages 9-11, 3-6, 20-21: 24 + 32 + 14 tokens; K and V);
    # step 2 loaded 70 tokens in windows of 16 (5 windows, page runs) and wrote 1 token
    assert t.windows_loaded == 5 and m.issued == t.copies > 0
    m.sync_writes()
    assert m.landed == m.issued  # every copy was asynchronous and is done once synced


def test_the_worker_walks_a_requests_pages_once_per_step_for_all_layers(monkeypatch):
    """Two streaming layers of one group, one request (the windowed path without packing): a
    decode step walks the request's pages into runs once, at the first layer (`_Batch.history`,
    which Transfer.windows keeps them in), and both layers equal full attention. Control: a cache
    per layer call (as before) walks them once per layer."""
    from kvstack.streaming import transfer, worker_side
    from kvstack.streaming.layout import ReqStep, StreamingMetadata

    walked = []
    real = transfer.page_runs
    monkeypatch.setattr(transfer, "page_runs", lambda p: walked.append(len(p)) or real(p))
    torch.manual_seed(2)
    total = 90
    pages = [30, 2, 17, 5, 25, 11, 8, 19, 0, 27, 14, 22]  # every page apart
    layers = {n: SimpleNamespace(layer_name=n, impl=SimpleNamespace(scale=0.3)) for n in "AB"}
    qkv = {n: (torch.randn(total, 4, 32), torch.randn(total, 2, 32), torch.randn(total, 2, 32))
           for n in layers}

    def decode_walks():
        ws, _ = _worker(Medium(torch.device("cpu")), layers=tuple(layers))
        for start, n, new_pages, known in ((0, total - 1, pages, 0), (total - 1, 1, [], 12)):
            ws.begin_step(StreamingMetadata(reqs=[ReqStep("r", start, n, anchor_slot=500 + start,
                                                          new_pages=new_pages, known_pages=known)]))
            md = SimpleNamespace(query_start_loc=torch.tensor([0, n]),
                                 slot_mapping=torch.arange(500 + start, 500 + start + n))
            walked.clear()
            for name, layer in layers.items():
                q, k, v = qkv[name]
                out = torch.empty(n, 4, 32)
                ws.attention(layer, q[start:start + n], k[start:start + n], v[start:start + n],
                             out, md)
                if start:  # the decode token over the whole history
                    torch.testing.assert_close(out.double(), reference(q[start:], k, v, 0.3, start),
                                               atol=2e-5, rtol=2e-5)
            ws.end_step()
        return len(walked)

    assert decode_walks() == 1
    monkeypatch.setattr(worker_side._Batch, "history", lambda self, j: {})
    assert decode_walks() == 2
