"""Hybrid state at the last (or every) chunk boundary of a prefill step, with vLLM's prefix caching off.

With `enable_prefix_caching=False` vLLM keeps one running state per request (mamba_cache_mode
"none") and LMCache saves a state only where a step ends on a chunk boundary. A 1,000-token
prompt under default batching runs in one step that ends at token 1,000: without the checkpoint
cut (vLLM patch "scheduler: prefill steps end on a connector's state checkpoint" + LMCache patch
"hybrid models ask for prefill steps ending on a chunk boundary") no state is saved and a later
prompt sharing those 1,000 tokens hits nothing. With it the step ends at 768, the next at 1,000,
and a new engine process serves the later prompt from 768 restored tokens, with the tokens of a
run without LMCache. Controls: the cut turned off (lmcache.hybrid_checkpoint_steps: false) hits
0; the restored state zeroed changes the tokens of a prompt sharing 780 tokens (the long-memory
Qwen3-Next forgets ~3% of its state per token: 272 tokens after the restored position, as in the
prompt sharing all 1,000, a zeroed state is forgotten too, so the control uses the shorter one).

With lmcache.hybrid_checkpoint_steps: every the steps end on every chunk boundary (256, 512, 768,
1,000): states at each, and a prompt sharing 2.5 chunks (640 tokens) hits 512 in a new engine,
exact; with the default ("last") that prompt hits nothing."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_e2e_cpu import qwen_model, run_engine, tiny  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.env

CHUNK = 256
PROMPT = [(i * 37) % 900 + 3 for i in range(1000)]
LATER = PROMPT + [5, 6, 7, 8] * 10  # shares all 1,000 tokens
NEAR = PROMPT[:780] + [9, 10, 11, 12] * 5  # shares 780: 32 tokens after the state at 768
SHARE640 = PROMPT[:640] + [13, 14, 15, 16] * 5  # shares 2.5 chunks
EVERY = ("--lmcache-extra", json.dumps({"lmcache.hybrid_checkpoint_steps": "every"}))
ARGS = ("--max-num-batched-tokens", "2048", "--max-model-len", "2048")  # one step per prompt


def _env(disk: Path) -> dict:
    return {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "False",
            "LMCACHE_LOCAL_DISK": f"file://{disk}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}


@pytest.fixture(scope="module")
def baseline(qwen_model, tmp_path_factory):
    out = run_engine(qwen_model, "qwen3next", [PROMPT, LATER, NEAR, SHARE640],
                     tmp_path_factory.mktemp("ckpt-baseline"), extra_args=ARGS)
    return out["tokens"]


def test_later_prompt_hits_the_last_boundary_in_a_new_engine(qwen_model, tmp_path, baseline):
    env = _env(tmp_path / "disk")
    a = run_engine(qwen_model, "qwen3next", [PROMPT], tmp_path, lmcache=True, env=env, extra_args=ARGS)
    assert a["saved"] == [[768]], a["saved"]  # the step was cut at 768; 1,000 is no boundary
    assert a["tokens"] == [baseline[0]]
    shutil.copytree(tmp_path / "disk", tmp_path / "disk-control")
    # SHARE640 (2.5 chunks): under the default ("last") no state below 768 was saved, so it finds
    # none it can use (the control of test_every_boundary_...)
    b = run_engine(qwen_model, "qwen3next", [LATER, NEAR, SHARE640], tmp_path, lmcache=True, env=env,
                   extra_args=ARGS)
    assert b["hits"] == [768, 768, 0] and b["restored"] == [768, 768, 0], (b["hits"], b["restored"])
    assert b["tokens"] == baseline[1:4]
    assert b["saved"][0] == [1024]  # LATER's own step from 768 was cut at the next boundary
    zeroed = run_engine(qwen_model, "qwen3next", [NEAR], tmp_path, lmcache=True,
                        env=_env(tmp_path / "disk-control"),
                        extra_args=(*ARGS, "--zero-restored-state"))
    assert zeroed["restored"] == [768]
    assert zeroed["tokens"] != [baseline[2]], "a zeroed state must change the tokens"


def test_every_boundary_a_prompt_sharing_two_and_a_half_chunks_hits_two(qwen_model, tmp_path,
                                                                         baseline):
    env = _env(tmp_path / "disk")
    a = run_engine(qwen_model, "qwen3next", [PROMPT], tmp_path, lmcache=True, env=env,
                   extra_args=(*ARGS, *EVERY))
    assert a["saved"] == [[256, 512, 768]], a["saved"]
    assert a["tokens"] == [baseline[0]]
    b = run_engine(qwen_model, "qwen3next", [SHARE640], tmp_path, lmcache=True, env=env,
                   extra_args=(*ARGS, *EVERY))
    assert b["hits"] == [512] and b["restored"] == [512], (b["hits"], b["restored"])
    assert b["tokens"] == [baseline[3]]
    # the default ("last") saves only 768, where the same prompt finds no state it can use: checked
    # by test_later_prompt_hits_the_last_boundary_in_a_new_engine (its SHARE640 hits 0)


def test_an_unknown_checkpoint_setting_is_refused_at_start_up(qwen_model, tmp_path):
    with pytest.raises(AssertionError, match="hybrid_checkpoint_steps"):
        run_engine(qwen_model, "qwen3next", [PROMPT[:10]], tmp_path, lmcache=True,
                   env=_env(tmp_path / "disk"),
                   extra_args=(*ARGS, "--lmcache-extra",
                               json.dumps({"lmcache.hybrid_checkpoint_steps": "sometimes"})))


def test_without_the_cut_no_state_is_saved(qwen_model, tmp_path, baseline):
    """The control: the same runs with the checkpoint steps off save nothing and hit nothing."""
    env = _env(tmp_path / "disk")
    off = ("--lmcache-extra", json.dumps({"lmcache.hybrid_checkpoint_steps": False}))
    a = run_engine(qwen_model, "qwen3next", [PROMPT], tmp_path, lmcache=True, env=env,
                   extra_args=(*ARGS, *off))
    assert a["saved"] == [[]] and a["tokens"] == [baseline[0]]
    b = run_engine(qwen_model, "qwen3next", [LATER], tmp_path, lmcache=True, env=env,
                   extra_args=(*ARGS, *off))
    assert b["hits"] == [0] and b["saved"] == [[]] and b["tokens"] == [baseline[1]]


@pytest.mark.parametrize("start,new,prompt,want", [
    (0, 1000, 1000, 768),     # one step over the prompt: cut at its last boundary
    (768, 232, 1000, 232),    # the rest: no boundary crossed
    (0, 1024, 1024, 1024),    # ends on a boundary: not cut
    (0, 2048, 4000, 2048),    # a budget-sized step ending on a boundary
    (2048, 2048, 4000, 1792),  # 2048 -> 3840
    (0, 200, 1000, 200),      # no boundary crossed
    (100, 300, 1000, 156),    # 100 -> 256
    (1000, 1, 1000, 1),       # decode: never cut
])
def test_checkpoint_split(start, new, prompt, want):
    """vLLM's Scheduler._connector_checkpoint_split (the patch's arithmetic), alignment 256."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(connector_checkpoint_alignment=256, connector_checkpoint_every=False)
    req = SimpleNamespace(num_prompt_tokens=prompt)
    assert Scheduler._connector_checkpoint_split(sched, req, new, start) == want


@pytest.mark.parametrize("start,new,prompt,want", [
    (0, 1000, 1000, 256),     # cut at the first boundary it crosses
    (256, 744, 1000, 256),    # then the next
    (768, 232, 1000, 232),    # the rest: no boundary crossed
    (0, 1024, 1024, 256),     # even when the step would end on a boundary
    (0, 256, 1000, 256),      # a step ending on the first boundary
    (100, 300, 1000, 156),    # 100 -> 256
    (0, 200, 1000, 200),      # no boundary crossed
    (1000, 1, 1000, 1),       # decode: never cut
])
def test_checkpoint_split_every_boundary(start, new, prompt, want):
    """The same with every boundary asked for (lmcache.hybrid_checkpoint_steps: every)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(connector_checkpoint_alignment=256, connector_checkpoint_every=True)
    req = SimpleNamespace(num_prompt_tokens=prompt)
    assert Scheduler._connector_checkpoint_split(sched, req, new, start) == want
