"""Scattered host-tier pages loaded in one go (kvstack/streaming/gather.py), no engine needed: a
window of many page runs is one gather instead of one copy per run, on the CPU by ``index_select``
(converting to the staging dtype), on a GPU by our Triton kernel reading the registered pool
through UVA. The kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, in a process of
its own: gather_interpret_run.py), against the torch path, through `Transfer` too. Controls: a
run dropped from the index, and two runs' sources swapped, change what is loaded; without the
interpreter, on a machine without a GPU, the kernel is reported unusable and runs are copied one
by one."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstack.streaming import gather
from kvstack.streaming.host_tier import HostStore
from kvstack.streaming.transfer import CudaMedium, Medium, Transfer

HERE = Path(__file__).resolve().parent


def test_run_rows_lists_every_row_of_the_runs_in_order():
    rng = random.Random(0)
    for _ in range(200):
        runs = [(rng.randrange(1000), rng.randrange(1000), rng.randint(1, 40))
                for _ in range(rng.randint(1, 30))]
        index = gather.run_rows(runs)
        assert index.dtype == torch.int32 and index.is_contiguous()
        want = [(s + i, d + i) for s, d, n in runs for i in range(n)]
        assert list(zip(index[0].tolist(), index[1].tolist())) == want


def test_the_torch_gather_equals_run_by_run_copies_and_converts():
    torch.manual_seed(0)
    k_src, v_src = torch.randn(300, 2, 16).bfloat16(), torch.randn(300, 2, 16).bfloat16()
    runs = [(250, 0, 7), (3, 7, 1), (100, 8, 30), (0, 38, 2)]
    got = [torch.zeros(45, 2, 16) for _ in range(2)]  # float32: the CPU kernels' staging dtype
    gather.copy_rows_kv(*got, k_src, v_src, gather.run_rows(runs), kernel="torch")
    want = [torch.zeros(45, 2, 16) for _ in range(2)]
    for s, d, n in runs:
        want[0][d:d + n] = k_src[s:s + n].float()
        want[1][d:d + n] = v_src[s:s + n].float()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _scattered(page=4, hkv=2, d=16, n_pages=60, dtype=torch.bfloat16, seed=1):
    torch.manual_seed(seed)
    store = HostStore(["L"], 128, page, hkv, d, dtype)
    pages = random.Random(seed).sample(range(128), n_pages)  # one run per page
    ctx = n_pages * page - 3
    k, v = torch.randn(ctx, hkv, d).to(dtype), torch.randn(ctx, hkv, d).to(dtype)
    Transfer(Medium(torch.device("cpu"))).write_back(store.k["L"], store.v["L"], pages, 0, k, v)
    return store, pages, ctx, k, v


def _load(t, store, pages, ctx, window):
    return [(s, wk.clone(), wv.clone()) for s, wk, wv in
            t.windows(store.k["L"], store.v["L"], pages, ctx, window)]


def test_a_window_of_scattered_pages_is_one_gather(monkeypatch):
    """A request whose pages are all apart: each window (16 runs of one page) is one gather, the
    K/V those of the request, converted to the CPU kernels' float32. Controls: with the gather
    off (a higher MIN_RUNS) the same windows come from one copy per run; an index missing its
    last run leaves rows unloaded."""
    store, pages, ctx, k, v = _scattered()
    t = Transfer(Medium(torch.device("cpu")))
    got = _load(t, store, pages, ctx, 64)
    assert t.gathers == len(got) == -(-ctx // 64) and t.copies == 0
    for s, wk, wv in got:
        assert wk.dtype == torch.float32
        n = len(wk)
        assert torch.equal(wk, k[s:s + n].float()) and torch.equal(wv, v[s:s + n].float())

    monkeypatch.setattr(gather, "MIN_RUNS", 10 ** 9)
    t2 = Transfer(Medium(torch.device("cpu")))
    runs_by_run = _load(t2, store, pages, ctx, 64)
    assert t2.gathers == 0 and t2.copies > 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, runs_by_run))

    monkeypatch.setattr(gather, "MIN_RUNS", 8)
    real = gather.run_rows
    monkeypatch.setattr(gather, "run_rows", lambda runs: real(runs[:-1]))
    t3 = Transfer(Medium(torch.device("cpu")))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(got, _load(t3, store, pages, ctx, 64)))


def test_packed_windows_of_scattered_pages_gather_and_stay_exact():
    """A step of three requests whose pages are shuffled, in packed windows of 64 tokens: every
    window one gather, the output equal to full causal attention per request."""
    from kvstack.streaming.packed import packed_attention
    from test_packed import D, _step
    from test_windowed import reference

    cases = [(200, 1), (150, 5), (90, 1)]
    store, segments, q, k, v, full = _step(cases, 4, "shuffled", seed=3)
    t = Transfer(Medium(torch.device("cpu")))
    out = torch.full_like(q, float("nan"))
    packed_attention(q, k, v, segments, store.k["L"], store.v["L"], t, 64, D ** -0.5, out)
    for (a, b, _), (qr, kr, vr, ctx) in zip(segments, full):
        torch.testing.assert_close(out[a:b].double(), reference(qr, kr, vr, D ** -0.5, ctx),
                                   atol=2e-5, rtol=2e-5)
    assert t.gathers == t.windows_loaded > 0


def test_a_step_builds_each_window_gather_index_once_for_all_layers(monkeypatch):
    """Two layers of one step with one StepPlan (as the worker runs a streaming group): each
    window's gather index is built by the first layer and reused by the second, the outputs
    those of the first layer. Control: without the shared plan every layer builds them again."""
    from kvstack.streaming.packed import StepPlan, packed_attention
    from test_packed import D, _step

    cases = [(200, 1), (150, 5), (90, 1)]
    store, segments, q, k, v, _ = _step(cases, 4, "shuffled", seed=3)
    built = []
    real = gather.run_rows
    monkeypatch.setattr(gather, "run_rows", lambda runs: built.append(len(runs)) or real(runs))
    pools = (store.k["L"].clone(), store.v["L"].clone())  # the layers' pools, as before the step

    def layers(step):
        outs = []
        for _ in range(2):
            t = Transfer(Medium(torch.device("cpu")))
            out = torch.full_like(q, float("nan"))
            packed_attention(q, k, v, segments, pools[0].clone(), pools[1].clone(), t, 64,
                             D ** -0.5, out, step=step)
            assert t.gathers == t.windows_loaded > 0
            outs.append(out)
        return outs

    step = StepPlan(segments, 64, 4)
    first, second = layers(step)
    assert torch.equal(first, second)
    assert len(built) == len(step.windows) == len(step.gather_index) > 1
    built.clear()
    layers(None)
    assert len(built) == 2 * len(step.windows)


def test_a_request_s_runs_and_gather_indexes_are_made_once_per_step_for_all_layers(monkeypatch):
    """One request alone (the windowed path without packing), its pages scattered: two layers of
    one step with one history cache (the worker's `_Batch.history`) walk its pages and build
    each window's gather index once, the second layer's output that of the first and of
    attention over the whole history. Control: without the cache every layer makes them again."""
    from kvstack.streaming import transfer
    from kvstack.streaming.transfer import PagedHistory
    from kvstack.streaming.windowed import windowed_attention
    from test_windowed import reference

    store, pages, ctx, k, v = _scattered(dtype=torch.float32)
    hq, (hkv, d) = 4, k.shape[1:]
    torch.manual_seed(5)
    q, nk, nv = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    pools = (store.k["L"].clone(), store.v["L"].clone())  # the layers' pools before the step
    built, walked = [], []
    real_rows, real_runs = gather.run_rows, transfer.page_runs
    monkeypatch.setattr(gather, "run_rows", lambda runs: built.append(len(runs)) or real_rows(runs))
    monkeypatch.setattr(transfer, "page_runs", lambda p: walked.append(len(p)) or real_runs(p))

    def layers(cache_of):
        outs = []
        for _ in range(2):
            t = Transfer(Medium(torch.device("cpu")))
            h = PagedHistory(t, pools[0].clone(), pools[1].clone(), pages, cache_of())
            outs.append(windowed_attention(q, nk, nv, h, ctx, 64, d ** -0.5))
            assert t.gathers == t.windows_loaded == -(-(ctx + 1) // 64)
        return outs

    step: dict = {}
    first, second = layers(lambda: step)
    assert torch.equal(first, second)
    want = reference(q, torch.cat([k, nk]), torch.cat([v, nv]), d ** -0.5, ctx)
    torch.testing.assert_close(first.double(), want, atol=2e-5, rtol=2e-5)
    windows = -(-(ctx + 1) // 64)
    assert len(walked) == 1 and len(built) == windows and len(step) == windows + 1
    built.clear(), walked.clear()
    assert torch.equal(layers(lambda: None)[1], second)
    assert len(walked) == 2 and len(built) == 2 * windows


def test_an_asynchronous_medium_without_a_kernel_copies_run_by_run():
    from test_transfer import DeferredMedium

    store, pages, ctx, k, v = _scattered(dtype=torch.float32)
    m = DeferredMedium()
    t = Transfer(m)
    got = _load(t, store, pages, ctx, 64)
    assert t.gathers == 0 and t.copies == m.issued > 0
    assert all(torch.equal(wk, k[s:s + len(wk)]) for s, wk, _ in got)


def test_a_gpu_gathers_only_from_pinned_pools_in_the_staging_dtype(monkeypatch):
    """CudaMedium's choice, without a GPU: our kernel where the pool is pinned, the staging buffer
    in the pool's dtype and the kernel checked out (gather.triton_usable); else run by run."""
    m = CudaMedium.__new__(CudaMedium)
    Medium.__init__(m, torch.device("cuda:0"))
    m._pinned = {}
    usable = {"ok": True}
    asked = []
    monkeypatch.setattr(gather, "triton_usable",
                        lambda dev, dtype, row_shape: asked.append(row_shape) or usable["ok"])
    pinned, plain = torch.zeros(64, 2, 16).bfloat16(), torch.zeros(64, 2, 16).bfloat16()
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr()
                        == pinned.untyped_storage().data_ptr())
    assert m.gather_kernel(pinned, torch.bfloat16) == "triton"
    assert asked == [(2, 16)]  # checked for the pool's rows: [slots, H, D] -> (H, D)
    assert m.gather_kernel(plain, torch.bfloat16) is None  # pageable: no UVA
    assert m.gather_kernel(pinned, torch.float32) is None  # the kernel does not convert
    usable["ok"] = False
    m._pinned.clear()
    assert m.gather_kernel(pinned, torch.bfloat16) is None  # the kernel failed its check


def _interpret(*checks, interpret="1"):
    env = {**os.environ, "TRITON_INTERPRET": interpret,
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), str(HERE),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(HERE / "gather_interpret_run.py"), *checks],
                          env=env, capture_output=True, text=True, timeout=600)


def test_the_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    r = _interpret()
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.split() == ["OK", "kernel", "OK", "usable", "OK", "transfer"], r.stdout


def test_without_a_gpu_nor_the_interpreter_the_kernel_is_not_used():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    code = ("import torch; from kvstack.streaming import gather; "
            "print(gather.triton_usable(torch.device('cpu'), torch.float32, (2, 32)))")
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[2])}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr[-3000:]
