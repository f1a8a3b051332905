"""Never worse than stock, as a table: model families x KV connectors, stock vLLM + LMCache vs kvstack.

Issue 27's rule: whatever stock vLLM + LMCache of a base serves, kvstack serves with the same tokens,
and a repeat hits the cache at least as much. Each cell runs one tiny model of the family
(kvstack.testbed.tiny_models, shaped like the real ones) with one connector, the same prompt twice,
on two sides:

- ``stock``: the installed vLLM with kvstack's vLLM series taken out again (kvstack.release.overlay,
  reversed), but for the fixes of vLLM's CPU engine that stock needs to start there at all or to
  give the same tokens twice (CPU_ENGINE_FIXES).
  LMCache keeps kvstack's CPU path (stock LMCache has none on the CPU engine).
- ``kvstack``: the installed, patched vLLM.

Connectors: ``none`` (vLLM's defaults, its own prefix cache on), ``lmcache`` (LMCacheConnectorV1,
local CPU tier, vLLM's prefix cache off so a repeat's hit is LMCache's), ``mp`` (LMCacheMPConnector
with an LMCache MP server on 127.0.0.1 per side and chunk size, ``Family.mp_chunk``; the
Mamba-style hybrids in vLLM's "align" mode with a longer prompt, vLLM's prefix cache reset before
each run; default base only), ``streaming`` (kvstack's StreamingConnector on one full-attention
layer) and ``multi`` (MultiConnector: Streaming + LMCache). Stock has no StreamingConnector: those
cells compare kvstack's tokens with stock's ``none`` tokens (the output a user gets without the
feature).

A cell's verdict (``verdict``):

- ``pass``: kvstack served; its first run computed the whole prompt (nothing left over from another
  cell); the first run and the repeat gave stock's greedy tokens (the reference's); its repeat hit at least as many tokens as
  stock's (kvstack-only connectors: the hit is shown; StreamingConnector alone reuses its own
  layers' pages only, so the repeat's prompt is computed again for the other layers);
  the Mamba-style hybrids (``long_memory``: tiny models whose tokens depend on their recurrent
  state) run a third time in their LMCache cells with every restored state zeroed: that run must
  restore as much as the repeat and give other tokens (the negative control), or the cell fails;
- ``refused by upstream``: stock refused it and kvstack refuses too (for a kvstack-only connector:
  stock cannot run the model even without a connector);
- ``kvstack only``: stock refused it, kvstack serves it, its first run and its repeat with the
  tokens of stock's ``none`` (a full prefill);
- ``refused by design``: a kvstack-only connector refuses the configuration at start-up with its
  reason (stock cannot run it at all);
- ``fails on stock too``: both engines start and fail the first request with the same error (vLLM
  0.32's CPU Mamba2 path in the "align" mode the MP connector needs): not a regression of kvstack's,
  shown with the error so that it is not mistaken for a pass;
- ``FAIL``: anything else, above all stock serves and kvstack refuses or differs, or kvstack fails
  after start-up or its engine process dies (never a refusal).

One process per side runs its cells one engine after another, and prints a JSON line per cell. An
engine refused while starting is let go and the next cell runs in the same process; one that fails
after it started ends the process, and the driver starts a new one for the cells left. The test
(tests/env/test_family_table.py) renders the table into docs/family-table.md, one section per base:

    python -m kvstack.testbed.family_table publish   # docs/family-table.md from build/family-table/*.json
"""

from __future__ import annotations

import argparse
import contextlib
import re
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "build" / "family-table"
DOC = REPO / "docs" / "family-table.md"

