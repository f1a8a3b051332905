"""A request aborted between its LMCache lookup and its load releases what the lookup took (LMCache
patch "a finished request releases its lookup's pins and held state", issue 29 point 3).

The lookup pins the chunks it found (so they stay until the load) and, for a hybrid model, holds the
fetched and checked state for the load. A request that is aborted while it waits for KV blocks never
loads; stock LMCache kept its pins (those chunks could never be evicted again) and its held state
(until the holding budget pushed it out). abort_held_run.py makes such a request (B waits behind C,
which keeps the blocks), aborts it, and reads the worker's pins and held states: after the abort's
step nothing is left, and C completes. The control runs the same with the step's finished requests
kept from the worker (what LMCache did before the patch): B's pins and state stay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
C_TOKENS = 120


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvstack.testbed.tiny_models import make_model

    root = tmp_path_factory.mktemp("abort-models")
    return lambda name: make_model(name, root / name)


def run(model_dir: Path, model: str, *extra: str) -> dict:
    res = subprocess.run([sys.executable, str(HERE / "abort_held_run.py"), "--model", model,
                          "--model-dir", str(model_dir), "--c-tokens", str(C_TOKENS), *extra],
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@@JSON ")), None)
    assert line, (res.stdout + res.stderr)[-4000:]
    out = json.loads(line[len("@@JSON "):])
    # the setup: B was looked up (pinned, and for the hybrid model its state held) and then waited
    assert out["waiting_after_lookup"], out
    assert out["after_lookup"]["pinned_lookups"] == 1, out
    assert out["c_tokens"] is not None and len(out["c_tokens"]) == C_TOKENS, out
    return out


# the hybrid model's block size is vLLM's (mamba page alignment): 8 blocks leave C its run and B none
CASES = {"qwen3next": ("--blocks", "8"), "llama": ()}


@pytest.mark.parametrize("model", list(CASES))
def test_aborted_request_releases_its_pins_and_held_state(models, model):
    out = run(models(model), model, *CASES[model])
    if model == "qwen3next":
        assert out["after_lookup"]["held_requests"] == 1, out
        assert out["after_abort"]["held_requests"] == 0 and out["after_abort"]["held_bytes"] == 0, out
    assert out["after_abort"]["pinned_lookups"] == 0, out
    assert out["end"]["pinned_lookups"] == 0, out


def test_control_without_the_finished_requests_they_stay(models):
    out = run(models("qwen3next"), "qwen3next", *CASES["qwen3next"], "--control")
    assert out["end"]["pinned_lookups"] == 1, out
    assert out["end"]["held_requests"] == 1 and out["end"]["held_bytes"] > 0, out
