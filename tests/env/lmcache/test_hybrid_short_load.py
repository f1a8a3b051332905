"""A short or failed LMCache load on a hybrid model fails that load, never the engine (issue 29).

The long-memory tiny Qwen3-Next (hybrid_models.py: GDN layers + full attention, several KV cache
groups, its tokens depend on the recurrent state) with LMCacheConnectorV1, LMCache's local CPU tier,
chunk 256, and the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, as `vllm serve`
runs it: an engine core that dies surfaces as an exception). A 1,000-token prefix is stored (chunks
and hybrid states at 256, 512, 768); a prompt extending it hits 768 tokens and, between its lookup
and its load, the chunk 512-768 is removed from LMCache (fault_site/sitecustomize.py, in the engine
core process): the load comes back one chunk short. With kv_load_failure_policy="recompute" (vLLM's
default, "fail", fails the request alone) vLLM 0.32 patch 0009 / 0.25 patch 0020 recomputes the request
from token 0 and LMCache 0.32 0014 / 0.25 0016 saves nothing in the failed step; the request's tokens equal a run without
LMCache, the engine serves on, and a repeat of the prompt hits again with exact tokens. The same with
a retrieve that raises. Negative control: the same run with that vLLM patch taken out (an overlay) dies.
Both bases: stock vLLM 0.32 raises RuntimeError for block-level failures with several KV cache groups,
stock vLLM 0.25 unpacks the block ids as one group (ValueError); either stops the engine core.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from kvtest import on_default_base  # noqa: E402


CHUNK = 256
PREFIX = [(i * 37) % 900 + 3 for i in range(1000)]  # chunks 0-256, 256-512, 512-768 (+ a partial one)
EXT = PREFIX + [5, 6, 7, 8] * 25  # extends it by 100 tokens: LMCache hit 768 (state at 768)
EXT2 = PREFIX + [9, 10, 11] * 30  # another extension, for the raising retrieve
OTHER = [(i * 11) % 700 + 40 for i in range(300)]
NEAR = PREFIX[:780] + [13, 14, 15, 16] * 5  # 32 tokens past the state at 768: the state matters
# the vLLM patch under test, and what stock vLLM says when a short load stops its engine core
VLLM_PATCH, STOCK_DEATH = (
    ("0009-kvstack-scheduler-block-level-KV-load-failures-on-mo.patch",
     "not supported for models with multiple KV cache groups") if on_default_base() else
    ("0020-kvstack-scheduler-block-level-KV-load-failures-on-mo.patch",
     "too many values to unpack"))


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    from hybrid_models import long_memory_qwen3next

    from kvstack.testbed.tiny_models import make_model

    root = tmp_path_factory.mktemp("tiny-models")
    return long_memory_qwen3next(make_model("qwen3next", root / "qwen3next"),
                                 tmp_path_factory.mktemp("qwen-long") / "model")


def run(model_dir: Path, prompts, tmp: Path, *, faults=None, lmcache=True, env=None,
        extra_args=()) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    cmd = [sys.executable, str(HERE / "short_load_run.py"), "--model-dir", str(model_dir),
           "--prompts", str(tmp / "prompts.json"), "--max-num-batched-tokens", str(CHUNK)]
    if faults:
        (tmp / "faults.json").write_text(json.dumps(faults))
        cmd += ["--faults", str(tmp / "faults.json")]
    if lmcache:
        cmd.append("--lmcache")
    cmd += list(extra_args)
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1",
                "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_DISABLE_BANNER": "1",
                "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
                "KVSTACK_FAULT_FLAG": str(tmp / "fault.flag"), "KVSTACK_FAULT_LOG": str(tmp / "fault.log"),
                "PYTHONPATH": os.pathsep.join([str(HERE / "fault_site"), str(REPO)]
                                              + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                 else [])),
                **(env or {})}
    for key in ("LMCACHE_HYBRID_STATE_DIR", "KVSTACK_OVERLAY"):
        if key not in (env or {}):
            full_env.pop(key, None)
    full_env["PYTHONUNBUFFERED"] = "1"
    # A file, not a pipe: the engine core process left by the driver's os._exit holds it open.
    with open(tmp / "run.log", "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=full_env,
                                start_new_session=True)
        try:
            proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine core process left by os._exit
            except ProcessLookupError:
                pass
    out = (tmp / "run.log").read_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("@@JSON ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{out[-10000:]}")
    res = json.loads(lines[-1][len("@@JSON "):])
    res["log"] = out
    res["faults"] = (tmp / "fault.log").read_text().splitlines() if (tmp / "fault.log").exists() else []
    return res


def prompt_log(log: str, n: int) -> str:
    """The engine's log lines between the markers of prompt n and the next one."""
    start = log.index(f"@@PROMPT {n}\n")
    end = min([i for i in (log.find(f"@@PROMPT {n + 1}\n"), log.find("@@END")) if i >= 0], default=len(log))
    return log[start:end]


