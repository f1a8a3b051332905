"""bench/overhead.py (issue 27 point 5: what kvstack's vLLM patches cost a user of neither feature,
stock vs kvstack, no connector and LMCacheConnectorV1) run end to end at the smallest sizes, one
round. The ratios are not judged here (timings belong to the bench, not to tests); what is judged
is what does not depend on timing: every engine process ran, the stock side really ran stock's
code (modules from the stock overlay), the check prompt's greedy tokens were compared and are
equal on every process, and the last line carries every figure in the documented form."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

pytestmark = [pytest.mark.env, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--runs", "1", "--prompt-tokens", "128", "--batch", "2", "--output-tokens", "8", "--hidden", "64",
         "--layers", "2", "--engine-timeout", "240"]
SPREAD = re.compile(r"^\d+\.\d\d\[\d+\.\d\d-\d+\.\d\d\]$")


def test_bench_overhead_small(tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    res = subprocess.run([sys.executable, str(REPO / "bench" / "overhead.py"), *SMALL,
                          "--model-root", str(tmp_path / "models")],
                         cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    out = res.stdout
    assert res.returncode == 0, f"bench failed ({res.returncode}):\n{out[-4000:]}\n{res.stderr[-4000:]}"
    lines = out.strip().splitlines()
    # one line per engine process: 2 configs x 2 sides; the stock ones ran the overlay's modules
    for config in ("none", "lmcache"):
        for side in ("stock", "kvstack"):
            line = next((ln for ln in lines if re.match(rf"round 1/1 {config} +{side} +TTFT ", ln)), None)
            assert line is not None, (config, side, out)
            if side == "stock":
                assert int(re.search(r"(\d+) stock modules", line).group(1)) > 0, line
    assert any(ln.startswith("tokens: equal on 4 processes") for ln in lines), out
    assert lines[-1].startswith("RESULT ")
    kv = dict(item.split("=", 1) for item in lines[-1][len("RESULT "):].split())
    for key in ("none_ttft", "none_tput", "lmcache_ttft", "lmcache_tput"):
        assert SPREAD.match(kv[key]), (key, lines[-1])
    for config in ("none", "lmcache"):
        for side in ("stock", "kvstack"):
            assert float(kv[f"{config}_{side}_ttft_s"]) > 0 and float(kv[f"{config}_{side}_tps"]) > 0
    assert kv["tokens"] == "equal"
    assert kv["runs"] == "1" and float(kv["target"]) == 0.98
    assert kv["verdict"] in ("meets", "BELOW")
    assert kv["host"]
