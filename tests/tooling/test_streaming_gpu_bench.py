"""bench/streaming_gpu.py in its CPU mode (what CI runs; no GPU, no vLLM): the windowed + merged
attention over a paged host tier equals direct attention on every path (prefill stream, decode
stream with recent tokens on the device, host-side decode), the negative control changes the
output, every figure is printed, and the last line is the RESULT line with all of them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "streaming_gpu.py"

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_run():
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--decode",
                           "stream,host,connector"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_tiny_cpu_mode_exits_zero(tiny_run):
    assert tiny_run.returncode == 0, tiny_run.stdout[-3000:] + tiny_run.stderr[-3000:]


def test_exactness_and_negative_control(tiny_run):
    out = tiny_run.stdout
    for path in ("prefill stream", "decode stream", "decode host", "prefill connector",
                 "decode connector"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"exactness {path}:"))
        diff, tol = map(float, re.search(r"= ([0-9.e+-]+) \(tolerance ([0-9.e+-]+)\)",
                                         line).groups())
        assert diff <= tol, line
        changed = float(re.search(r"output changed by ([0-9.]+)", line).group(1))
        assert changed > 10 * tol, line
    summary = next(ln for ln in out.splitlines() if ln.startswith("exactness: "))
    assert "identical within tolerance" in summary
    assert "negative control: changed" in summary


def test_result_line_has_every_figure(tiny_run):
    lines = tiny_run.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ")
    kv = dict(item.split("=", 1) for item in lines[-1][len("RESULT "):].split())
    assert kv["device"] == "cpu"
    assert kv["exact_ok"] == "1" and kv["control_changed"] == "1"
    for key in ("h2d_gbps", "host_read_gbps", "exact_maxdiff", "window_tokens"):
        assert float(kv[key]) > 0, key
    for ctx in ("2K", "8K"):
        for order in ("contiguous", "shuffled"):
            base = f"{ctx}_{order}"
            for key in (f"prefill_s_{base}", f"prefill_ratio_{base}", f"copies_per_window_{base}"):
                assert float(kv[key]) > 0, key
            for b in (1, 4):
                for key in (f"decode_stream_ratio_{base}_b{b}", f"decode_host_ratio_{base}_b{b}"):
                    assert float(kv[key]) > 0, key
                assert kv[f"decode_winner_{base}_b{b}"] in ("stream", "host")
    # contiguous pages coalesce into one copy per window; shuffled ones cannot
    assert float(kv["copies_per_window_8K_contiguous"]) == 1.0
    assert float(kv["copies_per_window_8K_shuffled"]) > 1.0
    assert "prefill_copy_only_s_2K_contiguous" in kv and "prefill_attn_only_s_2K_contiguous" in kv
    assert kv["gather"] == "torch"  # scattered pages gathered (on a GPU: "triton", ours)
    # the StreamingConnector's own path (windowed/packed attention over Transfer), timed beside
    for ctx in ("2K", "8K"):
        for order in ("contiguous", "shuffled"):
            assert float(kv[f"prefill_connector_ratio_{ctx}_{order}"]) > 0
            for b in (1, 4):
                assert float(kv[f"decode_connector_ratio_{ctx}_{order}_b{b}"]) > 0


def test_the_cost_model_is_printed_and_compared(tiny_run):
    """Issue 32 point 8: predicted prefill and decode step at 128K / 1M / 4M tokens from the
    measured bandwidth and attention throughput, and each measured size against its prediction."""
    kv = dict(item.split("=", 1) for item in
              tiny_run.stdout.strip().splitlines()[-1][len("RESULT "):].split())
    assert float(kv["attn_tflops"]) > 0 and float(kv["decode_window_ms"]) > 0
    for lab in ("128K", "1M", "4M"):
        assert float(kv[f"model_prefill_s_{lab}"]) > 0 and float(kv[f"model_decode_s_{lab}"]) > 0
        assert float(kv[f"model_prefill_ratio_{lab}"]) >= 1.0  # never below the copy floor
    assert float(kv["model_prefill_s_4M"]) > float(kv["model_prefill_s_1M"])
    for key in ("prefill_vs_model_8K_contiguous", "decode_vs_model_8K_contiguous_b1"):
        assert float(kv[key]) > 0, key
    assert "predicted at 1M: prefill" in tiny_run.stdout


def test_cost_model_formula():
    """Copy-bound below the balance point, attention-bound above it (overlapped: the max)."""
    sys.path.insert(0, str(REPO / "bench"))
    import torch

    import streaming_gpu as sg

    geo = sg.Geometry(12, 40, 8, 128, 32, torch.bfloat16)  # 48 KiB of KV per token (12 layers)
    w = 50e9
    m = sg.cost_model(geo, w, prefill_flops=350e12, decode_window_s=1e-5, window_tokens=1 << 15,
                      prefill_tokens=2048, recent_tokens=4096, contexts=(("1M", 1 << 20),))["1M"]
    assert abs(m["prefill_copy_s"] - 12 * (1 << 20) * 4096 / w) < 1e-9
    assert abs(m["prefill_attn_s"] - 12 * 4 * 2048 * 40 * 128 * (1 << 20) / 350e12) < 1e-9
    assert m["prefill_s"] == max(m["prefill_copy_s"], m["prefill_attn_s"])
    assert 1.4 < m["prefill_ratio"] < 1.6  # the ~1.5 of docs/streaming.md's cost model
    assert m["decode_s"] == m["decode_copy_s"]  # decode is copy-bound
    short = sg.cost_model(geo, w, 350e12, 1e-5, 1 << 15, 64, 4096, (("1M", 1 << 20),))["1M"]
    assert short["prefill_ratio"] == 1.0  # few new tokens: the copy alone


def test_help_works_without_cuda():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and "--decode" in proc.stdout and "--window-mib" in proc.stdout


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("streaming_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_the_bench_attends_windows_with_the_connectors_code(monkeypatch):
    """Issue 32, point 1 (as far as it goes): the bench's window attention (a partial over a
    window, no mask) is the connector's `windowed.WindowQuery`, not a copy of it; the control:
    the bench's result follows a change made to the connector's class."""
    import torch

    from kvstack.streaming import windowed

    mod = _bench_module()
    assert mod.WindowQuery is windowed.WindowQuery
    geo = mod.Geometry(layers=1, hq=4, hkv=2, d=16, page=16, dtype=torch.float32)
    attn = mod.Attention(torch.device("cpu"), geo, "cpu_flash")
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    out, lse = attn(q, k, v, [0, 3], [0, 40], False)
    ref_out, ref_lse = windowed.attend_reference(q, k, v, geo.scale)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    real = windowed.WindowQuery.attend
    monkeypatch.setattr(windowed.WindowQuery, "attend",
                        lambda self, k, v: tuple(x + 1 for x in real(self, k, v)))
    out2, _ = attn(q, k, v, [0, 3], [0, 40], False)
    assert torch.allclose(out2, out + 1)


def test_the_bench_picks_and_calls_the_connectors_varlen_kernel(monkeypatch):
    """The bench's one-call-per-window kernel is the connector's (packed.varlen, picked by
    packed.varlen_usable, the check packed windows make), not a copy: with a stand-in for
    FlashAttention (per request the CPU window kernel) the bench's batch result equals per-request
    attention; the control: where the connector's check refuses the kernel, neither is used."""
    import torch

    from kvstack.streaming import packed

    mod = _bench_module()
    assert mod.varlen is packed.varlen and mod.varlen_usable is packed.varlen_usable
    geo = mod.Geometry(layers=1, hq=4, hkv=2, d=16, page=16, dtype=torch.float32)
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 4, 16), torch.randn(100, 2, 16), torch.randn(100, 2, 16)
    per_request = mod.Attention(torch.device("cpu"), geo, "cpu_flash")
    ref = per_request(q, k, v, [0, 3, 4], [0, 70, 100], False)

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
        """Per request the CPU kernel; an empty key range gives lse +inf as FlashAttention
        writes it (torch's CPU kernel would stop the process over zero keys: SIGFPE)."""
        assert not causal and cu_q.dtype == torch.int32
        cq, ck = cu_q.tolist(), cu_k.tolist()
        calls.append((cq, ck))
        outs, lses = [], []
        for i in range(len(cq) - 1):
            if ck[i + 1] == ck[i]:
                outs.append(torch.zeros(cq[i + 1] - cq[i], q.shape[1], v.shape[-1]))
                lses.append(torch.full((q.shape[1], cq[i + 1] - cq[i]), float("inf")))
            else:
                o, lse = per_request(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                                     [0, cq[i + 1] - cq[i]], [0, ck[i + 1] - ck[i]], False)
                outs.append(o.float()), lses.append(lse)
        return torch.cat(outs), torch.cat(lses, 1)

    calls: list = []
    monkeypatch.setattr(packed, "_VARLEN_OK", {})
    monkeypatch.setattr(packed, "varlen", stand_in)
    monkeypatch.setattr(mod, "varlen", stand_in)  # what `from ... import varlen` bound
    attn, note = mod.pick_cuda_attention(torch.device("cpu"), geo, 1e-3)
    assert attn.impl == "flash_varlen" and "packed.varlen" in note
    calls.clear()
    out, lse = attn(q, k, v, [0, 3, 4], [0, 70, 100], False)
    assert calls == [([0, 3, 4], [0, 70, 100])]  # one call for both requests
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(lse, ref[1])
    # control: the connector's check refuses the kernel -> the bench does not use it either
    monkeypatch.setattr(mod, "varlen_usable", lambda *a: False)
    calls.clear()
    try:  # per-request SDPA flash, where torch runs it on this device
        impl = mod.pick_cuda_attention(torch.device("cpu"), geo, 1e-3)[0].impl
    except SystemExit:
        impl = None
    assert impl in (None, "sdpa_flash") and calls == []