def hits(text: str) -> list[int]:
    return [int(h) for h in re.findall(r"LMCache hit tokens: (\d+)", text)]


@pytest.fixture(scope="module")
def baseline(qwen_model, tmp_path_factory):
    out = run(qwen_model, [PREFIX, EXT, OTHER, EXT2, NEAR], tmp_path_factory.mktemp("base"),
              lmcache=False)
    assert out["error"] is None
    return dict(zip(["PREFIX", "EXT", "OTHER", "EXT2", "NEAR"], out["tokens"]))


def test_restore_is_exact_and_a_zeroed_state_changes_the_tokens(qwen_model, baseline, tmp_path):
    """The restores this module (and test_backend_stall.py, same model and prefix) call exact can
    fail: NEAR restores the state at 768 and computes 32 tokens past it; with the restored state
    zeroed (fault_site's KVSTACK_ZERO_RESTORED_STATE, in the engine core process) its tokens change."""
    ok = run(qwen_model, [PREFIX, NEAR], tmp_path / "ok")
    assert ok["error"] is None and ok["tokens"] == [baseline["PREFIX"], baseline["NEAR"]]
    assert 768 in hits(prompt_log(ok["log"], 1))
    zero = run(qwen_model, [PREFIX, NEAR], tmp_path / "zero", env={"KVSTACK_ZERO_RESTORED_STATE": "1"})
    assert zero["error"] is None and "zeroed pid=" in prompt_log(zero["log"], 1)
    assert 768 in hits(prompt_log(zero["log"], 1))
    assert zero["tokens"][0] == baseline["PREFIX"]
    assert zero["tokens"][1] != baseline["NEAR"], "a zeroed state must change the tokens"


def test_short_and_failed_loads_recompute_and_the_engine_serves_on(qwen_model, baseline, tmp_path):
    t0 = time.monotonic()
    out = run(qwen_model, [PREFIX, EXT, OTHER, EXT, EXT2, EXT2], tmp_path,
              faults=[None, "drop", None, None, "raise", None])
    log = out["log"]
    assert out["error"] is None, out["error"] + "\n" + log[-6000:]
    # the faults happened, in the engine core process, at the loads of prompts 1 and 4
    assert len(out["faults"]) == 2, out["faults"]
    assert out["faults"][0].startswith("drop") and "chunk=512-768" in out["faults"][0]
    assert "removed=1" in out["faults"][0] and out["faults"][1].startswith("raise")
    # prompt 1: LMCache promised 768 tokens, the load came back one chunk short
    p1 = prompt_log(log, 1)
    assert 768 in hits(p1), p1[-3000:]
    assert "Num retrieved tokens: 512, num expected tokens: 768" in p1, p1[-3000:]
    assert "Recovered from KV load failure" in p1 and "recomputed from token 0" in p1, p1[-3000:]
    assert "its load failed; nothing saved this step" in p1, p1[-3000:]
    # prompt 4: the retrieve raised
    p4 = prompt_log(log, 4)
    assert "retrieve failed (RuntimeError" in p4 and "Recovered from KV load failure" in p4, p4[-3000:]
    # tokens: every request as without LMCache; the engine served on
    assert out["tokens"] == [baseline["PREFIX"], baseline["EXT"], baseline["OTHER"], baseline["EXT"],
                             baseline["EXT2"], baseline["EXT2"]]
    # the repeats hit LMCache again: the recomputed requests saved their chunks and states (the
    # chunk that had gone included) and nothing of their failed steps
    assert hits(prompt_log(log, 3)) and hits(prompt_log(log, 3))[-1] == 1024, prompt_log(log, 3)[-3000:]
    assert "restored hybrid state at 1024" in prompt_log(log, 3)
    assert hits(prompt_log(log, 5)) and hits(prompt_log(log, 5))[-1] == 1024
    assert "Recovered from KV load failure" not in prompt_log(log, 3) + prompt_log(log, 5)
    print(f"fault run: {time.monotonic() - t0:.1f} s")


