"""bench/streaming.py, the streaming benchmark of docs/streaming-usage.md, run end to end at
small sizes: every section (offline TTFT and TPOT, `vllm serve` + `vllm bench serve`, device KV and the largest
context at a fixed budget, prefix reuse) runs, prints its figure lines, and the last line carries
them all. The ratios are not judged here (timings belong to the bench, not to tests); what is
judged is what does not depend on timing: greedy tokens equal to native, flat device KV, and the
context served beyond what native vLLM admits at the same budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streaming_helpers import needs_hooks

pytestmark = [pytest.mark.env, pytest.mark.slow, needs_hooks]

REPO = Path(__file__).resolve().parents[3]
SMALL = ["--rounds", "1", "--reps", "1", "--ttft-context", "1500", "--ttft-batched-tokens", "512",
         "--tpot-context", "1200", "--tpot-tokens", "4", "--tpot-requests", "2", "--serve-prompts", "4",
         "--serve-lens", "600", "--serve-rounds", "1", "--max-multiple", "4",
         "--reuse-prefix", "512", "--window-tokens", "256"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # the file-backed host tier of docs/streaming-usage.md
    tier = tmp_path_factory.mktemp("bench") / "tier.bin"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "streaming.py"), *SMALL,
                          "--host-tier-path", str(tier)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_every_section_prints_its_figures_and_the_result_line(run):
    lines = run.strip().splitlines()
    for tag in ("(1) TTFT", "(2) TPOT", "(3) serving", "(4) peak device KV", "(5) device KV budget",
                "(6) prefix reuse"):
        assert any(line.startswith(tag) for line in lines), (tag, run)
    assert lines[-1].startswith("RESULT ")
    kv = dict(item.split("=", 1) for item in lines[-1][len("RESULT "):].split())
    for key in ("ttft_24k", "ttft_24k_windowed", "tpot_8k", "serve_600_reqps", "device_kv_kib",
                "max_context_ratio", "prefix_reuse_speedup"):
        assert key in kv and "FAILED" not in kv[key], (key, lines[-1])


def test_what_does_not_depend_on_timing(run):
    kv = dict(item.split("=", 1) for item in run.strip().splitlines()[-1][len("RESULT "):].split())
    assert kv["ttft_tokens"] == "equal" and kv["tpot_tokens"] == "equal"
    # the windowed variant at --window-tokens 256: the history in several windows
    assert kv["ttft_24k_windows"] == "4x256" and kv["tpot_8k_windows"] == "5x256"
    assert kv["device_kv_flat"] == "1.00"
    assert int(kv["kvstack_served"]) > int(kv["native_max_len"])
    assert any(line.startswith("(5)") and "tier.bin" in line for line in run.splitlines())


def test_tpot_control_runs_every_engine_native():
    """`--tpot-control` (the TPOT estimator's A/A run, docs/streaming.md): the three engines are
    native vLLM, the result line says so, and their greedy tokens agree."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "streaming.py"), "--only", "tpot",
                          "--tpot-control", "--tpot-context", "600", "--tpot-tokens", "4",
                          "--tpot-requests", "2", "--ttft-batched-tokens", "512"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    kv = dict(item.split("=", 1) for item in last[len("RESULT "):].split())
    assert kv["tpot_control"] == "native_vs_native" and kv["tpot_tokens"] == "equal", last
    assert "every engine is native vLLM" in res.stderr
    # the third engine's line names what it ran, not the windowed path it stands in for
    assert "TPOT the third engine, native under --tpot-control" in res.stdout, res.stdout
    assert "cpu_native_attention false" not in res.stdout, res.stdout
