"""Run a tiny model once on the CPU engine, optionally with LMCacheConnectorV1, and print JSON.

    python engine_run.py --model qwen3next --model-dir DIR [--lmcache] [--wipe] --prompts P.json
                         [--max-tokens N] [--max-num-batched-tokens N] [--max-model-len N] [--align]
                         [--prefix-caching]
                         [--zero-restored-state] [--kill-pgid PGID [--kill-before N]] [--batch]
                         [--with-streaming REGEX [--page-tokens N] [--zero-restored-kv-from N]]

Used by the tests (one engine per process, as a user would run it; tests/env/server takes its
offline reference tokens from it). With $KVSTACK_OVERLAY set (kvstack.release.overlay) it runs stock
vLLM: the installed one with kvstack's vLLM series taken out. LMCache's backend is chosen
with the usual LMCACHE_* environment variables. The last stdout line is JSON:
{"tokens": [[...], ...], "hits": [N, ...], "restored": [N, ...], "cached": [N, ...], "local": [N, ...],
"saved": [[N, ...], ...] (hybrid state positions saved per request), "block_size": N,
"groups": [spec class name, ...], "hma_off": bool, "lmcache_supports_hma": bool,
"hma_fallback_reason": str|null, "warnings": [...], "indexed": N|null} where hits are the external hit
tokens LMCache reported for each request (a prefix length), restored the hybrid states restored, cached the prompt tokens
not computed (vLLM's num_cached_tokens: its own prefix cache and LMCache's hits), local the tokens vLLM's
own prefix cache held when LMCache was asked, block_size vLLM's (align mode sizes it) and indexed the
chunk files the local disk backend indexed at start-up (null: no disk scan).

--with-streaming: kvstack's StreamingConnector streams the layers REGEX matches and LMCacheConnectorV1
keeps the others, both under vLLM's MultiConnector (joint prefix hits); the JSON then also has "groups"
(each KV cache group's spec and layers) and "streaming" (the StreamingConnector's stats()).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs  # noqa: E402


class _Tap(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(f"{record.levelname} {record.getMessage()}")
        except Exception:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--lmcache", action="store_true")
    ap.add_argument("--wipe", action="store_true", help="zero the engine's KV cache before each prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: llm_kwargs' (512)")
    ap.add_argument("--dtype", default=None, help="default: llm_kwargs' (the model's)")
    ap.add_argument("--align", action="store_true",
                    help="vLLM's own hybrid prefix caching too: enable_prefix_caching, "
                         "mamba_cache_mode='align' (hybrid models)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="vLLM's own prefix caching, kept on where vLLM's CPU platform turns it off "
                         "(MLA models): a reference for a repeat served from a cached prefix")
    ap.add_argument("--zero-restored-state", action="store_true",
                    help="negative control: zero every hybrid state LMCache restores (a mutation in "
                         "this process; the tokens must then differ)")
    ap.add_argument("--kill-pgid", type=int, default=None,
                    help="SIGKILL this process group (a backend server) mid-run, before prompt "
                         "--kill-before")
    ap.add_argument("--kill-before", type=int, default=1)
    ap.add_argument("--with-streaming", default=None, metavar="REGEX",
                    help="MultiConnector: StreamingConnector for these layers + LMCacheConnectorV1")
    ap.add_argument("--page-tokens", type=int, default=32, help="the StreamingConnector's page")
    ap.add_argument("--lmcache-extra", default=None, metavar="JSON",
                    help="kv_connector_extra_config of LMCacheConnectorV1 (a JSON object)")
    ap.add_argument("--batch", action="store_true",
                    help="all prompts in one generate call (a concurrent batch); hits, restored and "
                         "local then hold one entry, for the whole batch, and saved every position")
    ap.add_argument("--zero-restored-kv-from", type=int, default=None, metavar="N",
                    help="negative control: from prompt N on, zero the K/V LMCache restores")
    args = ap.parse_args(argv)

    from kvstack.release import overlay

    overlay.install()  # $KVSTACK_OVERLAY: stock vLLM (the series taken out); before vLLM is imported
    apply_engine_env()
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    tap = _Tap()
    logging.getLogger().addHandler(tap)
    import lmcache.logging as lml

    # LMCache's loggers do not propagate: tap each one as it is created (start-up lines included).
    make_logger = lml.init_logger

    def tapped_logger(name):
        logger = make_logger(name)
        logger.addHandler(tap)
        return logger

    lml.init_logger = tapped_logger
    for name in ("lmcache", "vllm"):
        logging.getLogger(name).addHandler(tap)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if args.zero_restored_state:
        from kvstack.testbed.long_memory import zeroing_switch

        zeroing_switch()[0] = True

    zero_kv = [False]
    if args.zero_restored_kv_from is not None:
        from lmcache.v1 import cache_engine

        retrieve = cache_engine.LMCacheEngine.retrieve

        def retrieve_zeros(self, tokens, mask=None, **kwargs):
            ret = retrieve(self, tokens, mask, **kwargs)
            if zero_kv[0] and ret is not None:
                _zero_blocks(kwargs["kvcaches"], kwargs["slot_mapping"][ret.to(torch.bool)], block_size)
            return ret

        cache_engine.LMCacheEngine.retrieve = retrieve_zeros

    if args.prefix_caching:
        _keep_prefix_caching()
    kw = llm_kwargs(args.model, args.model_dir, enable_prefix_caching=args.align or args.prefix_caching,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    if args.align:
        kw["mamba_cache_mode"] = "align"
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.with_streaming:
        kw["kv_transfer_config"] = KVTransferConfig(
            **with_streaming_config(args.with_streaming, args.page_tokens))
    elif args.lmcache:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both",
            kv_connector_extra_config=json.loads(args.lmcache_extra) if args.lmcache_extra else {})
    llm = LLM(**kw)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    # LMCache creates its loggers on import; tap them too.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).addHandler(tap)

    prompts = json.loads(Path(args.prompts).read_text())
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens, hits, restored, cached, local, saved = [], [], [], [], [], []
    if args.batch:  # one generate call: the requests run as a concurrent batch
        start = len(tap.lines)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        cached = [int(o.num_cached_tokens or 0) for o in outs]
        new = tap.lines[start:]
        hits = [sum(int(m.group(1)) for line in new
                    for m in [re.search(r"LMCache hit tokens: (\d+)", line)] if m)]
        saved = [[int(m.group(1)) for line in new
                  for m in [re.search(r"saved hybrid state at (\d+)", line)] if m]]
        prompts = []  # done
    for n, p in enumerate(prompts):
        zero_kv[0] = args.zero_restored_kv_from is not None and n >= args.zero_restored_kv_from
        if args.kill_pgid is not None and n == args.kill_before:
            os.killpg(args.kill_pgid, signal.SIGKILL)
            time.sleep(0.5)
        if args.wipe:
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            for kv in runner.kv_caches:
                for t in (kv if isinstance(kv, (list, tuple)) else [kv]):
                    t.zero_()
        start = len(tap.lines)
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
        cached.append(int(out[0].num_cached_tokens or 0))
        new = tap.lines[start:]
        h = [int(m.group(1)) for line in new for m in [re.search(r"LMCache hit tokens: (\d+)", line)] if m]
        hits.append(h[-1] if h else 0)
        r = [int(m.group(1)) for line in new for m in [re.search(r"restored hybrid state at (\d+)", line)] if m]
        restored.append(r[-1] if r else 0)
        saved.append([int(m.group(1)) for line in new
                      for m in [re.search(r"saved hybrid state at (\d+)", line)] if m])
        c = [int(m.group(1)) for line in new
             for m in [re.search(r"Inference Engine computed tokens: (\d+)", line)] if m]
        local.append(c[-1] if c else 0)
    warnings = [line for line in tap.lines if line.startswith(("WARNING", "ERROR"))]
    core = llm.llm_engine.engine_core.engine_core
    vcfg = llm.llm_engine.vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    fallback = getattr(LMCacheConnectorV1, "hma_fallback_reason", None)
    extra = {"groups": [type(g.kv_cache_spec).__name__
                        for g in core.scheduler.kv_cache_config.kv_cache_groups],
             "hma_off": bool(vcfg.scheduler_config.disable_hybrid_kv_cache_manager),
             # which LMCacheConnectorV1 ran: stock's has neither (an overlay took the series out)
             "lmcache_supports_hma": issubclass(LMCacheConnectorV1, SupportsHMA),
             "hma_fallback_reason": fallback(vcfg.model_config) if fallback else None}
    if args.with_streaming:
        extra["groups"] = [[type(g.kv_cache_spec).__name__, list(g.layer_names)]
                           for g in core.scheduler.kv_cache_config.kv_cache_groups]
        extra["streaming"] = [c.stats() for c in core.scheduler.connector._connectors
                              if hasattr(c, "stats")][0]
    indexed = [int(m.group(1)) for line in tap.lines for m in [re.search(r"Indexed (\d+) chunk", line)] if m]
    print(json.dumps({"tokens": tokens, "hits": hits, "restored": restored, "cached": cached, "local": local,
                      "saved": saved,
                      "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                      "warnings": warnings,
                      "indexed": indexed[-1] if indexed else None, **extra}))
    sys.stdout.flush()
    if args.lmcache or args.with_streaming:
        time.sleep(float(os.environ.get("KVSTACK_LMCACHE_FLUSH_S", "3")))  # async disk/remote puts
    os._exit(0)  # skip slow engine/LMCache teardown


def with_streaming_config(streaming_layers: str, page_tokens: int) -> dict:
    """--with-streaming's kv_transfer_config (docs/streaming-usage.md shows it for layers\\.1\\. and page 32)."""
    streaming = {"kv_connector": "StreamingConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kvstack.streaming",
                 "kv_connector_extra_config": {"streaming_layers": [streaming_layers],
                                               "page_tokens": page_tokens, "host_tier_gib": 0.05}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                streaming, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}]}}


def _keep_prefix_caching() -> None:
    """vLLM's CPU platform turns prefix caching (and chunked prefill) off for MLA models on its
    reference MLA backend; keep prefix caching on, so a repeat runs from vLLM's own cached prefix
    through the same cached-context prefill a connector's external hit takes."""
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__

    def keep(cls, vllm_config):
        update(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(keep)


def _zero_blocks(kv_caches, slots, block_size: int) -> None:
    """Zero the K and V of the blocks `slots` fall in, in each of vLLM's CPU KV caches ([2, blocks,
    ...] or [blocks, ...]); the prefixes LMCache restores here are whole blocks."""
    blocks = torch.unique(slots // block_size)
    for kv in kv_caches:
        for t in ([kv] if isinstance(kv, torch.Tensor) else kv):
            if t.shape[0] == 2:
                t[:, blocks] = 0
            else:
                t[blocks] = 0


if __name__ == "__main__":
    sys.exit(main())
