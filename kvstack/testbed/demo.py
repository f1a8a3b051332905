"""`kvstack demo`: what kvstack adds to vLLM, side by side with upstream vLLM in the same run.

Two comparisons on the CPU engine with tiny random-weight models (kvstack.testbed.tiny_models), each engine
in its own process:

1. Streaming attention + KV paging (tiny Llama-4). A long prompt at a device KV budget where
   upstream vLLM refuses to start (its own error is caught and quoted) is served by kvstack's
   StreamingConnector, and its greedy tokens are compared with an upstream run given enough memory.
2. LMCache on a hybrid model (tiny Qwen3-Next with a long-memory recurrent state, so a wrong
   restored state changes the tokens). Upstream vLLM refuses LMCache's connector on it (its error is
   quoted). Upstream's best is vLLM's own hybrid prefix cache (mamba_cache_mode="align", base 0.32):
   kvstack's LMCache next to it in the same engine setting, TTFT ratio against it and the same
   greedy tokens. Then what upstream cannot do: a new engine process restores the prefix (K/V +
   gated delta-net state) from LMCache's local disk backend: hit tokens, TTFT against recompute, the
   same greedy tokens. Each claim has a control that must come out the other way (a stored prompt
   whose files were removed: 0 hit tokens; the restored state zeroed: different tokens).

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
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from kvstack.testbed import long_memory, tiny_models
from kvstack.testbed.engine import shutdown_llm, track_peak_device_blocks

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

# LMCache: tiny Qwen3-Next with a long-memory recurrent state (kvstack.testbed.long_memory), so a
# wrong or zeroed restored state changes the tokens. LMCache chunk = scheduler step: a state is saved
# at every chunk. In align mode vLLM's own prefix cache keeps 384-token blocks on this model, so a
# repeat of the prompt finds 8 blocks (3072 tokens) there, and LMCache K/V + state up to 3328.
LMC_CHUNK = 256
LMC_PROMPT = 13 * LMC_CHUNK + 8  # 3336: LMCache restores 13 chunks, 8 tokens are computed
LMC_ALIGNED_PROMPT = 12 * LMC_CHUNK + 8  # 3080: 3072 = 8 blocks = 12 chunks, held whole by both caches
LMC_MAX_LEN = 4096
LMC_REPS = 20  # timed repeats of each prompt served from a cache (a few ms each): the best is reported
LMC_RECOMPUTE_REPS = 5  # timed recomputes (about 0.1 s each)
ALIGN_GOAL = 0.95  # LMCache next to vLLM's own cache: at least this fraction of its speed


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

    zero_states = [False]  # the negative control: zero every hybrid state LMCache restores
    if spec.get("connector") == "lmcache" and spec["task"].startswith("hybrid-"):
        import lmcache.integration.vllm.vllm_v1_adapter as adapter

        scatter = adapter.scatter_states

        def scatter_maybe_zeroed(caches, layout, blocks, states):
            if zero_states[0]:
                states = {k: [t * 0 for t in v] for k, v in states.items()}
            scatter(caches, layout, blocks, states)

        adapter.scatter_states = scatter_maybe_zeroed

    def engine_kwargs(connector: str | None) -> dict:
        kw = tiny_models.llm_kwargs(spec["model"], spec["model_dir"], **spec["llm"])
        if connector == "streaming":
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="StreamingConnector", kv_role="kv_both",
                kv_connector_module_path="kvstack.streaming",
                kv_connector_extra_config=spec["connector_config"])
        elif connector == "lmcache":
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                kv_connector_extra_config=spec.get("connector_config") or {})
        return kw

    if spec.get("first_try_connector"):
        # An engine with this connector first (expected to refuse to start), then this process's
        # own engine: one process (one import of vLLM) for both.
        t0 = time.perf_counter()
        try:
            tried = LLM(**engine_kwargs(spec["first_try_connector"]))
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            result["connector_attempt"] = dict(started=False, start_s=time.perf_counter() - t0,
                                               error=f"{type(e).__name__}: {e}")
            import gc

            from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            gc.collect()
            ensure_kv_transfer_shutdown()
            cleanup_dist_env_and_memory()
        else:
            result["connector_attempt"] = dict(started=True, start_s=time.perf_counter() - t0)
            shutdown_llm(tried)
    kw = engine_kwargs(spec.get("connector"))
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        result.update(started=False, start_s=time.perf_counter() - t0,
                      error=f"{type(e).__name__}: {e}")
        out.write_text(json.dumps(result))
        os._exit(0)
    result.update(started=True, start_s=time.perf_counter() - t0)
    lmc_log: list[str] = []  # LMCache adapter's lines on lookups and restores
    if spec.get("connector") == "lmcache":
        import logging

        class _Grab(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "restored hybrid state" in msg or "LMCache hit tokens" in msg:
                    lmc_log.append(msg)

        # LMCache's logger exists once the engine has started (its init clears handlers); its
        # own handlers keep their level, so nothing more is printed.
        lg = logging.getLogger("lmcache.integration.vllm.vllm_v1_adapter")
        for h in lg.handlers:
            h.setLevel(max(h.level, lg.level))
        lg.setLevel(logging.INFO)
        lg.addHandler(_Grab(logging.INFO))
    core = llm.llm_engine.engine_core.engine_core
    result["device_blocks"] = core.scheduler.kv_cache_config.num_blocks
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size

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
    elif task.startswith("hybrid-"):
        result.update(_hybrid_task(task, spec, llm, gen, lmc_log, zero_states))
    out.write_text(json.dumps(result))
    os._exit(0)  # skip the engine's teardown: the result is written


def _hybrid_task(task: str, spec: dict, llm, gen, lmc_log: list[str], zero_states: list[bool]) -> dict:
    """The hybrid part's three engines (each its own process; see lmcache_part). Prompts: P (its
    end past vLLM's last align-mode block, so LMCache holds more of it than vLLM's cache), Q (a
    prefix both caches hold whole) and W (the control prompt), all computed once first.

    hybrid-upstream  no connector: P recomputed `recompute_reps` times (vLLM's prefix cache reset
                     before each), then, in align mode, P and Q repeated `reps` times from vLLM's
                     own cache.
    hybrid-writer    kvstack's LMCache (local disk) next to vLLM's cache: W (its files are listed
                     once written: the reader's control), then, in align mode, P and Q repeated
                     `reps` times and P once more with every state LMCache restores zeroed (control).
    hybrid-reader    a new process on the writer's disk folder: W (whose files the parent removed:
                     the control, which must miss), then P `reps` times, vLLM's prefix cache reset
                     before each (so LMCache serves it from disk), and once more zeroed (control).
    """
    reps, align, max_tokens = spec["reps"], spec["align"], spec["max_tokens"]
    P, Q = prompt_ids(spec["prompt_tokens"]), prompt_ids(spec["aligned_prompt_tokens"], salt=3)
    W = prompt_ids(spec["prompt_tokens"], salt=7)
    res: dict = {}

    def one(ids: list[int], max_tokens: int, reset: bool = False) -> dict:
        if reset and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache")
        start = len(lmc_log)
        o, dt = gen(ids, max_tokens)
        new = lmc_log[start:]

        def last(pattern: str) -> int:
            found = [int(m.group(1)) for line in new if (m := re.search(pattern, line))]
            return found[-1] if found else 0

        return {"s": dt, "tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
                # LMCache's lookup (seen in its log or not), its hit (0: a miss) and what vLLM's own
                # prefix cache held when LMCache was asked; the hybrid state LMCache restored
                "looked_up": any("LMCache hit tokens" in line for line in new),
                "lmc_hit": last(r"LMCache hit tokens: (\d+)"),
                "vllm_hit": last(r"Inference Engine computed tokens: (\d+)"),
                "restored_at": last(r"restored hybrid state at (\d+) token")}

    def timed(runs: list[dict]) -> dict:
        out = {k: [r[k] for r in runs] for k in ("s", "cached", "lmc_hit", "vllm_hit", "restored_at")}
        return dict(out, looked_up=all(r["looked_up"] for r in runs))

    def repeats(reset: bool = False, prompts: tuple = ("P", "Q")) -> dict:
        """Each prompt `reps` times, interleaved (the same load on each)."""
        runs: dict[str, list[dict]] = {k: [] for k in prompts}
        for _ in range(reps):
            for k in prompts:
                runs[k].append(one({"P": P, "Q": Q}[k], 1, reset=reset))
        return {k: timed(v) for k, v in runs.items()}

    if task == "hybrid-upstream":
        gen(W, 1)  # warm-up: another prompt of the same length
        res["first"] = {"P": one(P, max_tokens)}
        res["recompute"] = timed([one(P, 1, reset=True) for _ in range(spec["recompute_reps"])])
        if align:  # P is in vLLM's cache again (the last recompute)
            res["first"]["Q"] = one(Q, max_tokens)
            res["repeat"] = repeats()
            res["last"] = {"P": one(P, max_tokens), "Q": one(Q, max_tokens)}
    elif task == "hybrid-writer":
        disk = Path(spec["disk"])
        res["control_prompt"] = one(W, 1)  # warm-up too
        res["control_files"] = _settled_files(disk)
        res["first"] = {"P": one(P, max_tokens)}
        if align:
            res["first"]["Q"] = one(Q, max_tokens)
            res["repeat"] = repeats()
            res["last"] = {"P": one(P, max_tokens), "Q": one(Q, max_tokens)}
            zero_states[0] = True
            res["zeroed"] = one(P, max_tokens)
            zero_states[0] = False
        res["files"] = _settled_files(disk)
    elif task == "hybrid-reader":
        res["control_prompt"] = one(W, 1)  # its files are gone: a miss (and the warm-up)
        res["repeat"] = repeats(reset=True, prompts=("P",))["P"]
        res["last"] = {"P": one(P, max_tokens, reset=True)}
        zero_states[0] = True
        res["zeroed"] = one(P, max_tokens, reset=True)
    return res


def _settled_files(folder: Path, timeout_s: float = 30.0) -> list[str]:
    """The files in `folder` once LMCache's asynchronous disk writes are done: every chunk file
    (`*.pt`) has its sidecar (written after it) and nothing changed for 0.3 s."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = sorted(os.listdir(folder)) if folder.is_dir() else []
        done = all(f"{n}.kvmeta" in names for n in names if n.endswith(".pt"))
        if names != last:
            last, since = names, time.monotonic()
        elif done and time.monotonic() - since >= 0.3:
            break
        time.sleep(0.05)
    return last or []


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
    # origin None: a namespace package (the checkout's vllm/ of pins), not an installed vLLM
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
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
              lmcache    a repeated prompt on a hybrid model (tiny Qwen3-Next): kvstack's LMCache
                         next to vLLM's own hybrid prefix cache (align mode) against that cache
                         alone (TTFT ratio, same tokens), then a new engine process restoring the
                         prefix and its recurrent state from LMCache's local disk (hit tokens,
                         TTFT against recompute, same tokens), each with a control
            Ends with a summary table and a line 'RESULT ok ...' (exit 0) or 'RESULT FAIL ...'
            (exit 1: tokens differ, upstream started where it should refuse, no LMCache hit,
            a control that did not come out the other way).
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
                        help="scratch folder: overlay, per-engine specs, logs and results "
                             "(default: %(default)s; LMCache's disk backend uses a temporary "
                             "folder of its own, removed at the end)")
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
    total = 2 + 3 * ("streaming" in parts) + (3 + overlay_mode) * ("lmcache" in parts)
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
    if "qwen3next" in dirs:  # the hybrid part runs a copy whose recurrent state matters
        dest = Path(args.cache_dir) / "qwen3next-long-memory"
        was = long_memory.is_current(dirs["qwen3next"], dest)
        t0 = time.perf_counter()
        dirs["qwen3next-long-memory"] = long_memory.long_memory_qwen3next(dirs["qwen3next"], dest)
        how.append(f"its long-memory copy at {dest} "
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
        lmcache_part(runner, dirs["qwen3next-long-memory"], work, rep, overlay_mode)

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


def align_unavailable() -> str | None:
    """Why kvstack's LMCache cannot run next to vLLM's own hybrid prefix cache (mamba_cache_mode=
    "align") on the installed base; None where it can."""
    from importlib.metadata import PackageNotFoundError, version

    from kvstack.release.pins import release_of

    try:
        v = version("lmcache")
    except PackageNotFoundError:
        return "LMCache is not installed"
    if release_of(v) == "0.5.3":
        return (f"not available on base {_base_name()}: LMCache {v}'s vLLM adapter refuses "
                "mamba_cache_mode='align' at start-up (base 0.32 runs it)")
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def lmcache_part(runner: Runner, model_dir: Path, work: Path, rep: Report, overlay_mode: bool) -> None:
    """The hybrid model: (a) upstream refuses LMCache on it; (b) upstream's best, vLLM's own hybrid
    prefix cache (align mode), and recompute; (c) kvstack's LMCache next to vLLM's cache in the same
    engine setting; (d) what upstream cannot do: a new engine process restores the prefix from
    LMCache's local disk backend. Every claim has a control that would make it fail."""
    n, n_q, reps, rc_reps = LMC_PROMPT, LMC_ALIGNED_PROMPT, LMC_REPS, LMC_RECOMPUTE_REPS
    no_align = align_unavailable()
    align = no_align is None
    llm = dict(max_model_len=LMC_MAX_LEN, max_num_batched_tokens=LMC_CHUNK, max_num_seqs=1,
               enable_prefix_caching=align, **({"mamba_cache_mode": "align"} if align else {}))
    setting = (("vLLM's own hybrid prefix cache on (enable_prefix_caching, mamba_cache_mode='align')"
                if align else "prefix caching off") + f", step {LMC_CHUNK} tokens")
    log_level = "INFO" if runner.verbose else "WARNING"
    base = dict(model="qwen3next", model_dir=str(model_dir), prompt_tokens=n, aligned_prompt_tokens=n_q,
                max_tokens=8, reps=reps, recompute_reps=rc_reps, llm=llm, align=align)
    what = f"qwen3next, {n}-token prompt"

    # a. upstream with LMCache's in-process connector on the hybrid model: refused. The upstream
    # process tries it first, then starts its own engine (b) without a connector.
    up_spec = dict(base, task="hybrid-upstream")
    up_env = None
    if overlay_mode:
        up_spec["first_try_connector"] = "lmcache"
        up_env = {"LMCACHE_CHUNK_SIZE": str(LMC_CHUNK), "LMCACHE_LOCAL_CPU": "True",
                  "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1", "LMCACHE_DISABLE_BANNER": "1",
                  "LMCACHE_LOG_LEVEL": log_level}
    up = runner.run("lmcache-upstream", up_spec, upstream=True, env=up_env)
    refused = None
    if overlay_mode:
        head = ("lmcache, upstream with LMCacheConnectorV1 on qwen3next (hybrid: 3 gated delta-net "
                "layers + 1 attention layer)")
        tried = up.get("connector_attempt")
        if tried is not None and not tried["started"]:
            quote = _one_line(tried["error"])
            rep.quotes.append(("lmcache", quote))
            rep.say(f"{head}: refused to start ({tried['start_s']:.0f} s): \"{quote}\" (upstream's "
                    "LMCacheConnectorV1 does not support the hybrid KV cache manager, vLLM #42620 is "
                    "open, so vLLM turns that manager off and cannot lay out the hybrid cache)")
            refused = True
        elif tried is None:
            rep.fail(f"lmcache: the upstream engine with LMCache did not run: {_engine_error(up)}")
            rep.say(f"{head}: FAILED: {_engine_error(up)}")
        else:
            refused = False
            rep.fail("lmcache: upstream vLLM unexpectedly started LMCacheConnectorV1 on the hybrid model")
            rep.say(f"{head}: STARTED, where it should have refused")

    # b. upstream's best: vLLM's own hybrid prefix cache (align mode), and recompute (cache reset).
    up_ok = not up["crashed"] and up["started"]
    ref: dict[str, list[int]] = {}  # the computed greedy tokens of each prompt: what every run must give
    t_rc = 0.0
    t_al: dict[str, float] = {}
    if up_ok:
        ref = {k: v["tokens"] for k, v in up["first"].items()}
        t_rc = min(up["recompute"]["s"])
        rc_cached = max(up["recompute"]["cached"])
        msg = (f"lmcache, upstream without a KV connector, {setting}, tiny qwen3next with a long-memory "
               f"recurrent state: prompt P ({n} tokens) computed (greedy tokens {ref['P']}), then "
               f"recomputed {rc_reps}x (prefix cache reset before each: {rc_cached} tokens cached), TTFT "
               f"{_ms(t_rc)} (best of {rc_reps})")
        if rc_cached:
            rep.fail(f"lmcache: the recompute was served from a cache ({rc_cached} tokens cached after "
                     "vLLM's prefix cache was reset)")
        if align:
            r = up["repeat"]
            t_al = {k: min(r[k]["s"]) for k in r}
            cached = {k: min(r[k]["cached"]) for k in r}
            same_up = all(up["last"][k]["tokens"] == ref[k] for k in ref)
            msg += (f"; from vLLM's own cache ({up['block_size']}-token blocks), {reps}x each: P {cached['P']} "
                    f"tokens cached, TTFT {_ms(t_al['P'])}; prompt Q ({n_q} tokens) {cached['Q']} cached, "
                    f"TTFT {_ms(t_al['Q'])} (best of {reps}); greedy tokens from the cache -> "
                    + ("identical" if same_up else f"DIFFERENT: {up['last']['P']['tokens']}"))
            if not min(cached.values()):
                rep.fail(f"lmcache: vLLM's own hybrid prefix cache (align mode) did not hit: {cached}")
            if not same_up:
                rep.fail(f"lmcache: vLLM's own prefix cache changed the tokens: computed {ref}, from its "
                         f"cache {({k: v['tokens'] for k, v in up['last'].items()})}")
        else:
            msg += f" (vLLM's own hybrid prefix cache next to LMCache is {no_align})"
        rep.say(msg + f" ({up['wall_s']:.0f} s with start-up)")
    else:
        rep.fail(f"lmcache: the upstream engine (no connector) did not run: {_engine_error(up)}")
        rep.say(f"lmcache, upstream without a KV connector: FAILED: {_engine_error(up)}")

    # c. kvstack: LMCache (local disk backend, a temp folder) next to vLLM's cache, same setting.
    disk = Path(tempfile.mkdtemp(prefix="kvstack-demo-lmcache-disk-"))
    lmc_env = {"LMCACHE_CHUNK_SIZE": str(LMC_CHUNK), "LMCACHE_LOCAL_CPU": "False",
               "LMCACHE_LOCAL_DISK": f"file://{disk}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
               # the CPU buffer LMCache moves chunks through (local_cpu off: not a cache tier)
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1",
               "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": log_level}
    lmc = dict(base, connector="lmcache", connector_config={}, disk=str(disk))
    try:
        wr, rd = _lmcache_engines(runner, lmc, lmc_env, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)

    def same(toks: list[int], k: str = "P") -> bool:
        return k in ref and toks == ref[k]

    wr_ok = not wr["crashed"] and wr["started"]
    conn = (f"LMCacheConnectorV1, local disk backend only (local_disk in {disk}, removed at the end), "
            f"chunk = step = {LMC_CHUNK} tokens")
    fields = f"align: not_available base={_base_name()}"
    if not wr_ok:
        rep.fail(f"lmcache: the kvstack LMCache engine did not run: {_engine_error(wr)}")
        rep.say(f"lmcache, kvstack's LMCache: FAILED: {_engine_error(wr)}")
        rep.rows.append((f"{what} P, repeat in one engine", "-", "FAILED", "FAIL"))
        fields = "align: FAILED"
    else:
        first = wr["first"]["P"]
        head = (f"lmcache, kvstack ({conn}), {setting}: first request of P {first['lmc_hit']} hit tokens "
                f"(computed, K/V and hybrid state stored; greedy tokens {first['tokens']} -> "
                + ("identical to upstream's)" if same(first["tokens"]) else "DIFFERENT from upstream's)"))
        if not first["looked_up"] or first["lmc_hit"]:
            rep.fail(f"lmcache: the first request of the prompt was not a miss looked up in LMCache "
                     f"(hit {first['lmc_hit']}, lookup seen: {first['looked_up']})")
        if ref and not same(first["tokens"]):
            rep.fail(f"lmcache: greedy tokens differ: upstream {ref['P']}, kvstack's LMCache engine "
                     f"{first['tokens']}")
        if not wr["control_files"]:
            rep.fail("lmcache: the first process wrote no files for the control prompt")
        if align:
            r, z = wr["repeat"], wr["zeroed"]
            t_kv = {k: min(r[k]["s"]) for k in r}
            cached = {k: min(r[k]["cached"]) for k in r}
            hit, local = min(r["P"]["lmc_hit"]), max(r["P"]["vllm_hit"])
            hit_q, local_q = min(r["Q"]["lmc_hit"]), max(r["Q"]["vllm_hit"])
            ats = sorted(set(r["P"]["restored_at"]))
            ratio = {k: t_al[k] / t_kv[k] if t_al.get(k) and t_kv[k] else 0.0 for k in t_kv}
            toks_same = ref and all(same(wr["last"][k]["tokens"], k) for k in ("P", "Q"))
            z_differs = z["restored_at"] > 0 and bool(ref) and z["tokens"] != ref["P"]

            def goal(x: float) -> str:
                return f"{x:.2f}x ({'at or above' if x >= ALIGN_GOAL else 'BELOW'} the {ALIGN_GOAL:.2f}x goal)"

            rep.say(f"{head}; {reps}x each, interleaved: P {cached['P']} tokens cached = {local} by vLLM's "
                    f"own cache + {hit - local} loaded by LMCache from disk (hit {hit}: K/V past vLLM's "
                    f"last block and the hybrid state, restored at {'/'.join(map(str, ats)) or '-'} tokens), "
                    f"TTFT {_ms(t_kv['P'])} -> {goal(ratio['P'])} the speed of vLLM's cache alone "
                    f"({_ms(t_al.get('P', 0))}); Q {cached['Q']} cached, all {local_q} by vLLM's cache "
                    f"(LMCache hit {hit_q}, nothing more to load: its cost alone), TTFT {_ms(t_kv['Q'])} -> "
                    f"{goal(ratio['Q'])} of vLLM's cache alone ({_ms(t_al.get('Q', 0))}) (best of {reps}; "
                    f"a tiny model's milliseconds on a shared machine are noisy); greedy tokens of both -> "
                    + ("identical" if toks_same else "DIFFERENT")
                    + f"; control, P again with every state LMCache restores zeroed: restored at "
                    f"{z['restored_at']}, greedy tokens {z['tokens']} -> "
                    + ("different (ok: equal tokens need the right state)" if z_differs else
                       "NOT different (the control failed: equal tokens would prove nothing)"))
            if hit <= local or not all(r["P"]["restored_at"]):
                rep.fail(f"lmcache: LMCache added nothing next to vLLM's cache on P (hit {hit}, vLLM's "
                         f"cache {local}, states restored at {r['P']['restored_at']})")
            if local_q < hit_q or not local_q:
                rep.fail(f"lmcache: vLLM's cache did not hold Q's whole cached prefix (vLLM {local_q}, "
                         f"LMCache {hit_q})")
            if ref and not toks_same:
                rep.fail(f"lmcache: greedy tokens differ next to vLLM's cache: upstream {ref}, kvstack "
                         f"{({k: v['tokens'] for k, v in wr['last'].items()})}")
            if not z_differs:
                rep.fail(f"lmcache: control failed: with the restored state zeroed next to vLLM's cache "
                         f"the tokens did not change (restored at {z['restored_at']}, tokens {z['tokens']})")
            up_last = up["last"] if up_ok else {}
            rep.rows += [
                (f"{what} P, repeat in one engine",
                 f"vLLM's cache: {min(up['repeat']['P']['cached']) if up_ok else '-'} cached, "
                 f"TTFT {_ms(t_al.get('P', 0))}",
                 f"+ LMCache: {cached['P']} cached ({hit - local} loaded + state), TTFT {_ms(t_kv['P'])}",
                 f"{ratio['P']:.2f}x (goal {ALIGN_GOAL:.2f}x)"),
                ("  greedy tokens", str(up_last.get("P", {}).get("tokens", "-")),
                 str(wr["last"]["P"]["tokens"]), "identical" if same(wr["last"]["P"]["tokens"]) else "FAIL"),
                ("  control: restored state zeroed", "-", str(z["tokens"]), "differ: ok" if z_differs else "FAIL"),
                (f"qwen3next, {n_q}-token prompt Q, repeat in one engine",
                 f"vLLM's cache: {min(up['repeat']['Q']['cached']) if up_ok else '-'} cached, "
                 f"TTFT {_ms(t_al.get('Q', 0))}",
                 f"+ LMCache: {cached['Q']} cached (nothing to add), TTFT {_ms(t_kv['Q'])}",
                 f"{ratio['Q']:.2f}x (goal {ALIGN_GOAL:.2f}x)"),
                ("  greedy tokens", str(up_last.get("Q", {}).get("tokens", "-")),
                 str(wr["last"]["Q"]["tokens"]), "identical" if same(wr["last"]["Q"]["tokens"], "Q") else "FAIL"),
            ]
            fields = (f"align: vllm_cached_tokens={local} lmcache_cached_tokens={cached['P']} "
                      f"ttft_vs_vllm_cache={ratio['P']:.2f}x same_prefix_ttft_vs_vllm_cache={ratio['Q']:.2f}x "
                      f"tokens_identical={'yes' if toks_same else 'no'} "
                      f"zeroed_state_tokens_differ={'yes' if z_differs else 'no'}")
        else:
            rep.say(f"{head}; LMCache next to vLLM's own hybrid prefix cache: {no_align}")
            rep.rows.append((f"{what} P, repeat in one engine", "vLLM's cache + LMCache:",
                             f"not available on base {_base_name()}", "n/a"))
    rep.fields.append(fields)

    # d. what upstream cannot do: a new engine process restores the prefix from LMCache's disk.
    rd_ok = rd is not None and not rd["crashed"] and rd["started"]
    up_cell = ("LMCache refused; " if refused else "") + (f"recompute, TTFT {_ms(t_rc)}" if up_ok else "FAILED")
    row = f"{what} P, new engine process"
    if rd is None:
        rep.say("lmcache, a new engine process on LMCache's disk: not run (the first process failed)")
        rep.rows.append((row, up_cell, "not run", "FAIL"))
        rep.fields.append("cross_process: not_run")
        return
    if not rd_ok:
        rep.fail(f"lmcache: the new engine process did not run: {_engine_error(rd)}")
        rep.say(f"lmcache, a new engine process on LMCache's disk: FAILED: {_engine_error(rd)}")
        rep.rows.append((row, up_cell, "FAILED", "FAIL"))
        rep.fields.append("cross_process: FAILED")
        return
    c, r, z = rd["control_prompt"], rd["repeat"], rd["zeroed"]
    ctl_ok = c["looked_up"] and c["lmc_hit"] == 0 and c["cached"] == 0
    hit, t_kv_p = min(r["lmc_hit"]), min(r["s"])
    restored = all(r["restored_at"])
    ratio_rc = t_rc / t_kv_p if t_rc and t_kv_p else 0.0
    toks = rd["last"]["P"]["tokens"]
    toks_same = same(toks)
    z_differs = z["restored_at"] > 0 and bool(ref) and z["tokens"] != ref["P"]
    rep.say(f"lmcache, what upstream cannot do: a NEW engine process ({conn}, {setting}) on the "
            f"{rd['disk_files']} files the first process left, less the {rd['removed_files']} of control "
            f"prompt W (another {n}-token prompt), removed before this process started: control, prompt W "
            f"-> {c['lmc_hit']} hit tokens, "
            f"{c['cached']} cached (" + ("ok: a hit needs the files" if ctl_ok else
                                          "the control FAILED: a hit without the files") + ")"
            f"; P {reps}x, vLLM's prefix cache reset before each: {hit} hit tokens loaded from disk, "
            f"hybrid state restored at {'/'.join(map(str, sorted(set(r['restored_at'])))) or '-'} tokens, "
            f"TTFT {_ms(t_kv_p)} (best of {reps}; the first {_ms(r['s'][0])}) -> {ratio_rc:.1f}x faster "
            f"than recompute ({_ms(t_rc)}); greedy tokens {toks} -> "
            + ("identical to recompute's" if toks_same else "DIFFERENT from recompute's")
            + f"; control, restored state zeroed: restored at {z['restored_at']}, greedy tokens "
            f"{z['tokens']} -> " + ("different (ok)" if z_differs else "NOT different (the control failed)"))
    if not ctl_ok:
        rep.fail(f"lmcache: control failed: in the new process a prompt whose files were removed got "
                 f"{c['lmc_hit']} hit tokens ({c['cached']} cached)"
                 + ("" if c["looked_up"] else "; LMCache's lookup was not seen in its log, so a 0 proves nothing"))
    if hit <= 0 or not restored:
        rep.fail(f"lmcache: the new engine process did not restore the prefix from disk (hits {r['lmc_hit']}, "
                 f"states restored at {r['restored_at']})")
    if ref and not toks_same:
        rep.fail(f"lmcache: greedy tokens differ in the new process: recompute {ref['P']}, restored {toks}")
    if not z_differs:
        rep.fail(f"lmcache: control failed: with the restored state zeroed the new process's tokens did "
                 f"not change (restored at {z['restored_at']}, tokens {z['tokens']})")
    rep.rows += [
        (row, up_cell, f"{hit} tokens from disk + state, TTFT {_ms(t_kv_p)}",
         f"{ratio_rc:.1f}x faster" if hit > 0 and restored and ratio_rc else "FAIL"),
        ("  greedy tokens", str(ref.get("P", "-")), str(toks), "identical" if toks_same else "FAIL"),
        ("  control: W's files removed", "-", f"{c['lmc_hit']} hit tokens", "0: ok" if ctl_ok else "FAIL"),
        ("  control: restored state zeroed", "-", str(z["tokens"]), "differ: ok" if z_differs else "FAIL"),
    ]
    rep.fields.append(f"cross_process: hit_tokens={hit} ttft_speedup={ratio_rc:.1f}x "
                      f"tokens_identical={'yes' if toks_same else 'no'} "
                      f"removed_files_hit_tokens={c['lmc_hit']} "
                      f"zeroed_state_tokens_differ={'yes' if z_differs else 'no'}")


def _lmcache_engines(runner: Runner, spec: dict, env: dict, disk: Path) -> tuple[dict, dict | None]:
    """The writer (one engine process), then the control prompt's files removed from `disk`, then
    the reader (a new engine process on `disk`); (writer's result, reader's or None: not run)."""
    wr = runner.run("lmcache-kvstack", dict(spec, task="hybrid-writer"), upstream=False, env=env)
    if wr["crashed"] or not wr["started"]:
        return wr, None
    removed = 0
    for name in wr["control_files"]:
        with contextlib.suppress(FileNotFoundError):
            (disk / name).unlink()
            removed += 1
    rd = runner.run("lmcache-kvstack-new-process", dict(spec, task="hybrid-reader"), upstream=False, env=env)
    rd.update(removed_files=removed, disk_files=len(wr["files"]))
    return wr, rd


def _base_name() -> str:
    """The kvstack base the installed LMCache belongs to ("0.32", "0.25"; "unknown")."""
    from importlib.metadata import PackageNotFoundError, version

    from kvstack.release.pins import base_for_versions

    try:
        base = base_for_versions({"lmcache": version("lmcache")})
    except PackageNotFoundError:
        base = None
    return base.name if base else "unknown"


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
