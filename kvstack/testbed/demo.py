"""`kvstack demo`: what kvstack adds to vLLM, side by side with upstream vLLM in the same run.

Two comparisons on the CPU engine with tiny random-weight models (kvstack.testbed.tiny_models), each engine
in its own process:

1. Streaming attention + KV paging (tiny Llama-4). A long prompt at a device KV budget where
   upstream vLLM refuses to start (its own error is caught and quoted) is served by kvstack's
   StreamingConnector, and its greedy tokens are compared with an upstream run given enough memory.
2. LMCache with hybrid state restore (tiny Qwen3-Next). A repeated prompt is served from LMCache
   (K/V + gated delta-net state restored): hit tokens, TTFT against recomputing the same prompt
   without LMCache, and the greedy tokens of both. Upstream vLLM refuses LMCache's connector on a
   hybrid model (its error is quoted too).

"Upstream" is, by default, the installed vLLM with kvstack's vLLM patch series taken out again: an
overlay (kvstack/release/overlay.py) of the files the series touches, with every patch reversed, put in front
of the installed package in the upstream processes. Where that overlay cannot be built,
`--upstream installed` (the fallback, said so in the output) runs the installed, patched vLLM
without any KV connector: kvstack's vLLM patches do nothing without one.

The output is one `[i/N] ...` line per step, a summary table, and a last line
`RESULT ok ...` (exit 0) or `RESULT FAIL ...` (exit 1) naming what failed.

`kvstack demo --simple` is the former demo: greedy generation of a few tokens through the
installed engine, ending with a line `generated: <text>`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvstack.testbed import tiny_models
from kvstack.testbed.engine import track_peak_device_blocks

DEFAULT_MAX_TOKENS = 16
DEFAULT_WORK = Path("build") / "demo"
HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
CHILD_TIMEOUT_S = 600

# Streaming: tiny Llama-4 at a device budget of 16 blocks of 32 tokens (num_gpu_blocks_override).
# kvstack's four one-layer KV groups share the 16 blocks (16 x 8 KiB); upstream, which runs the
# chunked-local layers as full attention in one group, gets 16 blocks of all four layers (4x the
# bytes). A request of max_model_len needs far more than that under upstream.
STREAM_BUDGET_BLOCKS = 16
STREAM_BLOCK_BYTES = 32 * 2 * 2 * 32 * 2  # tokens x (K,V) x kv_heads x head_dim x bf16, one layer
STREAM_LAYERS = 4
STREAM_PROMPT = 3000
STREAM_MAX_LEN = 4096
STREAM_MAX_TOKENS = 8
STREAM_CONFIG = {"window_tokens": 256, "host_tier_gib": 0.1}

# LMCache: tiny Qwen3-Next; LMCache chunk = scheduler step, so a state is saved at every chunk.
LMC_CHUNK = 256
LMC_PROMPT = 15 * LMC_CHUNK + 8  # a repeat restores 15 chunks and computes 8 tokens
LMC_MAX_LEN = 4096
LMC_REPS = 5


def _printable(text: str) -> str:
    """`text` on one line: control and other unprintable characters shown as escapes."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _say(step: int, total: int, message: str) -> None:
    print(f"[{step}/{total}] {message}", flush=True)


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """A fixed prompt of n token ids (the tiny models' vocabulary is 1024; ids < 3 are special)."""
    return [3 + (i * 37 + salt * 101) % 900 for i in range(n)]


# --------------------------------------------------------------------------------------------
# Child process: one engine, one task, a JSON result file.
# --------------------------------------------------------------------------------------------