# Kept in "stock": fixes of vLLM's CPU engine only, which a GPU user of stock never meets:
# - without the first, stock vLLM 0.32 cannot start any model on the CPU engine once LMCache is
#   imported (the CPU platform's Triton kernel-override scan calls vars() on numba's llvmlite
#   library object);
# - without the second, stock's CPU attention gives tokens that change from run to run for a model
#   with sliding-window and full layers in one KV cache group (the hybrid manager off, as vLLM
#   turns it off for LMCacheConnectorV1: gpt-oss) on CPUs without AMX, so no comparison with
#   stock could hold there.
CPU_ENGINE_FIXES = ("triton_utils-kernel-override-scan", "cpu_attn-a-KV-cache-group-with-mixed")


@dataclass(frozen=True)
class Family:
    name: str  # the family as a user knows it
    model: str  # a kvstack.testbed.tiny_models name
    streaming_layers: str  # the full-attention layer the streaming cells stream
    env: tuple[tuple[str, str], ...] = ()  # engine environment of every cell
    # a Mamba-style hybrid: the tiny model gets a long-memory recurrent state
    # (kvstack.testbed.long_memory), and its LMCache cells a zeroed-state control run
    long_memory: bool = False
    # the LMCache MP server's chunk for this model's "mp" cell: LMCache's MP connector needs a
    # multiple of vLLM's block size (the hybrids' attention blocks, MLA's 128 on AMX hosts)
    mp_chunk: int = 32