def test_negative_control_stock_scheduler_dies(qwen_model, tmp_path):
    """The vLLM patch taken out (the rest of the series and LMCache's patches kept): the short
    load stops the engine core."""
    from kvstack.release.overlay import build_overlay, series_patches
    from kvstack.release.pins import load_pin

    patch = next(p for p in series_patches(load_pin("vllm").series_dir) if p.name == VLLM_PATCH)
    overlay = tmp_path / "overlay"
    build_overlay([patch], Path(sysconfig.get_paths()["purelib"]), overlay, reverse=True)
    assert "_handle_invalid_blocks_multi_group" not in (overlay / "vllm/v1/core/sched/scheduler.py").read_text()
    out = run(qwen_model, [PREFIX, EXT, OTHER], tmp_path / "run", faults=[None, "drop", None],
              env={"KVSTACK_OVERLAY": str(overlay)})
    assert out["error"] is not None and len(out["tokens"]) == 1, out
    assert STOCK_DEATH in out["log"], out["log"][-4000:]


# -- the scheduler's part alone (vLLM 0.32 0009 / 0.25 0020), without an engine: seconds -------

def _scheduler_stub(groups_block_sizes, running, waiting=(), recompute=True):
    """A Scheduler whose state is the bits _handle_invalid_blocks reads (no engine)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    sched = Scheduler.__new__(Scheduler)
    block_ids = {r.request_id: r.block_ids for r in [*running, *waiting]}
    evicted: set[int] = set()
    sched.kv_cache_config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=bs)) for bs in groups_block_sizes])
    sched.kv_cache_manager = SimpleNamespace(
        get_block_ids=lambda req_id: block_ids[req_id], evict_blocks=evicted.update,
        block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)))
    sched.running = list(running)
    sched.kv_holding_waiting = list(waiting)  # vLLM 0.32
    sched.skipped_waiting = list(waiting)  # vLLM 0.25
    sched.num_sampled_tokens_per_step = 1
    sched.requests = {r.request_id: r for r in [*running, *waiting]}
    sched.recompute_kv_load_failures = recompute
    sched.failed_recving_kv_req_ids = set()
    sched.prev_step_scheduled_req_ids = {r.request_id for r in running}
    sched.preempted = []
    sched._preempt_request = lambda req, ts, drop_stale_output=False: sched.preempted.append(
        (req.request_id, drop_stale_output))
    return sched, evicted


class _Req:
    """A stand-in Request (hashed by identity, as Request is)."""

    def __init__(self, request_id, num_computed_tokens, block_ids, status):
        self.request_id, self.num_computed_tokens, self.block_ids = request_id, num_computed_tokens, block_ids
        self.status, self.skip_reading_prefix_cache = status, False
        self.num_output_placeholders = self.async_tokens_to_discard = 0


def _req(req_id, num_computed, block_ids, status=None):
    from vllm.v1.request import RequestStatus

    return _Req(req_id, num_computed, block_ids, status or RequestStatus.RUNNING)


def test_unit_scheduler_recomputes_from_zero_only_the_requests_that_hold_an_invalid_block():
    # group 0: attention (block 32), group 1: a GDN group; "a" loaded 96 tokens (blocks 5, 6, 7)
    # and ran 32 more this step; "b" holds none of the invalid blocks; "c" shares block 6 with "a"
    # through the prefix cache (the same load serves it); block 0 (the null block) is never a hit.
    a = _req("a", 128, ([5, 6, 7, 8], [0, 0, 11, 12]))
    b = _req("b", 40, ([20, 21], [0, 22]))
    c = _req("c", 96, ([5, 6, 30], [0, 0, 31]))
    sched, evicted = _scheduler_stub([32, 32], [a, b, c])
    skip = sched._handle_invalid_blocks({6, 0}, {"a": 32, "b": 8, "c": 32})
    assert skip == {"a", "c"}
    assert sched.running == [b]
    # reversed: back in FIFO order; their in-flight output is dropped (0.32: drop_stale_output)
    assert sched.preempted == [("c", on_default_base()), ("a", on_default_base())]
    assert a.skip_reading_prefix_cache and c.skip_reading_prefix_cache and not b.skip_reading_prefix_cache
    assert evicted == {5, 6, 7, 8, 11, 12, 30, 31}  # every group's blocks of a and c, never the null block
    assert sched.prev_step_scheduled_req_ids == {"b"}
    # an invalid block past a request's computed prefix (this step's own blocks) does not count
    d = _req("d", 64, ([40, 41, 42], [0, 43, 44]))
    sched, _ = _scheduler_stub([32, 32], [d])
    assert sched._handle_invalid_blocks({42}, {"d": 32}) == set()  # 32 prior tokens: block 40 only


@pytest.mark.skipif(on_default_base(), reason="vLLM 0.25 only: 0.32 drains in-flight frames itself "
                    "(drop_stale_output)")
def test_unit_scheduler_drops_the_later_async_frames_of_a_preempted_request():
    """Async scheduling on vLLM 0.25: a preempted request's output frames of later steps, already in
    flight, are dropped on return (async_tokens_to_discard); this step's frame, skipped by
    update_from_output, is not counted."""
    from types import SimpleNamespace

    a = _req("a", 97, ([5, 6, 7, 8], [0, 0, 11, 12]))  # this step sampled, and step N+1 is in flight
    c = _req("c", 96, ([5, 6, 30], [0, 0, 31]))  # this step was a prefill chunk, N+1 samples
    a.num_output_placeholders, c.num_output_placeholders = 2, 1
    step = (SimpleNamespace(scheduled_spec_decode_tokens={}),
            SimpleNamespace(req_id_to_index={"a": 0, "c": 1}, sampled_token_ids=[[42], []]))
    sched, _ = _scheduler_stub([32, 32], [a, c])
    assert sched._handle_invalid_blocks({6}, {"a": 32, "c": 32}, step_output=step) == {"a", "c"}
    assert (a.async_tokens_to_discard, c.async_tokens_to_discard) == (1, 1)
    assert a.num_output_placeholders == c.num_output_placeholders == 0
    # without the step's outputs (or without async scheduling) every placeholder is a later frame
    b = _req("b", 96, ([5, 6, 7], [0, 0, 9]))
    b.num_output_placeholders = 1
    sched, _ = _scheduler_stub([32, 32], [b])
    assert sched._handle_invalid_blocks({6}, {"b": 32}) == {"b"} and b.async_tokens_to_discard == 1


def test_unit_scheduler_fail_policy_and_async_loads():
    from vllm.v1.request import RequestStatus

    a = _req("a", 96, ([5, 6, 7], [0, 0, 8]))
    sched, evicted = _scheduler_stub([32, 32], [a], recompute=False)
    assert sched._handle_invalid_blocks({6}, {"a": 32}) == {"a"}  # fails it (update_from_output)
    assert sched.preempted == [] and sched.running == [a] and evicted == {5, 6, 7, 8}
    w = _req("w", 64, ([9, 10, 11], [0, 12, 13]), status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    sched, evicted = _scheduler_stub([32, 32], [], waiting=[w])
    assert sched._handle_invalid_blocks({10}, {}) == set()
    assert w.num_computed_tokens == 0 and sched.failed_recving_kv_req_ids == {"w"}
    assert w.skip_reading_prefix_cache and evicted == set()  # freed once its transfer ends


def test_corrupted_state_is_refused_and_the_hit_shortened(qwen_model, baseline, tmp_path):
    """A new engine process (no state of its own in memory) whose first hybrid state read from
    LMCache's storage (local disk, written by another process) comes back damaged, 64 bytes
    short: the state is refused (its checksum fails), the hit ends before it, and the request
    recomputes the rest with the tokens of a run without LMCache; the engine serves on and the
    repeat, whose read is intact, hits the prefix with exact tokens. Both bases (nothing here
    needs vLLM 0009: a refused state shortens the hit at lookup, no load fails)."""
    disk = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
            "LMCACHE_LOCAL_DISK": f"file://{tmp_path / 'disk'}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    a = run(qwen_model, [PREFIX], tmp_path / "a", env=disk)
    assert a["error"] is None and a["tokens"] == [baseline["PREFIX"]]
    b = run(qwen_model, [EXT, EXT], tmp_path / "b", env=disk, faults=["corrupt", None])
    log = b["log"]
    assert b["error"] is None, b["error"] + "\n" + log[-6000:]
    assert len(b["faults"]) == 1 and b["faults"][0].startswith("corrupt"), b["faults"]
    p0, p1 = prompt_log(log, 0), prompt_log(log, 1)
    assert "rejected (checksum mismatch): treated as a miss" in p0, p0[-3000:]
    assert "restored hybrid state at 768" not in p0, p0[-3000:]
    print("prompt 0 hits:", hits(p0), "cached:", b["cached"])
    assert b["cached"][0] < 768
    assert b["tokens"] == [baseline["EXT"], baseline["EXT"]]
    assert b["cached"][1] >= 768 and "restored hybrid state at" in p1, p1[-3000:]