def test_the_benchs_pools_are_the_connectors_arenas(monkeypatch):
    """The bench's host tier allocates each pool as the connector's host tier does
    (pinned.HostArena: page-aligned, registered, exactly its size; tests/env/streaming/
    test_pinned.py pins the arena itself): pinned where asked (here through a fallback that
    records the call, there being no CUDA), plain otherwise, the pools filled either way."""
    import torch

    from kvstack.streaming import pinned

    mod = _bench_module()
    assert mod.HostArena is pinned.HostArena
    assert not hasattr(mod, "_page_aligned_empty") and not hasattr(mod, "_unregister")
    geo = mod.Geometry(layers=2, hq=4, hkv=2, d=16, page=16, dtype=torch.bfloat16)
    plain = mod.HostTier(geo, 8, pin=False, fill_seed=1)
    assert plain.pin_method == "none" and len(plain._arenas) == 4
    made = []
    monkeypatch.setattr(pinned, "torch_pinned",
                        lambda n, dtype, zero=False: made.append(n) or torch.empty(n, dtype=dtype))
    tier = mod.HostTier(geo, 8, pin=True, fill_seed=1)
    assert made == [8 * 16 * 2 * 16] * 4 and tier.pin_method == "pin_memory=True"
    assert tier.pin_error.startswith("cudaHostRegister")  # no CUDA runtime here: said why
    for a, b in zip(tier.k + tier.v, plain.k + plain.v):
        assert torch.equal(a, b)  # the same random fill


