#!/usr/bin/env python3
"""GPU check of the streaming connector's device scratch (issue 28, point 4): the KV cache memory
vLLM reports shrinks by the scratch, and the windowed path stays inside it.

Three engines of the tiny Llama-4 in turn (each alone on the device, since vLLM's memory profiling
fails when another process frees device memory meanwhile), eager, the same settings otherwise:

- native: no connector;
- streaming: the StreamingConnector with its estimated scratch S (kvstack/streaming/scratch.py),
  one long prompt served with KVSTACK_STREAMING_SCRATCH_PROBE=1: the worker side reports the
  peak it allocated per layer call beyond what it held before, and the staging buffers it
  allocated at start-up;
- control: the same connector with device_scratch_mib = S + --extra-mib: it must report exactly
  --extra-mib less KV cache memory than the streaming run (the comparison can fail).

Each engine's KV cache memory is read from its worker (available_kv_cache_memory_bytes, what vLLM
logs as "Available KV cache memory"). Verdicts:
  reserved   native - streaming == S within --tol-mib (different engines: profiling noise)
  control    streaming - control == --extra-mib within --tol-mib (the same engine but for the key)
  staging    bytes allocated at start-up == the plan's staging
  peak       the windowed path's peak per layer call <= the plan's attention part

  ci/gpu/check_scratch.py [--work DIR] [--prompt-tokens N] [--batched-tokens N] [--window-tokens N]
                          [--extra-mib M] [--tol-mib M] [--gpu-memory-utilization U] [--timeout S]
  ci/gpu/check_scratch.py --judge native.json streaming.json control.json   (CPU: the verdicts)

Exit status: 0 every verdict holds; 1 one fails or a run failed; 2 bad usage. Last line: RESULT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
PROBE_ENV = "KVSTACK_STREAMING_SCRATCH_PROBE"  # kvstack/streaming/worker_side.py


def child(plan_file: Path, side: str, out: Path) -> None:
    plan = json.loads(plan_file.read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the worker can be read
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the tiny Llama-4 has 4,096 positions; a longer prompt only sizes the step here (its tokens
    # are not compared), so vLLM is allowed past them
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    from kvstack.testbed import tiny_models

    tiny_models.apply_gpu_env()
    if side == "native":
        os.environ.pop(HMA_ENV, None)
    else:
        os.environ[HMA_ENV] = "1"
        os.environ[PROBE_ENV] = "1" if side == "streaming" else "0"
    from vllm import LLM, SamplingParams

    kw = tiny_models.llm_kwargs("llama4", plan["model"], max_model_len=plan["prompt_tokens"] + 16,
                                enable_prefix_caching=False, max_num_seqs=2,
                                max_num_batched_tokens=plan["batched_tokens"],
                                gpu_memory_utilization=plan["gpu_memory_utilization"],
                                async_scheduling=False)
    if side != "native":
        from vllm.config import KVTransferConfig

        extra = {"window_tokens": plan["window_tokens"], "page_tokens": 32,
                 "host_tier_gib": 1.0, "cpu_native_attention": False}
        if side == "control":
            extra["device_scratch_mib"] = plan["control_mib"]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StreamingConnector", kv_role="kv_both",
            kv_connector_module_path="kvstack.streaming", kv_connector_extra_config=extra)
    t0 = time.time()
    llm = LLM(**kw)
    info = {"side": side, "start_s": round(time.time() - t0, 1)}
    core = llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker.worker
    # the GPU worker's figure (vLLM's CPU worker sizes its cache from VLLM_CPU_KVCACHE_SPACE)
    kv = getattr(worker, "available_kv_cache_memory_bytes", None)
    info["kv_cache_memory"] = int(kv) if kv is not None else None
    info["num_blocks"] = core.scheduler.kv_cache_config.num_blocks
    if side != "native":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvstack.streaming.scratch import plan_for

        ws = get_kv_transfer_group()._worker
        p = ws.scratch or plan_for(llm.llm_engine.vllm_config)  # None: nothing reserved (CPU)
        info["plan"] = {"staging": p.staging, "attention": p.attention, "reference": p.reference,
                        "total": p.total, "describe": p.describe()}
        info["staged"] = sum(t.numel() * t.element_size() for tr in ws.transfer.made.values()
                             for pairs in tr._staging.values() for pair in pairs for t in pair)
        prompt = [(i * 7919) % 997 + 3 for i in range(plan["prompt_tokens"])]  # ids 0-2: special
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        info["peak"] = ws._probe_peak if side == "streaming" else None
    out.write_text(json.dumps(info))
    os._exit(0)  # skip engine teardown: the result is written


def run_side(plan_file: Path, side: str, work: Path, timeout: int) -> dict | str:
    out = work / f"scratch-{side}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        res = subprocess.run([sys.executable, __file__, "--child", str(plan_file), side, str(out)],
                             capture_output=True, text=True, env=env, timeout=timeout)
        log, code = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        log, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", "timeout"
    (work / f"scratch-{side}.log").write_text(log if isinstance(log, str) else str(log))
    if not out.exists():
        tail = [ln for ln in str(log).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return f"{side} run failed (exit {code}, log scratch-{side}.log): {tail[0][:300]}"
    return json.loads(out.read_text())


def judge(native: dict, streaming: dict, control: dict, extra_mib: float,
          tol_mib: float) -> list[tuple[str, bool, str]]:
    """(name, holds, detail) per verdict."""
    plan = streaming["plan"]
    s = plan["total"]
    if None in (native["kv_cache_memory"], streaming["kv_cache_memory"],
                control["kv_cache_memory"]):
        return [("reserved", False, "no KV cache memory figure (not a GPU worker)")]
    shrink = native["kv_cache_memory"] - streaming["kv_cache_memory"]
    ctl = streaming["kv_cache_memory"] - control["kv_cache_memory"]
    want_ctl = control["plan"]["total"] - s
    peak = streaming.get("peak")
    budget = plan["attention"] + plan["reference"]
    return [
        ("reserved", abs(shrink - s) <= tol_mib * MIB,
         f"native - streaming KV cache memory = {shrink / MIB:.2f} MiB; scratch {s / MIB:.2f} MiB "
         f"({plan['describe']}); tolerance {tol_mib:g} MiB"),
        ("control", abs(ctl - want_ctl) <= tol_mib * MIB and abs(want_ctl - extra_mib * MIB) <= MIB,
         f"streaming - control (device_scratch_mib {control['plan']['total'] / MIB:.2f}) = "
         f"{ctl / MIB:.2f} MiB, expected {want_ctl / MIB:.2f}"),
        ("staging", streaming.get("staged") == plan["staging"],
         f"allocated at start-up {streaming.get('staged')} bytes, planned {plan['staging']}"),
        ("peak", peak is not None and 0 < peak <= budget,
         f"windowed path's peak per layer call {peak} bytes "
         f"({(peak or 0) / MIB:.2f} MiB) of the planned {budget / MIB:.2f} MiB"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--extra-mib", type=float, default=512.0)
    ap.add_argument("--tol-mib", type=float, default=8.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per engine (default 200)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check-scratch")
    ap.add_argument("--judge", nargs=3, type=Path, metavar=("NATIVE", "STREAMING", "CONTROL"))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), args.child[1], Path(args.child[2]))
        return 0
    if args.judge:
        sides = [json.loads(p.read_text()) for p in args.judge]
    else:
        from kvstack.streaming.config import StreamingConfig
        from kvstack.testbed.tiny_models import make_model

        args.work.mkdir(parents=True, exist_ok=True)
        model = make_model("llama4", args.work / "models" / "llama4")
        plan = {"model": str(model), "prompt_tokens": args.prompt_tokens,
                "batched_tokens": args.batched_tokens, "window_tokens": args.window_tokens,
                "gpu_memory_utilization": args.gpu_memory_utilization}
        StreamingConfig.from_extra({"window_tokens": args.window_tokens})  # bad values: exit here
        plan_file = args.work / "scratch-plan.json"
        sides = []
        for side in ("native", "streaming", "control"):
            if side == "control":
                plan["control_mib"] = sides[1]["plan"]["total"] / MIB + args.extra_mib
            plan_file.write_text(json.dumps(plan))
            t0 = time.time()
            got = run_side(plan_file, side, args.work, args.timeout)
            if isinstance(got, str):
                print(got)
                print(f"RESULT run failed: {side}")
                return 1
            kv = got["kv_cache_memory"]
            print(f"{side:9s} KV cache memory {kv / MIB if kv is not None else float('nan'):.2f} MiB, "
                  f"{got['num_blocks']} blocks; start {got['start_s']} s, wall "
                  f"{time.time() - t0:.1f} s", flush=True)
            sides.append(got)
    verdicts = judge(*sides, args.extra_mib, args.tol_mib)
    for name, ok, detail in verdicts:
        print(f"{name:9s} {'holds' if ok else 'FAILS'}: {detail}")
    bad = [n for n, ok, _ in verdicts if not ok]
    print(f"RESULT {len(verdicts) - len(bad)}/{len(verdicts)} hold"
          + (f"; failing: {', '.join(bad)}" if bad else "")
          + f" (scratch {sides[1]['plan']['total'] / MIB:.2f} MiB)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