FAMILIES = (
    Family("dense GQA (Llama-3)", "llama", r"layers\.1\."),
    Family("MoE (Qwen3-MoE)", "qwen3_moe", r"layers\.1\."),
    Family("sliding window + full (Gemma-2)", "gemma2", r"layers\.1\."),
    # vLLM turns the hybrid manager off for chunked-local attention unless this variable is set;
    # with it, the model has chunked-local + full groups (what kvstack once refused with LMCache)
    Family("sliding window 5:1 (Gemma-3)", "gemma3", r"layers\.5\."),
    Family("chunked local + MoE (Llama-4)", "llama4", r"layers\.3\.",
           (("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "1"),)),
    # sliding window + full attention, both with sinks; the full layer is the one streamed
    Family("sliding window + sinks, MoE (gpt-oss)", "gpt_oss", r"layers\.1\."),
    Family("MLA (DeepSeek-V2)", "deepseek_v2", r"layers\.1\.", mp_chunk=128),
    Family("GDN hybrid + MoE (Qwen3-Next)", "qwen3next", r"layers\.3\.", long_memory=True,
           mp_chunk=384),
    Family("Mamba2 hybrid + MoE (Granite-4)", "granite4", r"layers\.3\.", long_memory=True,
           mp_chunk=128),
)
CONNECTORS = ("none", "lmcache", "mp", "streaming", "multi")
STOCK_CONNECTORS = ("none", "lmcache", "mp")  # stock vLLM has no StreamingConnector
CHUNK = 32  # LMCache chunk and streaming page, tokens
PROMPT = [(i * 53) % 900 + 3 for i in range(200)]  # 6 whole chunks of 32 + 8 tokens
# the "mp" cells of the Mamba-style hybrids: vLLM's align mode caches whole attention blocks (a few
# hundred tokens), so their prompt is longer than one (within the tiny models' 512 positions)
LONG_PROMPT = [(i * 53) % 900 + 3 for i in range(480)]
MAX_TOKENS = 8
MP_PORTS_ENV = "KVSTACK_FAMILY_MP_PORTS"  # {chunk: port} of the side's LMCache MP servers
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_DISABLE_BANNER": "1"}

PASS, UPSTREAM, UPSTREAM_FAULT, KVSTACK_ONLY, BY_DESIGN, FAIL = (
    "pass", "refused by upstream", "fails on stock too", "kvstack only", "refused by design",
    "FAIL")


def family(model: str) -> Family:
    return next(f for f in FAMILIES if f.model == model)


def _family_or_none(model: str) -> Family | None:
    return next((f for f in FAMILIES if f.model == model), None)


def prompt(model: str, connector: str) -> list[int]:
    """The prompt a cell runs (twice, or three times with the control)."""
    fam = _family_or_none(model)
    return LONG_PROMPT if connector == "mp" and fam is not None and fam.long_memory else PROMPT


def cells(side: str, models: list[str] | None = None, *, mp: bool = True) -> list[tuple[str, str]]:
    """(model, connector) of every cell `side` runs; without the "mp" column unless `mp` (the
    test runs it on the default base only: CI time)."""
    conns = [c for c in (STOCK_CONNECTORS if side == "stock" else CONNECTORS) if mp or c != "mp"]
    return [(f.model, c) for f in FAMILIES if models is None or f.model in models for c in conns]


def make_models(models: list[str], dest: Path) -> None:
    """Each tiny model in dest/<model>; a long-memory family's is the long-memory copy of the
    random one (made in dest/random/<model>): the random tiny hybrids forget their recurrent state
    within a token, so a zeroed or wrong restored state would give the same tokens."""
    from kvstack.testbed.long_memory import long_memory_copy
    from kvstack.testbed.tiny_models import make_model

    for model in models:
        if family(model).long_memory:
            long_memory_copy(model, make_model(model, dest / "random" / model), dest / model)
        else:
            make_model(model, dest / model)


def needs_control(model: str, connector: str) -> bool:
    """Whether the cell's repeat restores a recurrent state that the zeroed-state control checks."""
    fam = _family_or_none(model)
    return fam is not None and fam.long_memory and connector in ("lmcache", "multi")


def build_stock_overlay(dest: Path) -> Path:
    """Stock vLLM for the stock side: the installed vLLM with kvstack's vLLM series taken out again
    (an overlay in `dest`, for $KVSTACK_OVERLAY), but for CPU_ENGINE_FIXES."""
    import importlib.util

    from kvstack.release import overlay
    from kvstack.release.pins import load_pin

    site = Path(list(importlib.util.find_spec("vllm").submodule_search_locations)[0]).parent
    patches = [p for p in overlay.series_patches(load_pin("vllm").series_dir)
               if not any(k in p.name for k in CPU_ENGINE_FIXES)]
    overlay.build_overlay(patches, site, dest, reverse=True)
    return dest


# ----------------------------------------------------------------------------------------------
# The runner: one process, one side, cells one engine after another.
# ----------------------------------------------------------------------------------------------

def kv_transfer(connector: str, fam: Family) -> dict | None:
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if connector == "mp":
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": json.loads(
                                                  os.environ[MP_PORTS_ENV])[str(fam.mp_chunk)],
                                              "lmcache.mp.mq_timeout": 30}}
    streaming = {"kv_connector": "StreamingConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kvstack.streaming",
                 "kv_connector_extra_config": {"streaming_layers": [fam.streaming_layers],
                                               "page_tokens": CHUNK, "host_tier_gib": 0.05}}
    return {"none": None, "lmcache": lmcache, "streaming": streaming,
            "multi": {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"connectors": [streaming, lmcache]}}}[connector]


