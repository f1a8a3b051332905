"""Smoke test of bench/hybrid_repeat.py at tiny sizes on the current base.

Runs the real bench (real engines, a real lmcache_server and LMCache MP server on 127.0.0.1) and
checks only what does not depend on timing: every route that ran gave the recompute run's tokens,
and the RESULT line carries every figure (a number, or n/a with the reason printed above it).
Route 3 (in-process LMCache, a new engine process B whose only source is the lmcache_server; the
hybrid state lives in LMCache's storage, no state directory) must run, hit and give the recompute
run's tokens, and the HEADLINE line states it against recompute. The bench's model has a long-memory
state (kvstack.testbed.long_memory), and route 3's negative control (engine B serves the repeat again
with the restored states zeroed: as many tokens cached, other tokens) must hold.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench" / "hybrid_repeat.py"
KEYS = ("vllm_cache", "lmcache_inproc", "lmcache_mp", "lmcache_plus_vllm")


def test_bench_hybrid_repeat_small(tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # 544 = two 256-token steps + 32: the repeat restores 512 and computes 32 tokens, where the
    # restored state still decides them (route 3's control)
    res = subprocess.run([sys.executable, str(BENCH), "--prompt-tokens", "544", "--hidden", "128",
                          "--layers", "4", "--step", "256", "--chunk", "256", "--flush-s", "2", "--engine-timeout", "240",
                          "--model-root", str(tmp_path / "models")],
                         capture_output=True, text=True, env=env, timeout=600)
    out = res.stdout
    if re.search(rf"^recompute +n/a \(engine recompute exited -{int(signal.SIGILL)}\b", out, re.M):
        pytest.skip("vLLM cannot run Qwen3-Next on this host at all: the no-cache engine dies with SIGILL "
                    "(vLLM 0.25.1's AMX GDN kernel on an AMX CPU, see test_mp_route.py)")
    assert res.returncode == 0, f"bench failed ({res.returncode}):\n{out[-4000:]}\n{res.stderr[-4000:]}"
    result = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert result, out
    fields = dict(f.split("=", 1) for f in result[-1].split()[1:])
    assert re.fullmatch(r"\d+\.\d+", fields["recompute_s"]), result
    for key in KEYS:
        assert key in fields, (key, result)
        value = fields[key]
        if value == "n/a":  # the reason is on the route's own line
            name = {"vllm_cache": "vllm-cache", "lmcache_inproc": "lmcache-inproc",
                    "lmcache_mp": "lmcache-mp", "lmcache_plus_vllm": "lmcache+vllm"}[key]
            assert re.search(rf"^{re.escape(name)}:? +n/a \(.+\)", out, re.M), (name, out)
        else:
            assert re.fullmatch(r"\d+\.\d+x\(equal,cached=\d+\)", value), (key, value)
    assert "DIFFER" not in out
    # vLLM's own hybrid prefix cache runs on the CPU engine and hits.
    assert fields["vllm_cache"] != "n/a", out
    assert int(re.search(r"cached=(\d+)", fields["vllm_cache"]).group(1)) > 0
    # Route 3: engine B is served by the lmcache_server alone (K/V and hybrid state), same tokens.
    assert fields["lmcache_inproc"] != "n/a", out
    assert int(re.search(r"cached=(\d+)", fields["lmcache_inproc"]).group(1)) > 0, out
    # Base 0.32: the adapter serves vLLM's align mode, so LMCache and vLLM's own cache run in one
    # engine (route 5; on base 0.25 the adapter refuses align mode at start-up: n/a).
    from importlib.metadata import version

    if not version("lmcache").startswith("0.5.3"):
        assert fields["lmcache_plus_vllm"] != "n/a", out
        assert re.fullmatch(r"\d+\.\d+x", fields["lmcache_plus_vllm_vs_vllm_cache"]), result
    assert fields["lmcache_inproc_control"] == "held", out
    assert re.search(r"^HEADLINE .*route 3\): \d+\.\d+ s vs recompute \d+\.\d+ s = \d+\.\d+x, "
                     r"[1-9]\d* tokens cached, tokens equal, zeroed-state control held$", out, re.M), out
