"""ci/gpu/first_run.sh (issue 32 point 10): a lent GPU's first job in one command. CI has no GPU: it
runs `--dry-run`, the session's plan (every `run` call, its carry against the tool's limit, the
expected device time), and the plan's own checks; the CPU variants of the steps are tests of their
own (test_streaming_gpu_bench.py, tests/env/layout/test_gpu_check_script.py,
tests/env/streaming/test_gpu_check_streaming_script.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "gpu" / "first_run.sh"
CARRY = REPO / "ci" / "gpu" / "carry.py"


def run(*args, **kw):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, **kw)


def test_usage():
    res = run("--help")
    assert res.returncode == 0 and "--dry-run" in res.stdout and "Exit status" in res.stdout
    assert run("--frobnicate").returncode == 2
    res = run("--cpu")
    assert res.returncode == 2 and "--cpu goes with --dry-run" in res.stderr


def test_dry_run_states_the_device_time_it_needs(tmp_path):
    res = run("--dry-run", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    calls = re.findall(r"^  call (\d+): (.*)$", out, re.M)
    assert calls and calls[-1][1].startswith("bash ci/gpu/first_run.sh")
    assert all("carry.py unpack" in c for _, c in calls[:-1])
    m = re.search(r"^DEVICE TIME expected (\d+) s \(([\d.]+) min\) of the 10-minute target", out, re.M)
    assert m and int(m.group(1)) <= 600, out
    # the floor bench's arguments parse with the bench's own parser
    args = re.search(r"\[python3 bench/streaming_gpu\.py (.*?)\]", out).group(1).split()
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("streaming_gpu", REPO / "bench" / "streaming_gpu.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        parsed = mod.parse_args(args)
        assert parsed.contexts == "128K,1M" and parsed.decode_batch == "1"
        assert "connector" in parsed.decode.split(",")  # the connector's own path on the GPU
        # call 8's bench over scattered pages, where windows are gathered (gather.py)
        call8 = re.search(r"^  call \d+ \(right after.*timeout 90 python3 bench/streaming_gpu\.py "
                          r"(.*?) > \$OUT/floor-bench-shuffled\.log", out, re.M).group(1).split()
        parsed = mod.parse_args(call8)
        assert parsed.page_order == "shuffled" and parsed.gather == "auto"
    finally:
        sys.modules.pop("streaming_gpu", None)
        sys.path.remove(str(REPO / "bench"))


def _manifest(folder: Path, sizes: list[int]) -> None:
    pieces = [{"folder": f"{i:03d}", "size": s} for i, s in enumerate(sizes)]
    m = {"version": 1, "id": "test", "base": "0.25", "folders": [f"{i:03d}" for i in range(len(sizes))],
         "files": [{"name": "x.whl", "size": sum(sizes), "pieces": pieces}]}
    (folder / "000").mkdir(parents=True)
    (folder / "000" / "manifest.json").write_text(json.dumps(m))


def test_plan_refuses_a_call_over_the_limit_and_limits_over_a_call(tmp_path):
    ok = tmp_path / "ok"
    _manifest(ok, [40 * 2**20, 30 * 2**20])
    res = subprocess.run([sys.executable, str(CARRY), "plan", "--out", str(ok)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0 and "2 folders" in res.stdout and "OVER" not in res.stdout, res.stdout
    big = tmp_path / "big"
    _manifest(big, [63 * 2**20])
    res = subprocess.run([sys.executable, str(CARRY), "plan", "--out", str(big)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 1 and "OVER THE LIMIT" in res.stdout
    res = subprocess.run([sys.executable, str(CARRY), "plan", "--out", str(ok), "--streaming-s", "500"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 1 and "over one call's 600 s" in res.stdout
