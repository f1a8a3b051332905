"""ci/gpu/check_layout.py, the GPU check of the layout ladder, run here on the CPU engine
(`--backends CPU`): tiny Llama, Llama-4 and Qwen3-Next (hybrid: its GDN state goes through the
3/N `bind_kv_cache`) give identical greedy tokens with the pending layout patches overlaid and
without them; the overlaid modules are really imported; a series that does not apply is
refused with exit 2 before any engine starts."""

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
    for model in ("llama", "llama4", "qwen3next"):
        patched = json.loads((tmp_path / f"CPU-{model}-patched.json").read_text())
        assert patched["overlaid_modules"], f"{model}: the patched run imported no overlaid module"
        unpatched = json.loads((tmp_path / f"CPU-{model}-unpatched.json").read_text())
        assert unpatched["overlaid_modules"] == []
    # the hybrid model binds its Mamba/GDN state through the overlaid 3/N code
    qwen = json.loads((tmp_path / "CPU-qwen3next-patched.json").read_text())["overlaid_modules"]
    assert any(m.startswith("vllm.v1.worker") for m in qwen), qwen


def test_series_that_does_not_apply_is_refused(tmp_path):
    bad = tmp_path / "series-dir"
    bad.mkdir()
    (bad / "0001-bad.patch").write_text(
        "--- a/vllm/envs.py\n+++ b/vllm/envs.py\n@@ -1,1 +1,1 @@\n-this line is not there\n+x\n")
    (bad / "series").write_text("0001-bad.patch\n")
    res = subprocess.run([sys.executable, str(SCRIPT), "--backends", "CPU", "--series-dir", str(bad),
                          "--work", str(tmp_path / "work")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2
    assert "0001-bad.patch does not apply" in res.stderr
    assert not list((tmp_path / "work").glob("*.json"))  # no engine was started