def test_the_bench_gathers_scattered_windows_with_the_connectors_gather(monkeypatch):
    """A window of many runs (shuffled pages) is loaded by one `gather.copy_rows_kv` (the
    connector's, which the connector's Transfer uses too) into the same staging rows as one copy
    per run; windows of fewer runs than `min_runs` are copied run by run. Control: a gather that
    drops its last run leaves other rows in the buffer."""
    import torch

    from kvstack.streaming import gather

    mod = _bench_module()
    assert mod.gather is gather
    geo = mod.Geometry(layers=1, hq=4, hkv=2, d=16, page=4, dtype=torch.bfloat16)
    tier = mod.HostTier(geo, 64, pin=False, fill_seed=3)
    dev = torch.device("cpu")
    pages = [mod.page_table(40, 64, "shuffled", 5), mod.page_table(10, 64, "contiguous", 0)]
    batch = mod.Batch(geo, tier, dev, pages, [160, 40], [1, 1], 0, 64, 0)
    assert any(len(w.copies) >= 8 for w in batch.windows)

    def staged(streamer):
        out = []
        for w in batch.windows:
            streamer.issue(0, tier, 0, w)
            out.append((streamer.sk[0][:w.total].clone(), streamer.sv[0][:w.total].clone()))
        return out

    by_run = mod.Streamer(geo, dev, 64)
    want = staged(by_run)
    gathered = mod.Streamer(geo, dev, 64, "torch")
    got = staged(gathered)
    many = sum(len(w.copies) >= gather.MIN_RUNS for w in batch.windows)
    assert gathered.gathers_issued == many > 0 and by_run.gathers_issued == 0
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    real = gather.copy_rows_kv
    monkeypatch.setattr(gather, "copy_rows_kv",
                        lambda kd, vd, ks, vs, index, kernel="torch": real(
                            kd, vd, ks, vs, index[:, :-1].contiguous(), kernel))
    for w in batch.windows:
        w.meta["gather_index"] = gather.run_rows(w.copies) if len(w.copies) > 1 else None
    kd = staged(mod.Streamer(geo, dev, 64, "torch"))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(kd, want))