def _run_cell(model: str, connector: str, models_dir: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvstack.testbed.engine import reset_prefix_cache, shutdown_llm
    from kvstack.testbed.long_memory import zeroing_switch
    from kvstack.testbed.tiny_models import llm_kwargs

    fam = family(model)
    # LMCache's MP connector serves Mamba-style layers only in vLLM's "align" mode, which needs
    # vLLM's prefix cache (reset before each run instead, so a hit is LMCache's) and prefill steps
    # of at least a block (the hybrids' attention blocks are a few hundred tokens)
    align = connector == "mp" and fam.long_memory
    kw = llm_kwargs(model, models_dir / model, max_num_batched_tokens=512 if align else 64)
    if connector != "none":
        kw["enable_prefix_caching"] = align  # off: a repeat's hit is the connector's
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer(connector, fam))
    if align:
        kw["mamba_cache_mode"] = "align"
    start = time.monotonic()
    try:
        llm = LLM(**kw)
    except Exception as exc:
        exc.kvstack_phase = "start-up"
        raise
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    # the control runs on kvstack's side (stock's LMCacheConnectorV1 restores no hybrid state)
    control = needs_control(model, connector) and not os.environ.get("KVSTACK_OVERLAY")
    zero = zeroing_switch() if control else None
    tokens, cached = [], []
    for run in range(3 if control else 2):  # the third: the repeat again, restored states zeroed
        if zero is not None:
            zero[0] = run == 2
        if align and not reset_prefix_cache(llm):  # so that a hit is the connector's
            raise RuntimeError("vLLM's prefix cache could not be reset (blocks still held)")
        out = llm.generate([{"prompt_token_ids": prompt(model, connector)}], sp, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(int(out.num_cached_tokens or 0))
        if connector == "mp":  # its stores reach the MP server asynchronously: let them land
            _settle(llm)
    if zero is not None:
        zero[0] = False
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    vcfg = llm.llm_engine.vllm_config
    core = llm.llm_engine.engine_core.engine_core
    res = {"model": model, "connector": connector, "served": True, "tokens": tokens, "cached": cached,
           "groups": sorted({type(g.kv_cache_spec).__name__
                             for g in core.scheduler.kv_cache_config.kv_cache_groups}),
           "hma_off": bool(vcfg.scheduler_config.disable_hybrid_kv_cache_manager),
           # which LMCacheConnectorV1 ran: stock's does not support the hybrid manager
           "lmcache_supports_hma": issubclass(LMCacheConnectorV1, SupportsHMA),
           "seconds": round(time.monotonic() - start, 1)}
    del core
    shutdown_llm(llm)
    # LMCache keeps its engine in a process-wide registry that the connector's shutdown leaves
    # alone: the next cell's connector would get this one (another model's layout, its chunks).
    engines = sys.modules.get("lmcache.v1.cache_engine")
    if engines is not None:
        for instance in list(engines.LMCacheEngineBuilder._instances):
            engines.LMCacheEngineBuilder.destroy(instance)
    return res


def _release_engine_state() -> None:
    """What an engine that failed to start leaves in this process: vLLM's process groups and
    LMCache's engine registry (as _run_cell's teardown), then the garbage."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from kvstack.testbed.gc_heap import refreeze

    engines = sys.modules.get("lmcache.v1.cache_engine")
    if engines is not None:
        for instance in list(engines.LMCacheEngineBuilder._instances):
            engines.LMCacheEngineBuilder.destroy(instance)
    cleanup_dist_env_and_memory()
    gc.collect()
    refreeze()


def _settle(llm, seconds: float = 1.0) -> None:
    """Idle engine steps for `seconds`: a connector's asynchronous stores of the request just
    finished are reported and taken in (without it the stock side's MP repeat hit 0, 128 or 192
    of 200 tokens from one run to the next)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        llm.llm_engine.step()
        time.sleep(0.05)


def runner_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="family_table run")
    ap.add_argument("--models-dir", type=Path, required=True)
    ap.add_argument("cells", nargs="+", help="MODEL:CONNECTOR")
    args = ap.parse_args(argv)
    from kvstack.release import overlay

    overlay.install()  # $KVSTACK_OVERLAY: stock vLLM; before vLLM is imported
    from kvstack.testbed.tiny_models import apply_engine_env

    apply_engine_env()
    for k, v in LMCACHE_ENV.items():
        os.environ.setdefault(k, v)
    base_env = dict(os.environ)
    for cell in args.cells:
        model, connector = cell.split(":")
        os.environ.clear()
        os.environ.update(base_env, **dict(family(model).env))  # this family's variables only
        try:
            res = _run_cell(model, connector, args.models_dir)
        except Exception as exc:  # a refusal: say it
            traceback.print_exc()  # into the side's log (engines.log)
            msg = f"{type(exc).__name__}: {exc}".strip()
            phase = getattr(exc, "kvstack_phase", "serving")
            print("FAMILY-CELL " + json.dumps({"model": model, "connector": connector,
                                               "served": False, "error": msg[-1500:],
                                               "phase": phase}), flush=True)
            if phase != "start-up":
                _print_sources()
                os._exit(3)  # an engine that served may have left state: the next cells start anew
            res = None
        if res is None:
            # refused while starting (most refusals: a configuration check): its half-built engine
            # and process groups are let go (outside the except clause, whose traceback holds
            # them), and the next cell runs in this process: one process start (~10 s of imports)
            # saved per refusal
            _release_engine_state()
            continue
        print("FAMILY-CELL " + json.dumps(res), flush=True)
        if _memory_left_behind():
            break  # the cells left run in a new process (_run_cells)
    _print_sources()
    os._exit(0)  # skip slow engine/LMCache teardown


