#!/usr/bin/env python3
"""Streaming vs native, end to end on one device: kvstack's StreamingConnector (issue 13).

The tiny Llama-4 (kvstack.testbed.tiny_models "llama4": layers 0-2 chunked-local, layer 3 a NoPE global
layer, the one the connector streams) is run twice, each side in its own process:
  - native:    vLLM without a connector, enough device KV for every prompt;
  - streaming: vLLM with kvstack.streaming.StreamingConnector and a device KV budget smaller than
               the prompts (num_gpu_blocks_override), the NoPE layer's history in the host tier,
               attended in windows of `--window-tokens` merged by log-sum-exp.
On a GPU (`--device cuda`, the default) both sides run with vLLM's DEFAULT compilation and CUDA
graph settings: no enforce_eager, no compilation or cudagraph overrides (the connector declares
`requires_piecewise_for_cudagraph`, so vLLM itself turns FULL_AND_PIECEWISE into PIECEWISE).
The compilation mode and cudagraph mode each side ran with are printed. On a GPU every side runs with
async scheduling off and the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): the connector refuses
both at start-up (not shown exact with streaming layers), and vLLM picks both on a GPU by default.

Cases (greedy, `--max-tokens` tokens, top `--logprobs` logprobs per generated token):
  mixed    several prompts of mixed lengths in one batch (some longer than the device budget)
  prefix-a a prompt on its own, then
  prefix-b a second request extending prefix-a's prompt (the streaming side must reuse the
           first one's pages from its host tier: prefix_hit_tokens > 0, else the case fails)
  long     one long prompt (`--long-tokens`, default 16384 on cuda) of many windows
  control  the long prompt with ONE history token changed (see the negative control below)
Each case passes when the greedy tokens are identical and every logprob the two sides both
have in their top-k differs by at most `--tol` (default: the dtype's tolerance,
kvstack.testbed.precision.LOGPROB_TOL: 0.08 nats in bf16, 0.02 in fp16; the top-1 logprob is one
of them), compared up to and including the first differing token. A differing token is a tie,
not a failure, only where the native side's top-2 margin at that step is itself within the
tolerance (the two tokens are equal at that precision); ties are counted and printed.

Sharp attention. A tiny random model attends almost uniformly and its logits are nearly flat,
so a wrong history would hardly move its output and a comparison could pass with broken
streaming attention. The check therefore runs a copy of the model (`sharpen`) whose NoPE layer
has q_proj and k_proj scaled by `--qk-scale` (16: attention logits x256, a few keys dominate each
query) and o_proj by `--o-scale` (4: that layer's output dominates the residual stream), and
whose lm_head is scaled by `--lm-head-scale` (8: logits spread like a trained model's, greedy
ties become rare).

Negative control. With sharp attention only the tokens a query attends matter, so the control
changes a token that is attended: while the streaming side runs `long`, a probe (wrapping the
worker's windowed attention, in-process) adds up the attention the output-making queries (the
last prompt token and the generated ones) give each history position, read back from the host
tier; the control changes the most attended token of the prompt's first half (thousands of
positions and several windows before the end). The streaming side runs the control prompt
next; the native side runs afterwards, every case and the control too. The control passes when
the streaming side's output for it differs from its output for `long` by the same judgement
(tokens, or a logprob by more than `--tol`): one changed history token must be visible, else
the check has no power and fails.
The probe also counts windowed-attention calls: the long case must have been attended in more
than one window, else the check is vacuous and fails.

GPU machine: a venv with the pinned CUDA wheel and kvstack's series (ci/gpu/carry.py, see
ci/gpu/README.md), then from the kvstack checkout:

    python ci/gpu/check_streaming.py                       # --device cuda, --long-tokens 16384

Without a GPU, `--device cpu` runs the same comparison on vLLM's CPU engine (enforce_eager, as
the CPU engine needs; CI does, with `--long-tokens 4096`: tests/env/streaming/
test_gpu_check_streaming_script.py). Both devices run the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's counters can be read.

Parallel sides. `--tensor-parallel-size T` and/or `--pipeline-parallel-size P` add two runs: the
streaming side and the native side at TP T x PP P on vLLM's own multiprocess executor (a worker
process per rank; on the CPU engine its shared-memory communicator and one bound OpenMP thread per
rank, so T x P must fit the cores), with the same cases and control token. Streaming at TP T x PP
P is compared with native at the same TP T x PP P: the same engine shape, so the comparison
measures streaming and not tensor parallelism's reduction order (in bf16 native TP 2 itself
differs from native TP 1 by up to 0.09 nats, measured on an AMD EPYC without AMX). Each TP
rank streams its own KV heads, each PP stage its own layers (the tiny Llama-4's NoPE layer is in
the second of two stages). vLLM keeps P batches in flight and (0.32) reserves device
KV for all of them, so the PP side schedules `--batched-tokens` / P per step: the same device
budget (both parallel sides). `--reuse` keeps a side's result from an earlier run in the same
`--work` when its plan is the same (CI runs TP 2, then PP 2 with `--reuse`: only the PP sides run
again).

Each side runs in a process group of its own with its output in `<work>/<side>.log`. A side still
running after `--timeout` seconds is stopped: each of its processes (the engine and vLLM's worker
processes) first prints every thread's Python stack into that log (SIGABRT with faulthandler on),
and the end of the log is printed. When a side ends, what it left running (vLLM's workers finishing
their shutdown, ~5 s) gets 30 s to end by itself and is then killed. `KVSTACK_CHECK_STREAMING_STALL=
<side>` makes that side stall once its engine is up (the tests' stand-in for a hang).

The last line sums it up: `RESULT 5/5 identical; control changed (...)`.
Exit status: 0 every case identical and the control changed; 1 a case differs, a run failed, the
control did not change or the streaming was vacuous; 2 bad usage (e.g. vLLM not importable).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvstack.testbed.backend_servers import _dies_with_parent  # noqa: E402
from kvstack.testbed.precision import LOGPROB_TOL, describe_host, logprob_tol  # noqa: E402

# set to a side's name, that side stalls once its engine is up (how the tests make a side hang)
STALL_ENV = "KVSTACK_CHECK_STREAMING_STALL"
PAGE = 32  # host-tier page = the tiny Llama-4's local chunk = its block size
CONTROL_POS = 5  # the control's token when the attention probe is not there (see Probe)
HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
SHARP_STAMP = "kvstack-sharp.json"
DEFAULTS = {  # per device: what runs in reasonable time there
    "cuda": dict(long_tokens=16384, mixed="3000,45,700,1700,260", prefix=1600),
    "cpu": dict(long_tokens=4096, mixed="1700,45,300", prefix=640),
}


# ----------------------------------------------------------------------------- the model

def nope_layers(config: dict) -> list[int]:
    return [i for i, r in enumerate(config.get("no_rope_layers") or []) if not r]


def sharpen(src: Path, dest: Path, *, qk_scale: float, o_scale: float, lm_head_scale: float,
            max_pos: int) -> Path:
    """A copy of tiny model `src` in `dest` whose NoPE layers attend sharply: q_proj and k_proj
    scaled by `qk_scale`, o_proj by `o_scale`, and lm_head by `lm_head_scale` (a random tiny
    model's logits are nearly flat: top-1 logprob -6.4 of a uniform -6.9, top-2 margins of
    0.01; scaled, its logits spread like a trained model's, so a changed hidden state shows
    in the logprobs and greedy ties are rare); max_position_embeddings raised to `max_pos`
    (the long case; it changes only the size of the RoPE tables of the chunked-local layers).
    Kept when `dest` already holds the same."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    layers = nope_layers(config)
    if not layers:
        raise RuntimeError(f"{src}: no NoPE layer in config.json (no_rope_layers)")
    weights = sorted(p.name for p in src.glob("*.safetensors"))
    recipe = {"layers": layers, "qk_scale": qk_scale, "o_scale": o_scale,
              "lm_head_scale": lm_head_scale,
              "max_pos": max(max_pos, config.get("max_position_embeddings", 0)),
              "src": {p.name: [p.stat().st_size, int(p.stat().st_mtime)]
                      for p in sorted(src.iterdir()) if p.is_file()}}
    try:
        if json.loads((dest / SHARP_STAMP).read_text()) == recipe:
            return dest
    except (OSError, ValueError):
        pass
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".safetensors":
            shutil.copy2(p, tmp / p.name)
    scaled = []
    for name in weights:
        tensors = load_file(str(src / name))
        for key in list(tensors):
            for i in layers:
                for proj, scale in (("q_proj", qk_scale), ("k_proj", qk_scale), ("o_proj", o_scale)):
                    if key == f"model.layers.{i}.self_attn.{proj}.weight" and scale != 1:
                        t = tensors[key]
                        tensors[key] = (t.to(torch.float32) * scale).to(t.dtype).contiguous()
                        scaled.append(key)
            if key == "lm_head.weight" and lm_head_scale != 1:
                t = tensors[key]
                tensors[key] = (t.to(torch.float32) * lm_head_scale).to(t.dtype).contiguous()
                scaled.append(key)
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
    want = 2 * len(layers) * (qk_scale != 1) + len(layers) * (o_scale != 1) + (lm_head_scale != 1)
    if len(scaled) != want:
        raise RuntimeError(f"{src}: expected {want} weights to scale, found {scaled}")
    config["max_position_embeddings"] = recipe["max_pos"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / SHARP_STAMP).write_text(json.dumps(recipe))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


