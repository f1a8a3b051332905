"""A hybrid request aborted between its LMCache lookup and its load: does the state its lookup held
stay behind? Offline engine in this process (the worker's connector is read directly); prints JSON.

    python abort_held_run.py --model-dir DIR [--model NAME] [--control] [--blocks N]

Prompt A is stored; request C then runs a long decode that keeps most of the KV cache; request B
(A + 140 tokens) is looked up (LMCache pins A's chunks and holds A's state for B's load) but cannot
be allocated, so it waits; B is aborted; C finishes. The JSON has the held states and pinned lookups
after B's lookup, after the abort's step and at the end, and C's tokens. --control: the worker does
nothing with the step's finished requests (what LMCache did before kvstack's patch), so B's pins
and state stay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs  # noqa: E402

A = [(i * 37) % 900 + 3 for i in range(160)]
B = A + [(i * 11) % 900 + 3 for i in range(140)]
C = [(i * 53) % 900 + 5 for i in range(200)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model", default="qwen3next", help="the tiny model's name (qwen3next, llama)")
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--blocks", type=int, default=None,
                    help="num_gpu_blocks_override (default: room for C's whole run plus one block)")
    ap.add_argument("--c-tokens", type=int, default=120)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's connector in this process
    os.environ.setdefault("LMCACHE_CHUNK_SIZE", "32")
    os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
    os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    apply_engine_env()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kw = llm_kwargs(args.model, args.model_dir, max_num_batched_tokens=256,
                    max_model_len=len(C) + args.c_tokens,
                    enable_prefix_caching=False,
                    kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1",
                                                        kv_role="kv_both"))
    if not args.blocks and "block_size" not in kw:
        ap.error(f"--blocks: {args.model} takes vLLM's block size (hybrid page alignment)")
    kw["num_gpu_blocks_override"] = args.blocks or -(-(len(C) + args.c_tokens) // kw["block_size"]) + 1
    llm = LLM(**kw)
    worker = get_kv_transfer_group()._lmcache_engine
    store, engine_pins = worker._hybrid_store, worker.lmcache_engine.lookup_pins
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    if args.control:
        # what LMCache did before kvstack's patch: the worker does nothing with finished requests
        worker.get_finished = lambda finished_req_ids: (None, None)  # noqa: E731
    sp = SamplingParams(temperature=0, max_tokens=8)
    llm.generate([{"prompt_token_ids": A}], sp, use_tqdm=False)  # A's K/V and state stored
    engine = llm.llm_engine
    engine.add_request("C", {"prompt_token_ids": C},
                       SamplingParams(temperature=0, max_tokens=args.c_tokens, ignore_eos=True))
    for _ in range(3):
        engine.step()  # C prefilled and decoding: it holds its blocks
    engine.add_request("B", {"prompt_token_ids": B}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # B looked up (its state held, A's chunks pinned), not allocated
    waiting = [r.request_id for r in sched.waiting]

    def held():  # a dense model has no hybrid state store
        states = store.held_stats() if store is not None else {}
        return {**states, "pinned_lookups": len(engine_pins)}

    after_lookup = held()
    engine.abort_request(["B"])
    engine.step()
    after_abort = held()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    print("@@JSON " + json.dumps({"waiting_after_lookup": waiting, "after_lookup": after_lookup,
                                  "after_abort": after_abort, "end": held(),
                                  "c_tokens": outs.get("C"), "blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
