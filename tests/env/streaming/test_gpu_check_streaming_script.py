"""ci/gpu/check_streaming.py, the GPU check of the streaming connector, run here on the CPU
engine (`--device cpu --long-tokens 4096`): streaming vs native on the sharpened tiny Llama-4 at
a device budget smaller than the prompts give the same greedy tokens and top-5 logprobs (within
0.05 nats) for a mixed batch, a prefix reuse and a long prompt attended in several windows, and
the negative control (one history token of the long prompt changed) changes the output; the
streaming side at TP 2 and at PP 2 (vLLM's multiprocess executor, one bound core per rank) against
the native side at the same TP 2 / PP 2 (the same engine shape: in bf16, native TP 2 differs from
native TP 1 by up to 0.09 nats, which is tensor parallelism, not streaming). Both dtype paths on
every machine: the main test runs `--dtype auto` (bf16; fp16 on an AMX CPU), a smaller run the
other one. The judgement and the model surgery are pinned without an engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streaming_helpers import needs_hooks

# serial: the TP 2 / PP 2 runs bind one core per rank (`make test` runs that test alone, with every
# core); the other dtype's single-rank run and the engine-free tests run in the parallel pass
SERIAL = pytest.mark.serial

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "ci" / "gpu" / "check_streaming.py"


def _module():
    spec = importlib.util.spec_from_file_location("check_streaming", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@SERIAL
@pytest.mark.env
@needs_hooks
def test_streaming_equals_native_on_the_cpu_engine(tmp_path):
    # TP 2 too: the streaming side again with vLLM's multiprocess executor, two worker processes of
    # one bound OpenMP thread each (2 cores), each rank streaming its own KV heads; compared with
    # native at TP 2, the control token included
    # --timeout: a side that hangs (~20 s each here) is stopped after 5 minutes with its processes'
    # Python stacks in the output, well inside this test's own limit
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--long-tokens", "4096",
                          "--tensor-parallel-size", "2", "--timeout", "300", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-12000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT 10/10 identical; control changed"), res.stdout
    assert "streaming TP 2 vs native TP 2" in lines[-1], lines[-1]
    assert f", {_auto_dtype()}, " in lines[-1], lines[-1]  # the dtype in use, in the summary
    assert res.stdout.startswith("host "), res.stdout  # the CPU (AMX or not) in the log
    native_tp2 = json.loads((tmp_path / "native-tp2.json").read_text())
    assert native_tp2["info"]["tensor_parallel_size"] == 2 and native_tp2["info"]["connector"] is None
    tp2 = json.loads((tmp_path / "streaming-tp2.json").read_text())
    assert tp2["info"]["tensor_parallel_size"] == 2 and tp2["info"]["connector"] == "StreamingConnector"
    assert tp2["info"]["device_blocks"] == 48
    assert tp2["results"]["prefix-b"]["prefix_hit_tokens"] > 0
    assert "control (TP 2) streaming output changed" in res.stdout
    streaming = json.loads((tmp_path / "streaming.json").read_text())
    native = json.loads((tmp_path / "native.json").read_text())
    info = streaming["info"]
    assert info["connector"] == "StreamingConnector" and native["info"]["connector"] is None
    assert info["device_blocks"] == 48  # 1536 tokens of device KV for a 4096-token prompt
    assert info["streaming_calls"]["installed"] and info["streaming_calls"]["max_windows"] >= 8
    assert streaming["results"]["prefix-b"]["prefix_hit_tokens"] > 0
    # the control changed a token of the long prompt's first half, windows before the end
    assert 0 <= info["control"]["pos"] < 2048 and info["control"]["how"] == "most attended"
    plan = json.loads((tmp_path / "plan-native.json").read_text())
    long, control = plan["cases"][3]["prompts"][0], plan["cases"][4]["prompts"][0]
    assert [i for i, (a, b) in enumerate(zip(long, control)) if a != b] == [info["control"]["pos"]]
    # the sharpened model is what both sides ran
    assert plan["model"].endswith("llama4-sharp")

    # PP 2: the streaming side once more, two pipeline stages in their own worker processes (one
    # bound OpenMP thread each), each stage streaming its own layers (the NoPE layer is in the
    # second stage), against native at PP 2, with the same control token. --reuse keeps the
    # single-rank streaming and native results of the run above (same plans): only the PP sides run
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--long-tokens", "4096",
                          "--pipeline-parallel-size", "2", "--reuse", "--timeout", "300",
                          "--work", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-12000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT 10/10 identical; control changed"), res.stdout
    assert "streaming PP 2 vs native PP 2" in lines[-1], lines[-1]
    assert res.stdout.count("(reused from an earlier run)") == 2, res.stdout
    native_pp2 = json.loads((tmp_path / "native-pp2.json").read_text())
    assert native_pp2["info"]["pipeline_parallel_size"] == 2 and native_pp2["info"]["connector"] is None
    pp2 = json.loads((tmp_path / "streaming-pp2.json").read_text())
    assert pp2["info"]["pipeline_parallel_size"] == 2 and pp2["info"]["tensor_parallel_size"] == 1
    assert pp2["info"]["connector"] == "StreamingConnector"
    assert pp2["info"]["device_blocks"] == 48 and pp2["plan"]["batched_tokens"] == 128
    assert pp2["results"]["prefix-b"]["prefix_hit_tokens"] > 0
    assert "control (PP 2) streaming output changed" in res.stdout


def _auto_dtype() -> str:
    from kvstack.testbed.tiny_models import cpu_exactness_dtype

    return cpu_exactness_dtype() or "bfloat16"


@pytest.mark.env
@needs_hooks
def test_the_other_dtype_path(tmp_path):
    # the dtype the main test does not run here (fp16 where it ran bf16, bf16 on an AMX CPU, i.e.
    # vLLM's AMX kernel), at a smaller size: both precision paths are compared on any machine,
    # each against its own tolerance (kvstack.testbed.precision.LOGPROB_TOL), control included
    from kvstack.testbed.precision import logprob_tol

    other = "bfloat16" if _auto_dtype() == "float16" else "float16"
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--long-tokens", "2048",
                          "--mixed", "700,45", "--prefix-tokens", "320", "--dtype", other,
                          "--work", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT 5/5 identical; control changed"), res.stdout
    assert f", {other}, " in last and f"tol {logprob_tol(other)}," in last, last
    info = json.loads((tmp_path / "streaming.json").read_text())["info"]
    assert info["streaming_calls"]["max_windows"] >= 8
    # the mixed batch's steps of two requests took the packed path; the varlen call is CUDA's
    calls = info["streaming_calls"]
    assert calls["packed_calls"] > 0 and calls["varlen_calls"] == calls["varlen_refused"] == 0
    packed_line = f"streaming packed calls (steps of several requests) {calls['packed_calls']}:"
    assert packed_line in res.stdout


@pytest.mark.env
@needs_hooks
def test_a_side_that_does_not_finish_is_stopped_with_its_stacks(tmp_path):
    # a side past --timeout is stopped (here the streaming side, made to stall once its engine is
    # up, or still starting it on a slow machine): its processes print their Python stacks into
    # its log, which the output ends with, and none is left running
    env = dict(os.environ, KVSTACK_CHECK_STREAMING_STALL="streaming")
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--long-tokens", "2048",
                          "--timeout", "30", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert "streaming run failed (exit timeout" in out, out
    assert "--- the last" in out and '  File "' in out and "timed out after 30 s" in out, out
    log = (tmp_path / "streaming.log").read_text()
    assert "(most recent call first)" in log and "in child" in log, log[-3000:]
    assert out.strip().splitlines()[-1].startswith("RESULT 0/5 identical; the streaming run failed")
    assert _processes_naming(str(tmp_path)) == []  # the side and its children were killed
    # the search itself finds a live process naming the folder (it could not be vacuous)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)]) as p:
        try:
            for _ in range(50):
                if _processes_naming(str(tmp_path)):
                    break
                time.sleep(0.1)
            assert _processes_naming(str(tmp_path)) == [p.pid]
        finally:
            p.kill()


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line has `text` (Linux /proc), this one excepted (the script
    has waited for its processes to be gone before it exits)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(cmdline.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_bad_usage_exits_2_before_any_engine(tmp_path):
    for extra in (["--long-tokens", "1000"],  # fits the device budget of 48 blocks
                  ["--long-tokens", "2048", "--window-tokens", "1024"]):  # not 2 windows of history
        res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--work",
                              str(tmp_path), *extra], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
    assert not list(tmp_path.glob("*.json"))


def test_compare_judges_tokens_and_logprobs():
    compare = _module().compare

    def out(tokens, top1):
        return [{"tokens": tokens, "logprobs": [[[t, lp], [999, lp - 1.0]]
                                                for t, lp in zip(tokens, top1)]}]

    same, worst, note = compare(out([5, 6, 7], [-1.0, -2.0, -1.5]),
                                out([5, 6, 7], [-1.01, -2.0, -1.5]), 0.05)
    assert same and abs(worst - 0.01) < 1e-9 and note == ""
    same, worst, note = compare(out([5, 6, 7], [-1.0, -2.0, -1.5]),
                                out([5, 6, 7], [-1.0, -2.2, -1.5]), 0.05)
    assert not same and "logprob diff 0.2000 > 0.05" in note
    same, _, note = compare(out([5, 6, 7], [-1.0, -2.0, -1.5]),
                            out([5, 8, 7], [-1.0, -2.0, -1.5]), 0.05)
    assert not same and "tokens differ from step 1" in note and "top-2 margin there 1.0000" in note
    # a differing token where the reference's top-2 margin is within the tolerance is a tie when
    # ties are asked for (counted, not failed), never when the margin is larger
    def tied(tokens, margin):
        return [{"tokens": tokens, "logprobs": [[[t, -1.0], [999, -1.0 - margin]] for t in tokens]}]

    ties = []
    same, _, note = compare(tied([5, 6, 7], 0.03), tied([5, 8, 7], 0.03), 0.05, ties)
    assert same and ties == [(0, 1, pytest.approx(0.03))] and "a tie at step 1" in note
    ties = []
    same, _, note = compare(tied([5, 6, 7], 0.3), tied([5, 8, 7], 0.3), 0.05, ties)
    assert not same and ties == [] and "tokens differ from step 1" in note
    same, _, _ = compare(tied([5, 6, 7], 0.03), tied([5, 8, 7], 0.03), 0.05)  # no ties asked: fails
    assert not same
    # logprobs after the first differing token are not compared (different contexts)
    same, worst, _ = compare(out([5, 8, 7], [-1.0, -2.0, -1.5]),
                             out([5, 9, 7], [-1.0, -2.0, -9.0]), 0.05)
    assert not same and worst == 0.0


@pytest.mark.env
def test_sharpen_scales_only_the_nope_projections_and_lm_head(tmp_path):
    import torch
    from safetensors.torch import load_file

    from kvstack.testbed.tiny_models import make_model

    mod = _module()
    base = make_model("llama4", tmp_path / "llama4")
    sharp = mod.sharpen(base, tmp_path / "sharp", qk_scale=16, o_scale=4, lm_head_scale=8,
                        max_pos=8192)
    a, b = load_file(str(base / "model.safetensors")), load_file(str(sharp / "model.safetensors"))
    assert a.keys() == b.keys()
    factors = {"model.layers.3.self_attn.q_proj.weight": 16, "model.layers.3.self_attn.k_proj.weight": 16,
               "model.layers.3.self_attn.o_proj.weight": 4, "lm_head.weight": 8}
    for key in a:
        want = (a[key].float() * factors.get(key, 1)).to(a[key].dtype)
        assert torch.equal(b[key], want), key
    cfg = json.loads((sharp / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192 and cfg["no_rope_layers"] == [1, 1, 1, 0]
    assert mod.sharpen(base, tmp_path / "sharp", qk_scale=16, o_scale=4, lm_head_scale=8,
                       max_pos=8192) == sharp  # kept, not rewritten