def test_the_benchs_connector_variant_runs_the_connectors_functions():
    """`--decode connector` times the StreamingConnector's own windowed path: the bench's
    step_connector calls the connector's functions themselves (their exactness against the
    bench's reference, with the sharp-key control, is in the tiny run's "exactness ... connector"
    lines, test_exactness_and_negative_control)."""
    from kvstack.streaming import packed, transfer, windowed

    mod = _bench_module()
    assert mod.windowed_attention is windowed.windowed_attention
    assert mod.packed_attention is packed.packed_attention and mod.StepPlan is packed.StepPlan
    assert mod.Transfer is transfer.Transfer and mod.PagedHistory is transfer.PagedHistory


def test_window_plan_covers_each_history_once():
    """The page-table-driven copy plan: every streamed token copied exactly once, runs of
    consecutive pool pages coalesced, windows never over budget, requests contiguous per window."""
    mod = _bench_module()
    page, window = 32, 5 * 32
    pool = 300
    hist = [(mod.page_table(90, pool, "shuffled", 1), 0, 2500),
            (mod.page_table(100, pool, "contiguous", 0, rotate=250), 0, 3100),
            (mod.page_table(3, pool, "contiguous", 0), 0, 70)]
    assert mod.token_runs(hist[1][0], page, 0, 3100) == [(250 * 32, 50 * 32), (0, 3100 - 1600)]
    windows = mod.plan_windows(hist, page, window)
    seen = {r: [] for r in range(3)}
    for w in windows:
        assert 0 < w.total <= window and sum(w.k_lens) == w.total
        assert sorted(w.reqs) == w.reqs and len(set(w.reqs)) == len(w.reqs)
        dst = 0
        for (src, d, n) in w.copies:
            assert d == dst
            dst += n
        pos = 0
        for r, n in zip(w.reqs, w.k_lens):
            for (src, d, m) in w.copies:
                if pos <= d < pos + n:
                    seen[r].extend(range(src, src + m))
            pos += n
    for r, (pages, start, end) in enumerate(hist):
        want = [pages[t // page] * page + t % page for t in range(start, end)]
        assert seen[r] == want