RSS_LIMIT_GB = float(os.environ.get("KVSTACK_FAMILY_RSS_LIMIT_GB", "3.5"))


def _memory_left_behind() -> bool:
    """After a served cell: collect what its engine left in reference cycles; True when this
    process still holds more than RSS_LIMIT_GB. Each engine leaves memory behind (measured on
    base 0.32: about a GiB per model's three cells even so, its LMCache cell most), so a runner
    of many cells grew to 9.4 GB and was OOM-killed in CI beside another engine test; a new
    process per 3.5 GB costs a process start (~10 s) every nine cells or so."""
    import gc

    gc.collect()
    try:
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return False
    if rss > RSS_LIMIT_GB * 2**30:
        print(f"FAMILY-RSS {rss / 2**30:.1f} GiB after a cell: the next cells in a new process",
              file=sys.stderr, flush=True)
        return True
    return False


def _print_sources() -> None:
    """The files of this repository the runner imported (what a cached stock side depends on)."""
    from kvstack.testbed.side_cache import imported_sources

    print("FAMILY-SOURCES " + json.dumps(imported_sources()), flush=True)


def run_stock_side(todo: list[tuple[str, str]], models_dir: Path, *, overlay_dir: Path, log: Path,
                   base: str) -> tuple[dict[tuple[str, str], dict], str]:
    """The stock side's results, and a line saying whether they were run or reused: reused
    (kvstack.testbed.side_cache) when the same cells ran before on this host with the same installed
    packages, overlay, tiny models and engine variables, and no file of this repository the stock
    runner imported has changed since; run (and kept for the next time) otherwise."""
    import importlib.util

    from kvstack.testbed import side_cache

    site = Path(list(importlib.util.find_spec("vllm").submodule_search_locations)[0]).parent
    inputs = side_cache.fixed_inputs(
        what="family-table stock side", cells=todo, extra={"base": base},
        trees={"vllm": site / "vllm", "lmcache": site / "lmcache", "overlay": overlay_dir,
               "models": models_dir})
    key = side_cache.key_of(inputs)
    if side_cache.enabled():
        hit = side_cache.load(key)
        if hit is not None:
            results, entry = hit
            return ({(r["model"], r["connector"]): r for r in results},
                    f"stock side reused from {side_cache.entry_path(key)} (run {entry['made']}; "
                    f"its inputs and the {len(entry['sources'])} files of this repository it "
                    f"imported are unchanged; {side_cache.SWITCH}=0 runs it)")
    sources: set[str] = set()
    results = run_side("stock", todo, models_dir, overlay_dir=overlay_dir, log=log, sources=sources)
    # kept unless a cell's result is an engine process that died before answering (it may not
    # happen again); a process that died after some cells answered leaves theirs, and the rest
    # ran again in a new process (every runner process imports the same files of this repository)
    if sources and not any(r.get("phase") == "died" for r in results.values()):
        path = side_cache.store(key, inputs, list(results.values()), sources)
        return results, f"stock side run; kept in {path}"
    return results, "stock side run (not kept: a cell's engine process died before answering)"


