"""Run one engine (a tiny model on the CPU engine, kvstack's StreamingConnector) in its own process
and print JSON: the engine of tests/env/streaming/test_shared_tier.py.

    python shared_tier_run.py --model-dir DIR --prompts P.json [--lmcache JSON] [--page-tokens N]
                              [--max-tokens N] [--max-model-len N] [--max-num-batched-tokens N]
                              [--kill-pgid PGID --kill-before N] [--mutate-prompt N]

Each prompt is run alone, after one long warm-up prompt (kernels, allocator; in engine B a
shared-tier hit as the engine's first request), through the engine's
step loop, so its TTFT (add_request to the first generated token) is measured as a user would see
it. The last stdout line is JSON: {"tokens": [[...]], "ttft": [s, ...], "hit": [tokens, ...],
"stats": {...}, "warnings": [...], "config": {kv_transfer_config as JSON}}, where hit is the prefix
the connector reported (vLLM's num_cached_tokens) and stats the connector's host/shared tier
counters after the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs  # noqa: E402


class _Tap(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--name", default="llama4", help="tiny model recipe the engine runs it as")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--lmcache", default=None, help="JSON: the connector's 'lmcache' dict")
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kill-pgid", type=int, default=None,
                    help="SIGKILL this process group (the backend server) before prompt "
                         "--kill-before")
    ap.add_argument("--kill-before", type=int, default=0)
    ap.add_argument("--mutate-prompt", type=int, default=None,
                    help="negative control: while this prompt runs, every page restored from the "
                         "shared tier is zeroed before it reaches the host tier (a mutation in "
                         "this process; the tokens must then differ)")
    args = ap.parse_args(argv)

    apply_engine_env()
    os.environ["VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"] = "1"
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    tap = _Tap()
    logging.getLogger().addHandler(tap)
    for name in ("kvstack", "lmcache", "vllm"):
        logging.getLogger(name).addHandler(tap)
    try:
        import lmcache.logging as lml

        make_logger = lml.init_logger

        def tapped_logger(name):  # LMCache's loggers do not propagate
            logger = make_logger(name)
            logger.addHandler(tap)
            return logger

        lml.init_logger = tapped_logger
    except ImportError:
        pass

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    mutate = {"on": False}
    if args.mutate_prompt is not None:
        import torch

        from kvstack.streaming import worker_side

        load = worker_side._WorkerSide._load_pages

        def load_zeroed(self, loads):
            if mutate["on"]:  # (a permutation of the pages would not do: layer 3 is NoPE)
                loads = [(page, torch.zeros_like(p)) for page, p in loads]
            load(self, loads)

        worker_side._WorkerSide._load_pages = load_zeroed

    extra = {"page_tokens": args.page_tokens}
    if args.lmcache:
        extra["lmcache"] = json.loads(args.lmcache)
    ktc = dict(kv_connector="StreamingConnector", kv_role="kv_both",
               kv_connector_module_path="kvstack.streaming", kv_connector_extra_config=extra)
    kw = llm_kwargs(args.name, args.model_dir, enable_prefix_caching=False,
                    max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_transfer_config=KVTransferConfig(**ktc))
    if args.dtype:
        kw["dtype"] = args.dtype
    llm = LLM(**kw)
    engine = llm.llm_engine
    connector = engine.engine_core.engine_core.scheduler.connector
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(req_id: str, prompt: list[int]):
        t0 = time.perf_counter()
        engine.add_request(req_id, {"prompt_token_ids": prompt}, sp)
        ttft, out = None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != req_id:
                    continue
                if ttft is None and o.outputs and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    out = o
        return list(out.outputs[0].token_ids), ttft, int(out.num_cached_tokens or 0)

    # warm-up: a long prompt, the same in every engine, as the engine's first request: where an
    # earlier engine stored it, a shared-tier hit, so vLLM's CPU attention kernel meets a cached
    # prefix in its very first call (an SIGILL seen once in an AMX run here, while another
    # process rebuilt the venv, did not come back in four runs of this test on both bases)
    run("warmup-long", [3 + (i * 7 + 9 * 13 + 3) % 1000 for i in range(3900)])
    prompts = json.loads(Path(args.prompts).read_text())
    tokens, ttfts, hits = [], [], []
    for n, p in enumerate(prompts):
        if args.kill_pgid is not None and n == args.kill_before:
            os.killpg(args.kill_pgid, signal.SIGKILL)
            time.sleep(0.5)
        mutate["on"] = n == args.mutate_prompt
        t, ttft, hit = run(f"p{n}", p)
        tokens.append(t)
        ttfts.append(ttft)
        hits.append(hit)
    stats = connector.stats()
    shared = getattr(connector._sched, "shared", None)
    if shared is not None:
        shared.close()  # waits for LMCache's puts in flight (also done at exit)
    print(json.dumps({"tokens": tokens, "ttft": ttfts, "hit": hits, "stats": stats,
                      "warnings": [x for x in tap.lines if x.startswith(("WARNING", "ERROR"))],
                      "config": ktc}))
    sys.stdout.flush()
    os._exit(0)  # skip the engine's slow teardown


if __name__ == "__main__":
    sys.exit(main())
