"""Sliding-window and full layers in one KV cache group give the same tokens every time on CPUs
without AMX (kvstack's vLLM patch "cpu_attn: a KV cache group with mixed sliding windows attends
without splitting the KV", 0.32 0013; issue 27).

With the hybrid KV cache manager off (vLLM turns it off for LMCacheConnectorV1), gpt-oss keeps its
sliding-window and full-attention layers in one group; vLLM 0.32.0's CPU attention built that
group's split-KV schedule without a window while each layer attended with its own, and read
splits the window left unwritten: on the non-AMX kernel with more than one OpenMP thread (one
thread never splits) the decode tokens changed from run to run, or were wrong every time.
Each case is a fresh process (tests/env/cpu_attn_mixed_windows_run.py) on the non-AMX kernel
whatever the host has. The reference is the same model with the hybrid manager on (one group per
window); the control undoes the patch and must give other tokens in at least one of its six runs
(one prompt alone, then a short and a long one together: the long one's first split, outside the
window, then follows the short one's work on its thread and reads that work's output), or the
first case could not fail. The runner's engine has two OpenMP threads on all the machine's cores
(a CI worker keeps to one core, where one thread could take every task). Default base only (the patch is base 0.32's: vLLM 0.25.1
cannot run such a model with the hybrid manager off at all)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import on_default_base

pytest.importorskip("vllm")

from kvstack.testbed import tiny_models  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.env,
              pytest.mark.skipif(not on_default_base(), reason="default base only (base 0.32's patch)")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_models.make_model("gpt_oss", tmp_path_factory.mktemp("mixed") / "gpt_oss")


def _runs(model, *extra) -> list[list[list[int]]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(HERE / "cpu_attn_mixed_windows_run.py"),
                          "--model-dir", str(model), *extra], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    threads = [ln for ln in res.stdout.splitlines() if ln.startswith("THREADS ")]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RUNS ")]
    assert line and threads, res.stdout[-2000:]
    # one OpenMP thread never splits the KV: neither case could then fail
    env = [ln for ln in res.stdout.splitlines() if ln.startswith("ENV ")]
    assert threads[-1] == "THREADS 2", (threads, env)
    return json.loads(line[-1][5:])


@pytest.fixture(scope="module")
def reference(model):
    runs = _runs(model, "--hma", "on")
    assert runs[0] == runs[1] == runs[2] and runs[3] == runs[4] == runs[5], runs
    return runs


def test_one_group_gives_the_tokens_of_one_group_per_window(model, reference):
    assert _runs(model, "--hma", "off") == reference


def test_control_the_split_kept_changes_the_tokens(model, reference):
    runs = _runs(model, "--hma", "off", "--split-mixed")
    assert runs != reference, runs
