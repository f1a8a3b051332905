"""Run prompts through an offline LLM whose engine core is its own process, arming an LMCache load
fault (fault_site/sitecustomize.py) before the prompts that ask for one; print JSON.

    python short_load_run.py --model-dir DIR --prompts P.json [--faults F.json] [--lmcache]
                             [--max-tokens N] [--max-num-batched-tokens N] [--max-model-len N]
                             [--stall-pgid PGID --stall-before N --stall-s S --resume-before M]

F.json: one entry per prompt, null or "drop" / "raise" (needs $KVSTACK_FAULT_FLAG). Before each
prompt a marker line "@@PROMPT <n>" goes to stdout (run it with stderr on stdout: the engine core
shares both), so the engine's log lines can be told apart by prompt. The last line is "@@JSON " and
{"tokens": [[...], ...], "cached": [N, ...], "error": null | "<exception>"}; a prompt that raises
(an engine core that died) ends the run, its error in "error".

--stall-pgid: the LMCache backend server's process group is stopped (SIGSTOP) before prompt N and
continued (SIGCONT) S seconds later, whatever the run is doing; prompt M waits until it has been
continued (plus --resume-wait seconds). The JSON then also has "seconds" (each prompt's wall time)
and "stalled" (the prompts sent while the backend was stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--faults", default=None)
    ap.add_argument("--lmcache", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--stall-pgid", type=int, default=None)
    ap.add_argument("--stall-before", type=int, default=1)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--resume-before", type=int, default=None)
    ap.add_argument("--resume-wait", type=float, default=0.0)
    args = ap.parse_args(argv)

    from kvstack.release import overlay

    if not any(type(f).__name__ == "_Finder" for f in sys.meta_path):
        overlay.install()  # $KVSTACK_OVERLAY (sitecustomize usually did it already)
    apply_engine_env()
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    prompts = json.loads(Path(args.prompts).read_text())
    faults = json.loads(Path(args.faults).read_text()) if args.faults else [None] * len(prompts)
    kw = llm_kwargs("qwen3next", args.model_dir, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len,
                    enable_prefix_caching=False)  # mamba_cache_mode "none": every hit is LMCache's
    if args.lmcache:
        # vLLM's default kv_load_failure_policy is "fail" (the request fails, alone)
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                                                    kv_load_failure_policy="recompute")
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens, cached, seconds, stalled, error = [], [], [], [], None
    resumed = threading.Event()
    for n, (p, fault) in enumerate(zip(prompts, faults)):
        if fault:
            Path(os.environ["KVSTACK_FAULT_FLAG"]).write_text(fault)
        if args.stall_pgid is not None and n == args.stall_before:
            os.killpg(args.stall_pgid, signal.SIGSTOP)
            print(f"@@STOPPED backend before prompt {n}", flush=True)

            def cont():
                os.killpg(args.stall_pgid, signal.SIGCONT)
                print("@@CONTINUED backend", flush=True)
                resumed.set()

            threading.Timer(args.stall_s, cont).start()
        if n == args.resume_before:
            resumed.wait()
            time.sleep(args.resume_wait)
        if args.stall_pgid is not None and n >= args.stall_before and not resumed.is_set():
            stalled.append(n)
        print(f"@@PROMPT {n}", flush=True)
        t0 = time.monotonic()
        try:
            out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        except Exception as e:  # an engine core that died: EngineDeadError
            error = f"{type(e).__name__}: {e}"
            break
        seconds.append(time.monotonic() - t0)
        tokens.append(list(out[0].outputs[0].token_ids))
        cached.append(int(out[0].num_cached_tokens or 0))
    if args.stall_pgid is not None:
        resumed.wait()
    print("@@END", flush=True)
    print("@@JSON " + json.dumps({"tokens": tokens, "cached": cached, "error": error,
                                  "seconds": seconds, "stalled": stalled}))
    sys.stdout.flush()
    os._exit(0)  # skip slow engine/LMCache teardown (a dead engine core included)


if __name__ == "__main__":
    sys.exit(main())
