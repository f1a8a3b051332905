"""ci/gpu/check_scratch.py (issue 28, point 4): its verdicts, judged here from the three engines'
figures recorded on one H200 (ci/gpu/results/h200-2026-11-27/scratch-*.json), and mutations of
them that each verdict must catch. The engines themselves need a GPU (the CPU worker neither
profiles memory nor reserves a scratch); tests/env/streaming/test_scratch.py checks the plan and
the patched worker on the CPU."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "ci" / "gpu" / "results" / "h200-2026-11-27"
SCRIPT = REPO / "ci" / "gpu" / "check_scratch.py"
MIB = 1 << 20


def _sides():
    return [json.loads((RESULTS / f"scratch-{s}.json").read_text())
            for s in ("native", "streaming", "control")]


def _judge(tmp_path, sides):
    paths = []
    for name, side in zip(("native", "streaming", "control"), sides):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(side))
        paths.append(str(p))
    return subprocess.run([sys.executable, str(SCRIPT), "--judge", *paths], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_the_recorded_h200_run_holds(tmp_path):
    res = _judge(tmp_path, _sides())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("RESULT 4/4 hold")


def _shrink_unreserved(sides):  # the streaming engine reported no less than native
    sides[1]["kv_cache_memory"] = sides[0]["kv_cache_memory"]


def _control_ignored(sides):  # device_scratch_mib had no effect
    sides[2]["kv_cache_memory"] = sides[1]["kv_cache_memory"]


def _staging_unplanned(sides):  # transfer.py allocated more than the plan counts
    sides[1]["staged"] += 4096


def _peak_over(sides):  # the windowed path's peak outgrew the plan
    p = sides[1]["plan"]
    sides[1]["peak"] = p["attention"] + p["reference"] + MIB


def _no_probe(sides):  # the probe never ran (no windowed call measured)
    sides[1]["peak"] = 0


@pytest.mark.parametrize("mutate,verdict", [
    (_shrink_unreserved, "reserved"), (_control_ignored, "control"),
    (_staging_unplanned, "staging"), (_peak_over, "peak"), (_no_probe, "peak")])
def test_each_verdict_can_fail(tmp_path, mutate, verdict):
    sides = copy.deepcopy(_sides())
    mutate(sides)
    res = _judge(tmp_path, sides)
    assert res.returncode == 1
    assert f"{verdict:9s} FAILS" in res.stdout and f"failing: {verdict}" in res.stdout, res.stdout