def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    from kvstack.release import overlay

    overlaid = overlay.install()  # $KVSTACK_OVERLAY: the upstream side
    tiny_models.apply_engine_env()
    result: dict = {"pid": os.getpid()}
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    result["import_s"] = time.perf_counter() - t0
    result["vllm_version"] = vllm.__version__
    result["streaming_hooks"] = hasattr(KVConnectorBase_V1, "get_kv_paging_window")
    root = str(Path(os.environ[overlay.ENV]).resolve()) if overlaid else ""
    result["overlaid_modules"] = sorted(
        n for n, m in list(sys.modules.items())
        if overlaid and str(getattr(m, "__file__", "") or "").startswith(root))

    kw = tiny_models.llm_kwargs(spec["model"], spec["model_dir"], **spec["llm"])
    if spec.get("connector") == "streaming":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StreamingConnector", kv_role="kv_both",
            kv_connector_module_path="kvstack.streaming",
            kv_connector_extra_config=spec["connector_config"])
    elif spec.get("connector") == "lmcache":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both",
            kv_connector_extra_config=spec["connector_config"])
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        result.update(started=False, start_s=time.perf_counter() - t0,
                      error=f"{type(e).__name__}: {e}")
        out.write_text(json.dumps(result))
        os._exit(0)
    result.update(started=True, start_s=time.perf_counter() - t0)
    restored: list[str] = []
    if spec.get("connector") == "lmcache":
        import logging

        class _Grab(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "restored hybrid state" in msg:
                    restored.append(msg)

        # LMCache's logger exists once the engine has started (its init clears handlers); its
        # own handlers keep their level, so nothing more is printed.
        lg = logging.getLogger("lmcache.integration.vllm.vllm_v1_adapter")
        for h in lg.handlers:
            h.setLevel(max(h.level, lg.level))
        lg.setLevel(logging.INFO)
        lg.addHandler(_Grab(logging.INFO))
    core = llm.llm_engine.engine_core.engine_core
    result["device_blocks"] = core.scheduler.kv_cache_config.num_blocks

    def gen(ids: list[int], max_tokens: int):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return o, time.perf_counter() - t

    task = spec["task"]
    if task == "long":
        ids = prompt_ids(spec["prompt_tokens"])
        sched = core.scheduler
        with track_peak_device_blocks(llm) as peak:
            o, dt = gen(ids, spec["max_tokens"])
        result.update(tokens=list(o.outputs[0].token_ids), gen_s=dt, peak_device_blocks=peak[0],
                      prompt_tokens=len(o.prompt_token_ids or ids))
        conn = getattr(sched, "connector", None)
        if conn is not None and hasattr(conn, "stats"):
            result["connector_stats"] = conn.stats()
    elif task == "repeat":
        n = spec["prompt_tokens"]
        gen(prompt_ids(n, salt=7), 1)  # warm-up, another prompt of the same length
        ids = prompt_ids(n)
        o, dt = gen(ids, spec["max_tokens"])  # the first time: computed (and stored by LMCache)
        result.update(first_tokens=list(o.outputs[0].token_ids), first_s=dt,
                      first_cached=o.num_cached_tokens)
        ttfts, cached, tokens = [], [], []
        for _ in range(spec["reps"]):
            o, dt = gen(ids, 1)  # TTFT: the whole request with one output token
            ttfts.append(dt)
            cached.append(o.num_cached_tokens)
        o, _ = gen(ids, spec["max_tokens"])
        tokens = list(o.outputs[0].token_ids)
        cached.append(o.num_cached_tokens)
        result.update(repeat_s=ttfts, repeat_cached=cached, tokens=tokens, restored=restored)
    out.write_text(json.dumps(result))
    os._exit(0)  # skip the engine's teardown: the result is written


# --------------------------------------------------------------------------------------------
# Parent: runs the children, compares, prints.
# --------------------------------------------------------------------------------------------

class Runner:
    def __init__(self, work: Path, verbose: bool, overlay_dir: Path | None):
        self.work = work
        self.verbose = verbose
        self.overlay_dir = overlay_dir

    def run(self, name: str, spec: dict, *, upstream: bool, env: dict | None = None) -> dict:
        """Run one engine in a child process; its result dict (with 'log' and 'wall_s')."""
        out = self.work / f"{name}.json"
        log = self.work / f"{name}.log"
        out.unlink(missing_ok=True)
        spec = dict(spec, out=str(out))
        spec_path = self.work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        child_env = {k: v for k, v in os.environ.items() if k != "KVSTACK_OVERLAY"}
        child_env.pop(HMA_ENV, None)
        if upstream and self.overlay_dir is not None:
            child_env["KVSTACK_OVERLAY"] = str(self.overlay_dir)
        child_env.update(env or {})
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            try:
                proc = subprocess.run([sys.executable, "-m", "kvstack.testbed.demo", "--child", str(spec_path)],
                                      stdout=fh, stderr=subprocess.STDOUT, env=child_env,
                                      timeout=CHILD_TIMEOUT_S)
                code = str(proc.returncode)
            except subprocess.TimeoutExpired:
                code = f"nothing: killed after {CHILD_TIMEOUT_S} s"
        wall = time.perf_counter() - t0
        if self.verbose:
            sys.stdout.write(log.read_text())
        if not out.exists():
            tail = log.read_text().strip().splitlines()[-5:] or ["no output"]
            return {"crashed": True, "wall_s": wall, "log": str(log),
                    "error": f"the engine process exited with {code} without a result "
                             f"(log: {log}); last lines:\n    " + "\n    ".join(tail)}
        res = json.loads(out.read_text())
        res.update(wall_s=wall, log=str(log), crashed=False)
        if upstream and self.overlay_dir is not None and not res["overlaid_modules"]:
            res.update(crashed=True, error="the upstream overlay was not imported")
        elif upstream and self.overlay_dir is not None and res["streaming_hooks"]:
            res.update(crashed=True, error="the upstream side still has kvstack's streaming hooks")
        return res


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _vllm_version() -> str:
    """The pinned vLLM release of the base in effect (the installed one, in a kvstack venv)."""
    from kvstack.release.pins import load_pin

    return load_pin("vllm").version


def build_upstream_overlay(work: Path) -> tuple[Path | None, str]:
    """The overlay with kvstack's vLLM series taken out; (folder, description) or (None, why not)."""
    from kvstack.release import overlay
    from kvstack.release.pins import load_pin

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "vLLM is not importable"
    site = Path(list(spec.submodule_search_locations)[0]).parent
    try:
        patches = overlay.series_patches(load_pin("vllm").series_dir)
        dest = work.resolve() / "upstream-overlay"
        files = overlay.build_overlay(patches, site, dest, reverse=True)
    except (OSError, RuntimeError) as e:
        return None, _one_line(str(e))
    gone = [rel for rel in files if not (dest / rel).exists()]
    # A file a patch added is removed from the overlay but stays installed: nothing upstream
    # imports it (the reversed files no longer name it).
    extra = f"; {len(gone)} file(s) the series adds stay installed, unused" if gone else ""
    return dest, (f"vLLM {load_pin('vllm').version} as released: the installed vLLM with kvstack's {len(patches)} vLLM "
                  f"patches taken out again (git apply -R into an overlay of the {len(files)} "
                  f"file(s) they touch, {dest}, put in front of the installed package{extra})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstack demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Show what kvstack adds to vLLM, side by side with upstream vLLM in the same run, on
            tiny random-weight models and the CPU engine (each engine in its own process):
              streaming  a long prompt at a device KV budget where upstream vLLM refuses to start,
                         served by kvstack's StreamingConnector (tiny Llama-4), with the greedy
                         tokens of upstream given enough memory
              lmcache    a repeated prompt served from LMCache with the hybrid (gated delta-net)
                         state restored (tiny Qwen3-Next): hit tokens, TTFT against recompute,
                         the same greedy tokens
            Ends with a summary table and a line 'RESULT ok ...' (exit 0) or 'RESULT FAIL ...'
            (exit 1: tokens differ, upstream started where it should refuse, no LMCache hit).
            --simple runs the former demo instead: a short greedy generation, ending with a
            line 'generated: <text>'."""),
    )
    parser.add_argument("--only", choices=("streaming", "lmcache"),
                        help="run one of the two comparisons (default: both)")
    parser.add_argument("--upstream", choices=("overlay", "installed"), default="overlay",
                        help="what 'upstream' runs: 'overlay' (default) = the installed vLLM with "
                             "kvstack's vLLM patches taken out again; 'installed' = the installed, "
                             "patched vLLM without any KV connector (the patches are inert then)")
    parser.add_argument("--cache-dir", default=str(tiny_models.DEFAULT_OUT),
                        help="where tiny models are written and reused (default: %(default)s)")
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK),
                        help="scratch folder: overlay, per-engine logs and results, LMCache's "
                             "hybrid state (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="keep vLLM's INFO log lines and print each engine's log")
    simple = parser.add_argument_group("the former demo")
    simple.add_argument("--simple", action="store_true",
                        help="greedy generation with one model in this process, ending with "
                             "'generated: <text>'")
    simple.add_argument("--model", choices=tiny_models.MODEL_NAMES, default="llama",
                        help="--simple: which tiny model to run (default: %(default)s)")
    simple.add_argument("--prompt", default=tiny_models.DEMO_PROMPT,
                        help="--simple: prompt text (default: a fixed sentence)")
    simple.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="--simple: tokens to generate (default: %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    if args.simple:
        if args.max_tokens < 1:
            parser.error("--max-tokens must be at least 1")
        return simple_demo(args)
    return compare_demo(args)


# --------------------------------------------------------------------------------------------
# The comparison demo.
# --------------------------------------------------------------------------------------------

class Report:
    """What the steps found: table rows, upstream's quoted errors, failures, the RESULT fields."""

    def __init__(self, total: int):
        self.total, self.step = total, 0
        self.rows: list[tuple[str, str, str, str]] = []
        self.quotes: list[tuple[str, str]] = []
        self.failures: list[str] = []
        self.fields: list[str] = []

    def say(self, msg: str) -> None:
        self.step += 1
        _say(self.step, self.total, msg)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)


def _engine_error(res: dict) -> str:
    return _short(_one_line(res.get("error") or "no result"), 400)


def compare_demo(args) -> int:
    t_start = time.perf_counter()
    parts = [args.only] if args.only else ["streaming", "lmcache"]
    overlay_mode = args.upstream == "overlay"
    total = 2 + 3 * ("streaming" in parts) + (2 + overlay_mode) * ("lmcache" in parts)
    rep = Report(total)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    # 1. Models and environment.
    names = (["llama4"] if "streaming" in parts else []) + (["qwen3next"] if "lmcache" in parts else [])
    dirs, how = {}, []
    for name in names:
        dest = Path(args.cache_dir) / name
        was = tiny_models.is_current(name, dest)
        t0 = time.perf_counter()
        dirs[name] = tiny_models.make_model(name, dest)
        how.append(f"{name} at {dirs[name]} "
                   f"({'reused' if was else f'wrote in {time.perf_counter() - t0:.1f} s'})")
    added = tiny_models.apply_engine_env()
    defaults = {
        # LMCache's chunk keys hash token ids with Python's hash(): the same in every process.
        "PYTHONHASHSEED": "0",
        # One unbound OpenMP thread per engine: steady timings on a small shared machine
        # (tiny models gain nothing from more threads).
        "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # No usage reports to vLLM's or LMCache's servers: the demo runs offline.
        "DO_NOT_TRACK": "1",
    }
    if not args.verbose:
        defaults["VLLM_LOGGING_LEVEL"] = "WARNING"
    for k, v in defaults.items():
        if k not in os.environ:
            os.environ[k] = added[k] = v
    shown = ", ".join(f"{k}={os.environ[k]}" + ("" if k in added else " (yours)")
                      for k in [*tiny_models.ENGINE_ENV, *defaults] if k in os.environ)
    rep.say(f"models: {'; '.join(how)}; environment of every engine process: {shown}")

    # 2. What "upstream" is.
    overlay_dir = None
    if overlay_mode:
        overlay_dir, what = build_upstream_overlay(work)
        if overlay_dir is None:
            print(f"error: cannot take kvstack's patches out of the installed vLLM ({what}); "
                  "run with --upstream installed to compare with the installed vLLM without a "
                  "KV connector instead", file=sys.stderr)
            return 2
        upstream_is, tag = what, f"vLLM {_vllm_version()} as released (kvstack's vLLM patches taken out)"
    else:
        upstream_is = (f"NOT vLLM as released: the installed vLLM {_vllm_version()} WITH kvstack's patches, "
                       "run without any KV connector (kvstack's vLLM patches do nothing without one)")
        tag = "the installed, patched vLLM without a KV connector"
    rep.say(f"upstream = {upstream_is}")
    runner = Runner(work, args.verbose, overlay_dir)

    if "streaming" in parts:
        streaming_part(runner, dirs["llama4"], rep)
    if "lmcache" in parts:
        lmcache_part(runner, dirs["qwen3next"], work, rep, overlay_mode)

    # The table, upstream's own words, the verdict.
    print()
    print(f"Summary ({time.perf_counter() - t_start:.0f} s; upstream = {tag}):")
    head = ("comparison", "upstream", "kvstack", "check")
    widths = [max(len(r[i]) for r in [head, *rep.rows]) for i in range(4)]
    rule = "  ".join("-" * w for w in widths)
    for r in [head, None, *rep.rows, None]:
        print(rule if r is None else "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for what, quote in rep.quotes:
        print(f"upstream's error, {what}: \"{quote}\"")
    if rep.failures:
        for f in rep.failures:
            print(f"FAILED: {f}", file=sys.stderr)
        print(f"RESULT FAIL {'; '.join(rep.failures)}", flush=True)
        return 1
    print(f"RESULT ok {'; '.join(rep.fields)}", flush=True)
    return 0


def streaming_part(runner: Runner, model_dir: Path, rep: Report) -> None:
    n, max_len, budget = STREAM_PROMPT, STREAM_MAX_LEN, STREAM_BUDGET_BLOCKS
    at_budget = dict(max_model_len=max_len, num_gpu_blocks_override=budget,
                     max_num_batched_tokens=64, max_num_seqs=1, enable_prefix_caching=False)
    kib_kv = budget * STREAM_BLOCK_BYTES // 1024
    kib_up = kib_kv * STREAM_LAYERS
    base = dict(model="llama4", model_dir=str(model_dir), task="long", prompt_tokens=n,
                max_tokens=STREAM_MAX_TOKENS)

    # a. upstream at the budget: must refuse.
    up = runner.run("streaming-upstream-budget", dict(base, llm=at_budget), upstream=True)
    refused = not up["crashed"] and not up["started"]
    head = (f"streaming, upstream at a device KV budget of {budget} blocks of 32 tokens "
            f"(num_gpu_blocks_override={budget}: {kib_up} KiB, all 4 layers in each block), "
            f"max_model_len={max_len}")
    if refused:
        quote = _one_line(up["error"])
        m = re.search(r"estimated maximum model length is (\d+)", quote)
        up_cell = f"refused to start (max length {m.group(1)})" if m else "refused to start"
        rep.say(f"{head}: refused to start ({up['wall_s']:.0f} s): \"{quote}\"")
        rep.quotes.append(("streaming", quote))
    elif up["crashed"]:
        up_cell = "FAILED"
        rep.fail(f"streaming: the upstream engine at the budget did not run: {_engine_error(up)}")
        rep.say(f"{head}: FAILED: {_engine_error(up)}")
    else:
        up_cell = "started (unexpected)"
        rep.fail(f"streaming: upstream vLLM unexpectedly started at {budget} blocks with "
                 f"max_model_len={max_len}")
        rep.say(f"{head}: STARTED, where it should have refused")

    # b. kvstack at the same budget.
    kv = runner.run("streaming-kvstack-budget",
                    dict(base, llm=at_budget, connector="streaming", connector_config=STREAM_CONFIG),
                    upstream=False, env={HMA_ENV: "1"})
    served = (not kv["crashed"] and kv["started"]
              and len(kv.get("tokens", [])) == STREAM_MAX_TOKENS)
    if served:
        peak_kib = kv["peak_device_blocks"] * STREAM_BLOCK_BYTES // 1024
        tier = kv.get("connector_stats", {}).get("capacity_tokens")
        rep.say(f"streaming, kvstack at the same budget ({kv['device_blocks']} blocks of one layer, "
                f"{kib_kv} KiB; StreamingConnector {STREAM_CONFIG}): served the {kv['prompt_tokens']}"
                f"-token prompt in {kv['gen_s']:.1f} s ({kv['wall_s']:.0f} s with start-up), at most "
                f"{kv['peak_device_blocks']} device blocks in use ({peak_kib} KiB); the NoPE layer's "
                f"K/V history lives in the host tier" + (f" ({tier} tokens)" if tier else "")
                + f"; greedy tokens {kv['tokens']}")
        kv_cell = f"served, {peak_kib} KiB device KV in use at most"
    else:
        kv_cell = "FAILED"
        err = _engine_error(kv) if kv["crashed"] or not kv["started"] else f"tokens {kv.get('tokens')}"
        rep.fail(f"streaming: kvstack did not serve the prompt: {err}")
        rep.say(f"streaming, kvstack at the same budget: FAILED: {err}")

    # c. upstream with enough memory: the reference tokens.
    ref = runner.run("streaming-upstream-reference",
                     dict(base, llm=dict(max_model_len=max_len, max_num_batched_tokens=64,
                                         max_num_seqs=1, enable_prefix_caching=False)),
                     upstream=True)
    same = False
    if ref["crashed"] or not ref["started"]:
        ref_cell = "FAILED"
        rep.fail(f"streaming: upstream with enough memory did not run: {_engine_error(ref)}")
        rep.say(f"streaming, upstream with enough memory: FAILED: {_engine_error(ref)}")
    else:
        same = served and ref["tokens"] == kv["tokens"]
        ref_cell = str(ref["tokens"])
        rep.say(f"streaming, upstream with enough memory (VLLM_CPU_KVCACHE_SPACE="
                f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB: {ref['device_blocks']} blocks): "
                f"greedy tokens {ref['tokens']} -> "
                + ("identical to kvstack's" if same else "DIFFERENT from kvstack's"))
        if served and not same:
            rep.fail(f"streaming: greedy tokens differ: upstream {ref['tokens']}, kvstack {kv['tokens']}")
    rep.rows.append((f"llama4, {n}-token prompt, {budget}-block KV budget", up_cell, kv_cell,
                     "ok" if refused and served else "FAIL"))
    rep.rows.append(("  greedy tokens (upstream given 1 GiB)", ref_cell,
                     str(kv.get("tokens", "-")), "identical" if same else "FAIL"))
    rep.fields.append(f"streaming: upstream_refused={'yes' if refused else 'no'} "
                      f"kvstack_served_tokens={kv['prompt_tokens'] if served else 0} "
                      f"tokens_identical={'yes' if same else 'no'}")


def lmcache_part(runner: Runner, model_dir: Path, work: Path, rep: Report, overlay_mode: bool) -> None:
    n = LMC_PROMPT
    llm = dict(max_model_len=LMC_MAX_LEN, max_num_batched_tokens=LMC_CHUNK, max_num_seqs=1,
               enable_prefix_caching=False)
    lmc_env = {"LMCACHE_CHUNK_SIZE": str(LMC_CHUNK), "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_DISABLE_BANNER": "1",
               "LMCACHE_LOG_LEVEL": "INFO" if runner.verbose else "WARNING"}
    base = dict(model="qwen3next", model_dir=str(model_dir), task="repeat", prompt_tokens=n,
                max_tokens=8, reps=LMC_REPS, llm=llm)
    what = f"qwen3next, {n}-token prompt repeated"

    # a. upstream with LMCache's in-process connector on the hybrid model: refused.
    up_cell = "-"
    if overlay_mode:
        up = runner.run("lmcache-upstream-connector",
                        dict(base, connector="lmcache", connector_config={}),
                        upstream=True, env=lmc_env)
        head = ("lmcache, upstream with LMCacheConnectorV1 on qwen3next (hybrid: 3 gated delta-net "
                "layers + 1 attention layer)")
        if not up["crashed"] and not up["started"]:
            quote = _one_line(up["error"])
            rep.quotes.append(("lmcache", quote))
            rep.say(f"{head}: refused to start ({up['wall_s']:.0f} s): \"{quote}\" (upstream's "
                    "LMCacheConnectorV1 does not support the hybrid KV cache manager, vLLM #42620 is "
                    "open, so vLLM turns that manager off and cannot lay out the hybrid cache)")
            up_cell = "LMCache refused"
        elif up["crashed"]:
            rep.fail(f"lmcache: the upstream engine with LMCache did not run: {_engine_error(up)}")
            rep.say(f"{head}: FAILED: {_engine_error(up)}")
        else:
            up_cell = "LMCache started (unexpected)"
            rep.fail("lmcache: upstream vLLM unexpectedly started LMCacheConnectorV1 on the hybrid model")
            rep.say(f"{head}: STARTED, where it should have refused")

    # b. recompute: the same prompt, no LMCache.
    rc = runner.run("lmcache-recompute", base, upstream=True)
    rc_ok = not rc["crashed"] and rc["started"]
    t_rc = min(rc["repeat_s"]) if rc_ok else 0.0
    if rc_ok:
        rep.say(f"lmcache, recompute (upstream, no KV connector; prefix caching off, as upstream's "
                f"hybrid prefix caching needs a GPU): the {n}-token prompt {LMC_REPS}x, TTFT "
                f"{t_rc * 1e3:.0f} ms (best of {LMC_REPS}; {rc['wall_s']:.0f} s with start-up); "
                f"greedy tokens {rc['tokens']}")
    else:
        rep.fail(f"lmcache: the recompute engine did not run: {_engine_error(rc)}")
        rep.say(f"lmcache, recompute: FAILED: {_engine_error(rc)}")

    # c. kvstack: LMCache with the hybrid state restored.
    kv = runner.run("lmcache-kvstack", dict(base, connector="lmcache", connector_config={}),
                    upstream=False, env=lmc_env)
    kv_ok = not kv["crashed"] and kv["started"]
    hit, same, ratio, t_kv = 0, False, 0.0, 0.0
    if kv_ok:
        hit = min(kv["repeat_cached"])
        t_kv = min(kv["repeat_s"])
        restored = kv["restored"]
        ats = sorted({int(m.group(1)) for r in restored if (m := re.search(r"at (\d+) token", r))})
        same = rc_ok and kv["tokens"] == rc["tokens"] and kv["first_tokens"] == rc["first_tokens"]
        ratio = t_rc / t_kv if rc_ok and t_kv > 0 else 0.0
        rep.say(f"lmcache, kvstack (LMCacheConnectorV1, local CPU backend, chunk = step = {LMC_CHUNK}"
                f" tokens): first request {kv['first_cached']} hit tokens (computed, K/V and hybrid "
                f"state stored); each repeat {hit} hit tokens, hybrid state restored "
                f"{len(restored)}x at {'/'.join(map(str, ats)) or '-'} tokens, TTFT {t_kv * 1e3:.0f} ms"
                f" (best of {LMC_REPS}) -> {ratio:.1f}x faster than recompute; greedy tokens "
                f"{kv['tokens']} -> " + ("identical" if same else "DIFFERENT"))
        if hit <= 0:
            rep.fail("lmcache: no LMCache hit on the repeated prompt")
        if not restored:
            rep.fail("lmcache: no hybrid state was restored")
        if rc_ok and not same:
            rep.fail(f"lmcache: greedy tokens differ: recompute {rc['tokens']} then "
                     f"{rc['first_tokens']}, LMCache {kv['tokens']} then {kv['first_tokens']}")
        kv_cell = f"{hit} tokens from LMCache + state, TTFT {t_kv * 1e3:.0f} ms"
    else:
        rep.fail(f"lmcache: the kvstack LMCache engine did not run: {_engine_error(kv)}")
        rep.say(f"lmcache, kvstack: FAILED: {_engine_error(kv)}")
        kv_cell = "FAILED"
    up_ttft = f"recompute, TTFT {t_rc * 1e3:.0f} ms" if rc_ok else "FAILED"
    rep.rows.append((what, f"{up_cell}; {up_ttft}" if overlay_mode else up_ttft, kv_cell,
                     f"{ratio:.1f}x faster" if kv_ok and hit > 0 and ratio else "FAIL"))
    rep.rows.append(("  greedy tokens", str(rc.get("tokens", "-")), str(kv.get("tokens", "-")),
                     "identical" if same else "FAIL"))
    rep.fields.append(f"lmcache: hit_tokens={hit} ttft_speedup={ratio:.1f}x "
                      f"tokens_identical={'yes' if same else 'no'}")

# --------------------------------------------------------------------------------------------
# The former demo (--simple).
# --------------------------------------------------------------------------------------------

def simple_demo(args) -> int:
    total = 6

    # 1. The model.
    dest = Path(args.cache_dir) / args.model
    was_current = tiny_models.is_current(args.model, dest)
    t0 = time.perf_counter()
    model_dir = tiny_models.make_model(args.model, dest)
    how = "reused" if was_current else f"wrote in {time.perf_counter() - t0:.1f} s"
    _say(1, total, f"model: {args.model} ({tiny_models.MODELS[args.model].summary}) at {model_dir} ({how})")

    # 2. The environment: only what the user has not set.
    added = tiny_models.apply_engine_env()
    if not args.verbose and "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = added["VLLM_LOGGING_LEVEL"] = "WARNING"
    shown = ", ".join(f"{k}={os.environ[k]}" + ("" if k in added else " (yours)")
                      for k in [*tiny_models.ENGINE_ENV, "VLLM_LOGGING_LEVEL"] if k in os.environ)
    _say(2, total, f"environment: {shown}")

    # 3. The engine.
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        print(f"error: cannot import vLLM ({exc}); build the environment with scripts/build_env.sh "
              "and run this with .venv/bin/kvstack", file=sys.stderr)
        return 2
    import_s = time.perf_counter() - t0
    kwargs = tiny_models.llm_kwargs(args.model, model_dir)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k not in ("model", "tokenizer"))
    _say(3, total, f"engine: vLLM {vllm.__version__} on CPU started in {start_s:.1f} s "
                   f"(import {import_s:.1f} s); LLM({shown})")

    # 4. The prompt, as the engine's tokenizer sees it.
    ids = list(llm.get_tokenizer().encode(args.prompt))
    _say(4, total, f"prompt: {args.prompt!r} -> {len(ids)} token ids {ids}")

    # 5. Greedy generation.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([args.prompt], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    if list(out.prompt_token_ids or []) != ids:
        print(f"note: the engine used prompt token ids {list(out.prompt_token_ids or [])}", flush=True)
    _say(5, total, f"generated {len(token_ids)} token ids in {gen_s:.2f} s (greedy): {token_ids}")

    # 6. The text.
    _say(6, total, f"text of the generated tokens: {completion.text!r} (finish reason: {completion.finish_reason})")
    del llm
    print(f"generated: {_printable(completion.text)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