# ----------------------------------------------------------------------------- the cases

def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]  # ids 0-2 are the special tokens


def make_cases(mixed: list[int], prefix: int, long_tokens: int) -> list[dict]:
    """[{name, prompts}] in the order each side runs them (one generate call per case). The
    control case is made from `long` once the streaming side has run it (see control_prompt)."""
    a = random_prompt(prefix, 101)
    return [
        {"name": "mixed", "prompts": [random_prompt(n, 10 + i) for i, n in enumerate(mixed)]},
        {"name": "prefix-a", "prompts": [a]},
        {"name": "prefix-b", "prompts": [a + random_prompt(3 * PAGE + 7, 202)]},
        {"name": "long", "prompts": [random_prompt(long_tokens, 303)]},
    ]


def control_prompt(long: list[int], pos: int) -> list[int]:
    """`long` with token `pos` replaced by another one (same id range)."""
    out = list(long)
    out[pos] = 3 + (long[pos] - 3 + 500) % 997
    return out


# ----------------------------------------------------------------------------- one side

def _engine_env(device: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the connector can be read
    # The connector refuses the V2 model runner (not shown exact with streaming layers; vLLM picks
    # it on a GPU): every side runs the V1 runner, so both sides are the same engine.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kvstack.testbed import tiny_models

    if device == "cpu":
        tiny_models.apply_engine_env()  # KV space, and the sampler uncompiled (eager, same tokens)
    else:
        tiny_models.apply_gpu_env()  # no FlashInfer carried: vLLM's sampler without it


class Probe:
    """Wraps the worker side's windowed attention (the engine is in-process): counts the calls
    and windows and, while `prompt_len` is set, adds up how much the queries that make the
    output (the last prompt token and the generated ones) attend each history position of the
    streaming layer, read from the host tier. Best effort: `installed` says whether it could."""

    def __init__(self):
        self.calls = self.max_windows = self.max_history = 0
        self.installed = False
        self.prompt_len = None
        self.mass = None  # float tensor [prompt_len]: attention weight summed over heads, queries
        try:
            from kvstack.streaming import worker_side
        except Exception:  # noqa: BLE001
            return
        inner = getattr(worker_side, "windowed_attention", None)
        if inner is None:
            return

        def counted(q, new_k, new_v, history, ctx, window, scale, *a, **kw):
            self.calls += 1
            self.max_history = max(self.max_history, int(ctx))
            self.max_windows = max(self.max_windows, -(-int(ctx) // max(int(window), 1)))
            if self.prompt_len and ctx > 0 and (q.shape[0] == 1 or ctx + q.shape[0] == self.prompt_len):
                self._observe(q[-1], new_k, history, int(ctx), float(scale), int(window))
            return inner(q, new_k, new_v, history, ctx, window, scale, *a, **kw)

        worker_side.windowed_attention = counted
        self.installed = True
        # a step of several requests goes through the packed path (packed.py): count its layer
        # calls and, on a GPU, the windows that took the one varlen call for the whole batch
        self.packed_calls = self.varlen_calls = self.varlen_refused = 0
        packed_inner = getattr(worker_side, "packed_attention", None)
        try:
            from kvstack.streaming import packed
        except Exception:  # noqa: BLE001
            packed = None
        if packed_inner is not None:
            def counted_packed(*a, **kw):
                self.packed_calls += 1
                return packed_inner(*a, **kw)

            worker_side.packed_attention = counted_packed
        varlen_inner = getattr(packed, "_attend_varlen", None) if packed is not None else None
        if varlen_inner is not None:
            def counted_varlen(*a, **kw):
                ok = varlen_inner(*a, **kw)
                if ok:
                    self.varlen_calls += 1
                else:
                    self.varlen_refused += 1
                return ok

            packed._attend_varlen = counted_varlen

    def _observe(self, q_last, new_k, history, ctx, scale, window):
        import torch

        if hasattr(history, "windows"):  # the connector's PagedHistory (kvstack/streaming/transfer.py)
            # copies: the staging buffers are reused by the next window
            hk = torch.cat([k.clone() for _, k, _ in history.windows(ctx, window)])
        else:
            hk, _ = history(0, ctx)
        keys = torch.cat([hk.to(q_last.device).float(), new_k.float()])  # [S, Hkv, D]
        rep = q_last.shape[0] // keys.shape[1]
        scores = torch.einsum("hd,shd->hs", q_last.float(), keys.repeat_interleave(rep, 1)) * scale
        w = torch.softmax(scores, dim=-1).sum(0)[:min(ctx, self.prompt_len)].cpu()
        if self.mass is None:
            self.mass = torch.zeros(self.prompt_len)
        self.mass[:w.shape[0]] += w

    def pick(self, limit: int) -> tuple[int, float] | None:
        """The most attended history position before `limit`, and its share of the attention."""
        if self.mass is None or limit <= 0:
            return None
        total = float(self.mass.sum())
        pos = int(self.mass[:limit].argmax())
        return pos, float(self.mass[pos]) / max(total, 1e-30)


def _name(value) -> str:
    return str(getattr(value, "name", value))


def child(plan_file: Path, side: str, out: Path) -> None:
    plan = json.loads(plan_file.read_text())
    device = plan["device"]
    _engine_env(device)
    if side.startswith("streaming"):
        os.environ[HMA_ENV] = "1"
    else:
        os.environ.pop(HMA_ENV, None)
    from kvstack.testbed import tiny_models

    probe = Probe() if side == "streaming" else None
    from vllm import LLM, SamplingParams

    kw = tiny_models.llm_kwargs("llama4", plan["model"], max_model_len=plan["max_model_len"],
                                enable_prefix_caching=False, max_num_seqs=plan["max_num_seqs"],
                                max_num_batched_tokens=plan["batched_tokens"])
    if plan.get("dtype"):
        kw["dtype"] = plan["dtype"]
    tp = plan.get("tensor_parallel_size", 1)
    pp = plan.get("pipeline_parallel_size", 1)
    if tp * pp > 1:
        # vLLM's own parallel engine: its multiprocess executor, one worker process per rank (on
        # the CPU engine with its shared-memory communicator), each rank streaming its own KV
        # heads (TP) of its own stage's layers (PP)
        kw.update(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  distributed_executor_backend="mp")
        if device == "cpu" and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            cpus = sorted(os.sched_getaffinity(0))[:tp * pp]  # one OpenMP thread per rank, bound
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cpus))
    if device != "cpu":
        kw.pop("enforce_eager")  # vLLM's defaults: torch.compile + CUDA graphs, as users run it
        # but async scheduling off, on every side: the connector refuses it (not shown exact with
        # streaming layers; vLLM turns it on on a GPU, its CPU engine turns it off itself)
        kw["async_scheduling"] = False
        if plan.get("gpu_memory_utilization"):
            kw["gpu_memory_utilization"] = plan["gpu_memory_utilization"]
    if side.startswith("streaming"):
        from vllm.config import KVTransferConfig

        kw["num_gpu_blocks_override"] = plan["budget_blocks"]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StreamingConnector", kv_role="kv_both",
            kv_connector_module_path="kvstack.streaming",
            kv_connector_extra_config=plan["streaming"])
    t0 = time.time()
    llm = LLM(**kw)
    started = time.time() - t0
    if os.environ.get(STALL_ENV) == side:  # the tests' stand-in for a side that hangs
        time.sleep(3600)
    core = llm.llm_engine.engine_core.engine_core
    vcfg = llm.llm_engine.vllm_config
    cc = vcfg.compilation_config
    info = {"device": device, "start_s": round(started, 1), "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "compilation_mode": _name(getattr(cc, "mode", getattr(cc, "level", "?"))),
            "cudagraph_mode": _name(getattr(cc, "cudagraph_mode", "?")),
            "enforce_eager": bool(vcfg.model_config.enforce_eager),
            "device_blocks": core.scheduler.kv_cache_config.num_blocks}
    if device != "cpu":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    conn = getattr(core.scheduler, "connector", None)
    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0, ignore_eos=True,
                            logprobs=plan["logprobs"], detokenize=False)
    cases = list(plan["cases"])
    results = {}
    t0 = time.time()
    i = 0
    while i < len(cases):
        case = cases[i]
        i += 1
        before = conn.stats() if conn is not None else {}
        if probe is not None and case["name"] == "long":
            probe.prompt_len = len(case["prompts"][0])
        outs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]], params,
                            use_tqdm=False)
        after = conn.stats() if conn is not None else {}
        results[case["name"]] = {
            "outputs": [{"tokens": list(o.outputs[0].token_ids),
                         "logprobs": [sorted(([t, lp.logprob] for t, lp in pos.items()),
                                             key=lambda x: -x[1])
                                      for pos in (o.outputs[0].logprobs or [])]}
                        for o in outs],
            "prefix_hit_tokens": (after.get("prefix_hit_tokens", 0)
                                  - before.get("prefix_hit_tokens", 0)),
            "failed": after.get("failed_host_tier_full", 0) - before.get("failed_host_tier_full", 0),
        }
        if case["name"] == "long" and "control_pos" not in plan:
            # the streaming side picks the control: the most attended token of the first half
            long = case["prompts"][0]
            got = probe.pick(len(long) // 2) if probe is not None else None
            pos, share = got if got else (CONTROL_POS, None)
            if probe is not None:
                probe.prompt_len = None
            info["control"] = {"pos": pos, "share": share,
                               "how": "most attended" if got else "fixed (no probe)"}
            cases.append({"name": "control", "prompts": [control_prompt(long, pos)]})
    info["generate_s"] = round(time.time() - t0, 1)
    if probe is not None:
        info["streaming_calls"] = {"installed": probe.installed, "windowed_calls": probe.calls,
                                   "max_windows": probe.max_windows,
                                   "max_history": probe.max_history,
                                   "packed_calls": getattr(probe, "packed_calls", 0),
                                   "varlen_calls": getattr(probe, "varlen_calls", 0),
                                   "varlen_refused": getattr(probe, "varlen_refused", 0)}
    info["connector"] = type(conn).__name__ if conn is not None else None
    out.write_text(json.dumps({"info": info, "results": results, "plan": plan}))
    os._exit(0)  # skip engine teardown: the result is written


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid` (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # the fields after the name: state, ppid, pgrp (a zombie has ended: not counted)
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _wait_group(pgid: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while _group(pgid) and time.monotonic() < end:
        time.sleep(0.1)


def _kill_group(pgid: int) -> None:
    """SIGKILL to the group, and until its processes are gone (a signal lands asynchronously)."""
    _signal_group(pgid, signal.SIGKILL)
    _wait_group(pgid, 10)


def _reap_group(pgid: int, grace: float = 30.0) -> None:
    """Let what a finished side left running (vLLM's workers and their resource tracker, which
    unlinks their shared memory) end by itself for up to `grace` seconds, then kill the rest."""
    _wait_group(pgid, grace)
    _kill_group(pgid)


def _dump_stacks(pgid: int) -> None:
    """SIGABRT to each process of the group in turn (children first, the side's own process last),
    so that their faulthandler stacks come out one after another, not interleaved."""
    for pid in sorted(_group(pgid), key=lambda p: p == pgid):
        try:
            os.kill(pid, signal.SIGABRT)
        except (ProcessLookupError, PermissionError):
            continue
        time.sleep(1)


def run_side(plan_file: Path, side: str, work: Path, timeout: int,
             reuse: bool = False) -> dict | str:
    out = work / f"{side}.json"
    if reuse:  # a result of this very plan from an earlier run in the same --work
        try:
            kept = json.loads(out.read_text())
            if kept.get("plan") == json.loads(plan_file.read_text()):
                kept["info"]["reused"] = True
                return kept
        except (OSError, ValueError, AttributeError):
            pass
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT: every thread's Python stack, in each process
    log_file = work / f"{side}.log"
    t0 = time.time()
    # The side in a process group of its own, its output in a file: on a timeout every process of
    # the side (the engine and, at TP/PP > 1, vLLM's worker processes) first prints its Python
    # stacks into the log (SIGABRT, faulthandler), then is killed; no pipe is left for a process of
    # the side to hold open, and what a finished side left running is given 30 s to end (vLLM's
    # workers take ~5 s after the side's os._exit), then killed, before the next side starts.
    with open(log_file, "w") as fh:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(plan_file), side, str(out)],
                                stdout=fh, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=_dies_with_parent)
        try:
            code = proc.wait(timeout=timeout)
            _reap_group(proc.pid)  # what the side left running, given its time to end
        except subprocess.TimeoutExpired:
            code = "timeout"
            _dump_stacks(proc.pid)  # the stacks of a hung side, into its log
            time.sleep(2)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            _kill_group(proc.pid)  # and until every process of the side is gone
    log = log_file.read_text(errors="replace")
    if code == "timeout":
        log += f"\ntimed out after {timeout} s (the Python stacks of its processes above)"
        log_file.write_text(log)
    if not out.exists():
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return f"{side} run failed (exit {code}, log {work / (side + '.log')}): {tail[0][:300]}"
    result = json.loads(out.read_text())
    result["info"]["wall_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(result))  # with its wall time, for --reuse
    return result


# ----------------------------------------------------------------------------- judgement

def compare(a: list[dict], b: list[dict], tol: float, ties: list | None = None
            ) -> tuple[bool, float, str]:
    """(same, max logprob diff, detail) for the outputs of one case on two runs, `a` the reference.

    Same: identical greedy tokens and, at every step up to and including the first differing
    token, every token id both runs have in their top-k within `tol` of each other. With `ties`
    (a list), a differing token where `a`'s top-2 margin is <= `tol` (a tie at this precision) is
    appended there as (prompt, step, margin) instead of failing; the logprobs up to that step are
    still judged. Without it every differing token fails (e.g. the negative control)."""
    worst, notes = 0.0, []
    same = len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        tx, ty = x["tokens"], y["tokens"]
        first = next((k for k, (u, v) in enumerate(zip(tx, ty)) if u != v), None)
        if len(tx) != len(ty) and first is None:
            first = min(len(tx), len(ty))
        steps = len(tx) if first is None else first + 1
        for k in range(min(steps, len(x["logprobs"]), len(y["logprobs"]))):
            lx, ly = dict(map(tuple, x["logprobs"][k])), dict(map(tuple, y["logprobs"][k]))
            for t in lx.keys() & ly.keys():
                d = abs(lx[t] - ly[t])
                if d > worst:
                    worst = d
        if first is not None:
            lp = x["logprobs"][first] if first < len(x["logprobs"]) else []
            gap = lp[0][1] - lp[1][1] if len(lp) > 1 else None
            if ties is not None and gap is not None and gap <= tol:
                ties.append((i, first, gap))
                notes.append(f"prompt {i}: a tie at step {first} (top-2 margin {gap:.4f} <= {tol}),"
                             " not compared further")
                continue
            same = False
            margin = f", top-2 margin there {gap:.4f}" if gap is not None else ""
            notes.append(f"prompt {i}: tokens differ from step {first}{margin}")
    if worst > tol:
        same = False
        notes.append(f"logprob diff {worst:.4f} > {tol}")
    return same, worst, "; ".join(notes)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Exit: 0 identical and control changed, 1 different/failed/"
                                        "control unchanged/vacuous, 2 usage.")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="vLLM's GPU engine with default compilation/cudagraphs (default), or its "
                         "CPU engine (enforce_eager)")
    ap.add_argument("--long-tokens", type=int, help="length of the long case (default "
                    f"{DEFAULTS['cuda']['long_tokens']} on cuda, {DEFAULTS['cpu']['long_tokens']} on cpu)")
    ap.add_argument("--mixed", help="comma-separated prompt lengths of the mixed batch (default "
                    f"{DEFAULTS['cuda']['mixed']} on cuda, {DEFAULTS['cpu']['mixed']} on cpu)")
    ap.add_argument("--prefix-tokens", type=int, help="prompt of prefix-a (prefix-b extends it)")
    ap.add_argument("--window-tokens", type=int,
                    help="host-tier history attended per window (default: long-tokens / 8)")
    ap.add_argument("--budget-blocks", type=int, default=48,
                    help="streaming side's device KV blocks of 32 tokens, all layers together "
                         "(default 48: 1536 tokens)")
    ap.add_argument("--batched-tokens", type=int, default=256,
                    help="max_num_batched_tokens, both sides (default 256)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float16"), default="auto",
                    help="model dtype of both sides (default auto: bfloat16, except float16 on the "
                         "CPU engine of an AMX CPU, where bf16 runs vLLM's AMX kernel, whose tile "
                         "accumulation moves logprobs beyond the tolerance between batch shapes)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt")
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs compared per token")
    ap.add_argument("--tol", type=float,
                    help="max abs logprob difference, nats (default: the dtype's, "
                         "kvstack.testbed.precision.LOGPROB_TOL: " + ", ".join(
                             f"{k} {v}" for k, v in LOGPROB_TOL.items()) + ")")
    ap.add_argument("--qk-scale", type=float, default=16.0,
                    help="NoPE layer q_proj and k_proj weights scaled by this (default 16)")
    ap.add_argument("--o-scale", type=float, default=4.0,
                    help="NoPE layer o_proj weight scaled by this (default 4)")
    ap.add_argument("--lm-head-scale", type=float, default=8.0,
                    help="lm_head weight scaled by this (default 8)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="passed to vLLM on cuda (default: vLLM's)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="also run the streaming side at this tensor parallel size (vLLM's "
                         "multiprocess executor; on --device cpu one bound OpenMP thread per rank) "
                         "and the native side at the same size, and compare those two too "
                         "(default 1: not run)")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="also run the streaming side at this pipeline parallel size, each stage "
                         "streaming its own layers (with --tensor-parallel-size: one side of "
                         "TP x PP ranks; on --device cpu one bound OpenMP thread per rank) and "
                         "the native side the same way, and compare those two too (default 1: "
                         "not run)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a side's result from an earlier run in --work when that run had "
                         "the same plan (e.g. the single-rank streaming and native sides when a "
                         "second run only adds another parallel side)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per side (default 1500)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check-streaming",
                    help="scratch folder: models, plans, per-side results and logs")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        plan, side, out = args.child
        child(Path(plan), side, Path(out))
        return 0

    d = DEFAULTS[args.device]
    long_tokens = args.long_tokens or d["long_tokens"]
    try:
        mixed = [int(n) for n in (args.mixed or d["mixed"]).split(",") if n]
    except ValueError:
        ap.error("--mixed takes comma-separated integers")
    prefix = args.prefix_tokens or d["prefix"]
    window = args.window_tokens or max(PAGE, long_tokens // 8 // PAGE * PAGE)
    budget_tokens = args.budget_blocks * PAGE
    if not mixed or min(mixed + [prefix, long_tokens, window]) < 1:
        ap.error("prompt lengths and --window-tokens must be positive")
    if long_tokens // 2 <= window:
        ap.error(f"--long-tokens {long_tokens} must exceed two windows ({window}): the control "
                 "changes a token of its first half, which must be history of an earlier window")
    if long_tokens <= budget_tokens:
        ap.error(f"--long-tokens {long_tokens} fits the device budget ({budget_tokens} tokens): "
                 "the check is about prompts larger than the device KV")
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        ap.error("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.device == "cpu" and ranks > len(os.sched_getaffinity(0)):
        ap.error(f"--tensor-parallel-size {args.tensor_parallel_size} x --pipeline-parallel-size "
                 f"{args.pipeline_parallel_size} = {ranks} ranks need one CPU core each; "
                 f"this process may use {len(os.sched_getaffinity(0))}")
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # origin None: the checkout's vllm/ of pins, not vLLM
        print(f"error: vLLM is not importable with {sys.executable}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no GPU (use --device cpu)", file=sys.stderr)
            return 2

    from kvstack.testbed import tiny_models

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cases = make_cases(mixed, prefix, long_tokens)
    longest = max(len(p) for c in cases for p in c["prompts"])
    max_model_len = -(-(longest + args.max_tokens + 1) // PAGE) * PAGE
    base = tiny_models.make_model("llama4", work / "models" / "llama4")
    model = sharpen(base, work / "models" / "llama4-sharp", qk_scale=args.qk_scale,
                    o_scale=args.o_scale, lm_head_scale=args.lm_head_scale, max_pos=max_model_len)
    page_bytes = PAGE * 2 * 2 * 32 * 2  # tokens x (K, V) x kv heads x head_dim x bf16, one layer
    tier_pages = 4 * max_model_len // PAGE  # room for the batch and the cached prefixes
    dtype = args.dtype
    if dtype == "auto":  # bf16 (the model's), but float16 on an AMX CPU: see cpu_exactness_dtype
        dtype = (tiny_models.cpu_exactness_dtype() if args.device == "cpu" else None) or "bfloat16"
    if args.tol is None:
        args.tol = logprob_tol(dtype)
    if args.device == "cpu":
        print(f"host {describe_host()}", flush=True)
    print(f"dtype {dtype}" + (" (AMX CPU: vLLM's vec kernel; see kvstack.testbed.tiny_models."
                              "cpu_exactness_dtype)" if dtype == "float16" and args.dtype == "auto"
                              else "") + f"; tolerance {args.tol} nats", flush=True)
    plan = {"device": args.device, "model": str(model), "max_model_len": max_model_len,
            "python": sys.prefix,  # the venv, i.e. the base: --reuse never crosses bases
            "dtype": dtype,
            "max_num_seqs": args.max_num_seqs, "batched_tokens": args.batched_tokens,
            "budget_blocks": args.budget_blocks, "max_tokens": args.max_tokens,
            "logprobs": args.logprobs, "gpu_memory_utilization": args.gpu_memory_utilization,
            "streaming": {"window_tokens": window, "page_tokens": PAGE,
                          "host_tier_gib": tier_pages * page_bytes / 2**30,
                          "on_host_tier_full": "wait",
                          # on --device cpu too, the windowed path a GPU runs (the CPU engine
                          # would otherwise attend the host tier in place, cpu_native.py)
                          "cpu_native_attention": False},
            "cases": cases}
    layers = nope_layers(json.loads((model / "config.json").read_text()))
    print(f"device {args.device}; tiny llama4, NoPE layer(s) {layers}: q/k x{args.qk_scale:g}, "
          f"o x{args.o_scale:g}, lm_head x{args.lm_head_scale:g}; streaming: device budget "
          f"{args.budget_blocks} blocks ({budget_tokens} tokens), window {window}; max_model_len "
          f"{max_model_len}; prompts: mixed {mixed}, prefix {prefix}+{3 * PAGE + 7}, long "
          f"{long_tokens}; tolerance {args.tol} nats on the top-{args.logprobs} logprobs",
          flush=True)

    def show(side, r):
        if isinstance(r, str):
            # the end of the failed side's log (after a timeout: its processes' Python stacks)
            tail = (work / f"{side}.log").read_text(errors="replace").strip().splitlines()[-150:]
            print("\n".join([r, f"--- the last {len(tail)} lines of {side}.log:", *tail,
                             f"--- end of {side}.log"]), flush=True)
            return
        i = r["info"]
        print(f"{side:9s} {i.get('gpu', i['device'])}: compilation mode {i['compilation_mode']}, "
              f"cudagraph mode {i['cudagraph_mode']}, enforce_eager {i['enforce_eager']}, device "
              f"blocks {i['device_blocks']}, connector {i['connector']}; start {i['start_s']} s, "
              f"generate {i['generate_s']} s, wall {i['wall_s']} s"
              + (" (reused from an earlier run)" if i.get("reused") else ""), flush=True)

    # the streaming side first: it picks the control token; the native side then runs it too
    (work / "plan-streaming.json").write_text(json.dumps(plan))
    streaming = run_side(work / "plan-streaming.json", "streaming", work, args.timeout, args.reuse)
    show("streaming", streaming)
    if isinstance(streaming, str):
        print(f"RESULT 0/{len(cases) + 1} identical; the streaming run failed (logs in {work})")
        return 1
    control = streaming["info"]["control"]
    long = cases[-1]["prompts"][0]
    native_plan = dict(plan, control_pos=control["pos"],
                       cases=cases + [{"name": "control",
                                       "prompts": [control_prompt(long, control["pos"])]}])
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    parallel = par_native = None
    # the parallel sides' names and label: TP only, PP only, or both
    par_suffix = (f"-tp{tp}" if tp > 1 else "") + (f"-pp{pp}" if pp > 1 else "")
    par_side, par_native_side = "streaming" + par_suffix, "native" + par_suffix
    par_label = ", ".join([f"TP {tp}"] * (tp > 1) + [f"PP {pp}"] * (pp > 1))
    if tp * pp > 1:  # the same cases and control token at TP/PP > 1 (vLLM's workers in processes)
        # vLLM keeps PP batches in flight and reserves device KV for all of them (vLLM 0.32:
        # max_in_flight_tokens = PP x max_num_batched_tokens), so the PP side schedules
        # batched_tokens / PP per step: the same tokens in flight, the same device budget
        par_batched = max(PAGE, args.batched_tokens // pp)
        if pp > 1:
            print(f"{par_side}: max_num_batched_tokens {par_batched} ({args.batched_tokens} / PP "
                  f"{pp}: {pp} batches in flight fit the same {args.budget_blocks} device blocks)",
                  flush=True)
        par_plan = json.dumps(dict(native_plan, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                   batched_tokens=par_batched))
        for side in (par_side, par_native_side):  # streaming and native at the same TP/PP
            (work / f"plan-{side}.json").write_text(par_plan)
            got = run_side(work / f"plan-{side}.json", side, work, args.timeout,
                           args.reuse and side == par_native_side)
            show(side, got)
            if isinstance(got, str):
                print(f"RESULT 0/{len(cases) + 1} identical; the {side} run failed (logs in {work})")
                return 1
            if side == par_side:
                parallel = got
            else:
                par_native = got
    (work / "plan-native.json").write_text(json.dumps(native_plan))
    native = run_side(work / "plan-native.json", "native", work, args.timeout, args.reuse)
    show("native", native)
    if isinstance(native, str):
        print(f"RESULT 0/{len(cases) + 1} identical; the native run failed (logs in {work})")
        return 1

    failures = 0
    ties: list = []
    names = [c["name"] for c in native_plan["cases"]]
    # (label, streaming side, the native side of the same engine shape)
    sides = [("", streaming, native)] + (
        [(f" ({par_label})", parallel, par_native)] if parallel is not None else [])
    for (label, side, ref), name in ((s, n) for s in sides for n in names):
        same, worst, note = compare(ref["results"][name]["outputs"],
                                    side["results"][name]["outputs"], args.tol, ties)
        extra = ""
        if name == "prefix-b":
            hit = side["results"][name]["prefix_hit_tokens"]
            extra = f"; streaming side reused {hit} prefix tokens from its host tier"
            if hit <= 0:
                same = False
                note = (note + "; " if note else "") + "no prefix reuse on the streaming side"
        if side["results"][name]["failed"]:
            same = False
            note = (note + "; " if note else "") + "a request failed (host tier full)"
        failures += not same
        print(f"{name + label:9s} {'identical' if same else 'DIFFERENT'} (max logprob diff {worst:.4f})"
              f"{extra}{': ' + note if note else ''}", flush=True)

    # the negative control: one changed history token must change the streaming side's output
    unchanged, c_diff, c_note = compare(streaming["results"]["long"]["outputs"],
                                        streaming["results"]["control"]["outputs"], args.tol)
    changed = not unchanged
    n_unchanged, n_diff, _ = compare(native["results"]["long"]["outputs"],
                                     native["results"]["control"]["outputs"], args.tol)
    share = (f", {100 * control['share']:.1f}% of the output queries' attention"
             if control.get("share") is not None else "")
    print(f"control   token {control['pos']} of {long_tokens} ({control['how']}{share}) changed: "
          f"streaming output {'changed' if changed else 'UNCHANGED'} (max logprob diff "
          f"{c_diff:.4f}{'; ' + c_note if c_note else ''}); native "
          f"{'unchanged' if n_unchanged else 'changed'} (max logprob diff {n_diff:.4f})", flush=True)
    if parallel is not None:  # the control must be visible at TP/PP > 1 too
        tp_unchanged, tp_diff, _ = compare(parallel["results"]["long"]["outputs"],
                                           parallel["results"]["control"]["outputs"], args.tol)
        print(f"control ({par_label}) streaming output {'UNCHANGED' if tp_unchanged else 'changed'} "
              f"(max logprob diff {tp_diff:.4f})", flush=True)
        changed = changed and not tp_unchanged
    calls = streaming["info"].get("streaming_calls") or {}
    vacuous = ""
    if calls.get("installed"):
        print(f"streaming windowed-attention calls {calls['windowed_calls']}, up to "
              f"{calls['max_windows']} windows over {calls['max_history']} history tokens",
              flush=True)
        print(f"streaming packed calls (steps of several requests) {calls.get('packed_calls', 0)}: "
              f"windows in one varlen call {calls.get('varlen_calls', 0)}, refused by the kernel "
              f"{calls.get('varlen_refused', 0)} (varlen on a GPU only)", flush=True)
        if calls["max_windows"] < 2:
            vacuous = "; VACUOUS: no history was attended in more than one window"
    else:
        print("streaming windowed-attention calls: not counted (kvstack.streaming.worker_side."
              "windowed_attention not found)", flush=True)
    ok = failures == 0 and changed and not vacuous
    total = len(names) * len(sides)
    print(f"RESULT {total - failures}/{total} identical; control "
          f"{'changed' if changed else 'UNCHANGED'} ({args.device}, {dtype}, long {long_tokens}, "
          f"window {window}, tol {args.tol}, {len(ties)} tie(s)"
          + (f", streaming {par_label} vs native {par_label}" if parallel is not None else "")
          + f"){vacuous}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