def run_side(side: str, todo: list[tuple[str, str]], models_dir: Path, *, overlay_dir: Path | None,
             log: Path, timeout: float = 900,
             sources: set[str] | None = None) -> dict[tuple[str, str], dict]:
    """Run `todo` on `side` (processes as needed); every cell gets a result. `sources` gets the
    files of this repository the runner processes imported."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTACK_OVERLAY"}
    env.update({"PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if overlay_dir is not None:
        env["KVSTACK_OVERLAY"] = str(overlay_dir)
    with contextlib.ExitStack() as stack:
        # the "mp" cells' LMCache MP servers, one per chunk size, for this side only
        from kvstack.testbed.backend_servers import free_port, lmcache_mp_server_cmd, running

        chunks = sorted({family(m).mp_chunk for m, c in todo if c == "mp"})
        ports = {}
        for chunk in chunks:
            ports[str(chunk)] = port = free_port()
            stack.enter_context(running(lmcache_mp_server_cmd(port, chunk), port,
                                        log.with_name(f"{log.stem}-mp-{side}-{chunk}.log"),
                                        {**env, "LMCACHE_DISABLE_BANNER": "1",
                                         "LMCACHE_TRACK_USAGE": "false"},
                                        timeout=90, what="LMCache MP server"))
        env[MP_PORTS_ENV] = json.dumps(ports)
        return _run_cells(todo, models_dir, env, log, timeout, sources)


def _run_cells(todo: list[tuple[str, str]], models_dir: Path, env: dict, log: Path,
               timeout: float, sources: set[str] | None = None) -> dict[tuple[str, str], dict]:
    results: dict[tuple[str, str], dict] = {}
    left = list(todo)
    with open(log, "a") as logf:
        while left:
            cmd = [sys.executable, "-m", "kvstack.testbed.family_table", "run",
                   "--models-dir", str(models_dir), *[f"{m}:{c}" for m, c in left]]
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
                out, err = proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as exc:
                out, err = (exc.stdout or b"").decode(), f"timed out after {timeout} s"
            logf.write(out + err)
            got = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines()
                   if ln.startswith("FAMILY-CELL ")]
            for res in got:
                results[(res["model"], res["connector"])] = res
            if sources is not None:
                for ln in out.splitlines():
                    if ln.startswith("FAMILY-SOURCES "):
                        sources.update(json.loads(ln.split(" ", 1)[1]))
            done = {(r["model"], r["connector"]) for r in got}
            if not done:  # died before its first cell answered: that cell failed
                results[left[0]] = {"model": left[0][0], "connector": left[0][1], "served": False,
                                    "error": "the engine process died: " + err.strip()[-1500:],
                                    "phase": "died"}
                done = {left[0]}
            left = [c for c in left if c not in done]
    return results


# ----------------------------------------------------------------------------------------------
# Verdicts and the rendered table.
# ----------------------------------------------------------------------------------------------

def _why(res: dict) -> str:
    """The refusal's own words, short: the last meaningful line of the error."""
    lines = [ln.strip(" -") for ln in res.get("error", "").splitlines() if ln.strip()]
    text = next((ln for ln in lines if "unsupported configuration" not in ln and len(ln) > 20),
                lines[-1] if lines else "?")
    text = re.sub(r"^\w+(Error|Exception|Configuration): ", "", text)
    text = re.sub(r" \(\[.*?\]\)", "", text)  # layer name lists
    text = text.split("; ")[0]  # the first clause says what; the log has the rest
    return text if len(text) <= 160 else text[:157] + "..."


def _numbers_out(text: str) -> str:
    return re.sub(r"\d+", "N", text)


