"""An engine whose first step has only a few tokens serves on an AMX CPU (kvstack's vLLM patch
"cpu_worker: ask for AMX tile permission at start-up", 0.32 0012 / 0.25 0022; issue 26).

AMX tile instructions need the process's permission (Linux's arch_prctl ARCH_REQ_XCOMP_PERM).
oneDNN asks for it when its first AMX matmul runs; vLLM's CPU attention kernel does not. Before
the patch, a fresh engine (bf16, 32-token blocks: the AMX attention kernel) whose first step was a
1- or 4-token prompt died with SIGILL, as did a second `vllm serve` whose first request loaded 96
of 100 tokens from LMCache (tests/env/server/test_cross_engine_server.py, on an AMX host).

Each case is a fresh process (tests/env/amx_first_step_run.py). The control takes the permission
request away (torch.cpu._init_amx made a no-op): on an AMX CPU that engine must die with SIGILL,
or the first case could not fail here. On a CPU without AMX the control is skipped and the first
case shows only that the patch changes nothing there. Default base only (CI time; the patch is
the same line on both bases)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import default_base_only

pytest.importorskip("vllm")

from kvstack.testbed import tiny_models  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.env,
              default_base_only("the AMX tile permission patch is the same line on both bases "
                                "(0.32 0012 / 0.25 0022)")]


def _amx() -> bool:
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_models.make_model("llama", tmp_path_factory.mktemp("amx") / "llama")


def _run(model, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(HERE / "amx_first_step_run.py"), "--model-dir",
                           str(model), *extra], capture_output=True, text=True, env=env,
                          timeout=600)


def test_a_one_token_first_step_serves(model):
    res = _run(model, "--tokens", "1")
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert line and len(json.loads(line[-1][7:])) == 4


@pytest.mark.skipif(not _amx(), reason="no AMX on this CPU: nothing to take away")
def test_control_without_the_permission_dies_with_sigill(model):
    res = _run(model, "--tokens", "1", "--no-amx-permission")
    assert res.returncode == -signal.SIGILL, (res.returncode, res.stdout[-500:], res.stderr[-1500:])
