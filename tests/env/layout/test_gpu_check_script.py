"""ci/gpu/check_layout.py, the GPU check of the layout ladder, run here on the CPU engine
(`--backends CPU`): tiny Llama, Llama-4 and Qwen3-Next (hybrid: its GDN state goes through the
3/N `bind_kv_cache`) give identical greedy tokens with the layout ladder and without it. The
kvstack venv has the whole series applied, so the unpatched side is the overlay (the ladder
taken out again) and its modules are really imported; a ladder that neither comes out of nor
applies to the installed vLLM is refused with exit 2 before any engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.env

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "ci" / "gpu" / "check_layout.py"


def test_patched_equals_unpatched_on_the_cpu_engine(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--backends", "CPU", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT 3/3 identical"), res.stdout
    assert "installed vLLM has the ladder" in lines[0], lines[0]
    assert "12 patch(es)" in lines[0], lines[0]
    for model in ("llama", "llama4", "qwen3next"):
        unpatched = json.loads((tmp_path / f"CPU-{model}-unpatched.json").read_text())
        assert unpatched["overlaid_modules"], f"{model}: the unpatched run imported no overlay"
        patched = json.loads((tmp_path / f"CPU-{model}-patched.json").read_text())
        assert patched["overlaid_modules"] == []
    # the hybrid model's unpatched run binds its Mamba/GDN state through 0.25.1's worker code
    qwen = json.loads((tmp_path / "CPU-qwen3next-unpatched.json").read_text())["overlaid_modules"]
    assert any(m.startswith("vllm.v1.worker") for m in qwen), qwen


def _run_on_series(tmp_path, patch_text: str):
    bad = tmp_path / "series-dir"
    bad.mkdir()
    (bad / "0001-bad.patch").write_text(patch_text)
    (bad / "series").write_text("0001-bad.patch\n")
    res = subprocess.run([sys.executable, str(SCRIPT), "--backends", "CPU", "--series-dir", str(bad),
                          "--work", str(tmp_path / "work")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert not list((tmp_path / "work").glob("*.json"))  # no engine was started
    return res.stderr


def test_ladder_that_neither_applies_nor_reverses_is_refused(tmp_path):
    err = _run_on_series(tmp_path, "Subject: bad\n\nKvstack-Issue: 3\n---\n"
                         "--- a/vllm/envs.py\n+++ b/vllm/envs.py\n@@ -1,1 +1,1 @@\n"
                         "-this line is not there\n+x\n")
    assert "neither comes out of nor applies" in err
    assert "0001-bad.patch cannot be reversed" in err and "0001-bad.patch does not apply" in err


def test_series_without_a_ladder_is_refused(tmp_path):
    err = _run_on_series(tmp_path, "Subject: other\n\nKvstack-Issue: 4\n---\n"
                         "--- a/vllm/envs.py\n+++ b/vllm/envs.py\n@@ -1,1 +1,1 @@\n-a\n+b\n")
    assert "no patch in" in err and "Kvstack-Issue: 3" in err


def test_runs_side_by_side_with_jobs(tmp_path):
    """--jobs 2 (as ci/gpu/run_checks.sh runs it with 6 on a GPU): the pair's two runs at once,
    each in its own process, with the same verdict and the overlay still imported."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--backends", "CPU", "--models", "llama",
                          "--jobs", "2", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1].startswith("RESULT 1/1 identical"), res.stdout
    unpatched = json.loads((tmp_path / "CPU-llama-unpatched.json").read_text())
    assert unpatched["overlaid_modules"]