def verdict(model: str, connector: str, stock: dict[tuple[str, str], dict],
            ours: dict[tuple[str, str], dict]) -> tuple[str, str]:
    """(verdict, detail) of one cell."""
    mine = ours[(model, connector)]
    kvstack_only = connector not in STOCK_CONNECTORS
    theirs = stock.get((model, connector), {})
    if (not mine["served"] and mine.get("phase") == "serving" and not theirs.get("served", True)
            and theirs.get("phase") == "serving"
            and _numbers_out(theirs.get("error", "")) == _numbers_out(mine.get("error", ""))):
        # stock's engine fails the same request with the same error (but for the indices, block
        # ids: they change from run to run): not a regression of ours
        return UPSTREAM_FAULT, _numbers_out(_why(mine))
    if not mine["served"] and mine.get("phase") != "start-up":  # never a refusal: a fault
        return FAIL, f"kvstack failed while {mine.get('phase')}: " + _why(mine)
    if mine["served"] and needs_control(model, connector):
        bad = _control_failure(mine)
        if bad:
            return FAIL, bad
        mine = {**mine, "tokens": mine["tokens"][:2], "cached": mine["cached"][:2]}
    ref = stock.get((model, "none" if kvstack_only else connector))
    if ref is None or not ref["served"]:
        if not mine["served"]:  # stock cannot run the model so (kvstack-only: not even without one)
            return UPSTREAM, _why(mine)
        none = stock.get((model, "none"))
        # the first run and the repeat (restored from the cache) against stock's full prefill
        if none and none["served"] and mine["tokens"] == [none["tokens"][0]] * 2:
            n = len(prompt(model, connector))
            return KVSTACK_ONLY, f"repeat {mine['cached'][1]}/{n} cached" + (
                CONTROLLED if needs_control(model, connector) else "")
        return FAIL, "stock refused it; kvstack serves other tokens than stock without a connector"
    if not mine["served"]:
        if kvstack_only:
            return BY_DESIGN, _why(mine)
        return FAIL, "stock serves, kvstack refuses: " + _why(mine)
    if mine["cached"][0] != 0:
        return FAIL, f"the first run found {mine['cached'][0]} tokens cached (left by another cell?)"
    # the first run and the repeat, each against stock's (a repeat from a cached prefix is compared
    # with stock's repeat, not with the first run: vLLM's CPU MLA backend's cached-context prefill
    # does not always give a full prefill's tokens, on stock too)
    if mine["tokens"] != ref["tokens"]:
        return FAIL, f"tokens differ from stock's: {mine['tokens']} vs {ref['tokens']}"
    need = 0 if kvstack_only else ref["cached"][1]  # streaming alone reuses no device prefix
    if mine["cached"][1] < need:
        return FAIL, f"the repeat hit {mine['cached'][1]} tokens, stock {ref['cached'][1]}"
    detail = f"repeat {mine['cached'][1]}/{len(prompt(model, connector))} cached"
    if not kvstack_only:
        detail += f" (stock {ref['cached'][1]})"
    if needs_control(model, connector):
        detail += CONTROLLED
    return PASS, detail


CONTROLLED = "; zeroed state: other tokens"


def _control_failure(mine: dict) -> str | None:
    """Why the zeroed-state control of a hybrid LMCache cell does not hold (None: it holds): the
    third run repeats the prompt with every restored state zeroed; it must restore as much as the
    repeat and give other tokens, or the repeat's comparison could not have failed."""
    if len(mine["tokens"]) < 3:
        return "the zeroed-state control did not run"
    if mine["cached"][1] == 0:
        return "the repeat restored nothing: the control checks no state"
    if mine["cached"][2] != mine["cached"][1]:
        return f"the zeroed-state run hit {mine['cached'][2]} tokens, the repeat {mine['cached'][1]}"
    if mine["tokens"][2] == mine["tokens"][1]:
        return ("the control failed: with the restored states zeroed the repeat gave the same "
                "tokens, so the comparison could not fail")
    return None


def host_class() -> str:
    """What of the host changes the table (vLLM's CPU engine picks other kernels and block sizes
    with AMX): "AMX" or "no AMX"."""
    from kvstack.testbed.precision import cpu_features

    return "AMX" if cpu_features()["amx"] else "no AMX"


def table(base: str, stock: dict, ours: dict, host: str = "") -> dict:
    """The table of one base as data (what is saved and rendered)."""
    rows = []
    conns = [c for c in CONNECTORS if any(k[1] == c for k in ours)]  # the columns that ran
    for fam in FAMILIES:
        if not any(m == fam.model for m, _ in ours):
            continue
        row = {"family": fam.name, "model": fam.model, "cells": {}}
        for c in conns:
            v, d = verdict(fam.model, c, stock, ours)
            row["cells"][c] = {"verdict": v, "detail": d}
        rows.append(row)
    # the raw results too (tokens, hits, groups, errors): what a FAIL is read from
    return {"base": base, "host": host, "connectors": conns, "rows": rows,
            "runs": {side: [{**r, "model": m, "connector": c} for (m, c), r in sorted(res.items())]
                     for side, res in (("stock", stock), ("kvstack", ours))}}


HEADERS = {"none": "no connector", "lmcache": "LMCacheConnectorV1",
           "mp": "LMCacheMPConnector (LMCache MP server)", "streaming": "StreamingConnector",
           "multi": "MultiConnector (Streaming + LMCache)"}


def render(tab: dict) -> str:
    """Markdown of one base's table (deterministic: no timings)."""
    host = f", CPU engine, {tab['host']}" if tab.get("host") else ""
    conns = tab.get("connectors", CONNECTORS)
    out = [f"<!-- family-table base {tab['base']} -->", f"### Base {tab['base']}{host}", "",
           "| family (tiny model) | " + " | ".join(HEADERS[c] for c in conns) + " |",
           "|---|" + "---|" * len(conns)]
    for row in tab["rows"]:
        cells = []
        for c in conns:
            cell = row["cells"][c]
            text = f"**{cell['verdict']}**" if cell["verdict"] == FAIL else cell["verdict"]
            cells.append(f"{text}: {cell['detail'].replace('|', '/')}")
        out.append(f"| {row['family']} (`{row['model']}`) | " + " | ".join(cells) + " |")
    out.append(f"<!-- end family-table base {tab['base']} -->")
    return "\n".join(out) + "\n"


def doc_section(base: str, text: str | None = None) -> str | None:
    """The committed section of `base` in docs/family-table.md (None: not there)."""
    text = DOC.read_text() if text is None else text
    start, end = f"<!-- family-table base {base} -->", f"<!-- end family-table base {base} -->"
    if start not in text or end not in text:
        return None
    a = text.index(start)
    return text[a:text.index(end) + len(end)] + "\n"


def publish(paths: list[Path]) -> str:
    """Replace (or add) each base's section of docs/family-table.md by its rendering."""
    text = DOC.read_text()
    for path in paths:
        tab = json.loads(path.read_text())
        new, old = render(tab), doc_section(tab["base"], text)
        if old is None:
            text = text.rstrip("\n") + "\n\n" + new
        else:
            text = text.replace(old, new)
    DOC.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return runner_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m kvstack.testbed.family_table",
                                 description="publish: write docs/family-table.md's sections from "
                                             "the tables the test saved (build/family-table/*.json)")
    ap.add_argument("command", choices=["publish"])
    ap.add_argument("tables", nargs="*", type=Path,
                    help="default: build/family-table/*.json (one per base)")
    args = ap.parse_args(argv)
    paths = args.tables or sorted(OUT_DIR.glob("*.json"))
    if not paths:
        ap.error(f"no tables in {OUT_DIR}: run the test first (pytest tests/env/test_family_table.py)")
    publish(paths)
    print(f"wrote {DOC.relative_to(REPO)} from {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
