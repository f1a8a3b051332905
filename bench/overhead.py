"""What kvstack's vLLM patches cost a user who does not use kvstack's features: stock vs kvstack.

Issue 27 point 5. A dense model (a random-weight LlamaForCausalLM, --hidden / --layers, written
under build/bench-models/) runs on the CPU engine on two sides:

- ``stock``: the installed vLLM with kvstack's vLLM series taken out again, as an overlay
  (kvstack.testbed.family_table.build_stock_overlay, $KVSTACK_OVERLAY), but for the CPU start-up
  fix stock needs to run on the CPU engine at all (family_table.CPU_ENGINE_FIXES);
- ``kvstack``: the installed, patched vLLM.

LMCache is kvstack's on BOTH sides: stock LMCache has no CPU path at all (it cannot run on the
CPU engine), so the ``lmcache`` column measures what kvstack's vLLM patches cost with LMCache on,
not what kvstack's LMCache patches cost.

Configs (--configs): ``none`` (no KV connector, vLLM's defaults) and ``lmcache``
(LMCacheConnectorV1, kv_both, local CPU tier: LMCACHE_CHUNK_SIZE=256, LMCACHE_LOCAL_CPU=True,
LMCACHE_MAX_LOCAL_CPU_SIZE=1; vLLM's prefix cache off). Every prompt of a process is distinct, so
neither vLLM's prefix cache nor LMCache ever hits: this is the cost on the compute path (LMCache
looks up, misses and stores), not the gain of a hit.

    .venv/bin/python bench/overhead.py                      # defaults: 5 rounds, hidden 512, 8 layers
    .venv/bin/python bench/overhead.py --runs 1 --prompt-tokens 128 --batch 2 --output-tokens 8 \\
        --hidden 64 --layers 2                              # smoke

Each of --runs rounds starts, per config, one engine process per side (offline ``LLM``,
VLLM_ENABLE_V1_MULTIPROCESSING=0), the side that goes first alternating from round to round and
config to config so that drift of a busy machine hits both. Each process:

 1. warm-up: the check prompt (--prompt-tokens long, 8 greedy tokens: the tokens compared between
    sides), then a batch like the measured one with 4 output tokens;
 2. TTFT: wall time of generate(max_tokens=1) of a --prompt-tokens prompt, the median of 5
    distinct prompts;
 3. throughput: output tokens/s of one generate() of --batch requests (64-token prompts, distinct)
    x --output-tokens tokens with ignore_eos, the median of 3 such batches;

and prints one JSON line. Per round and config the bench prints the ratios kvstack vs stock as
speed ratios (> 1: kvstack faster): TTFT stock_ttft / kvstack_ttft, throughput kvstack_tps /
stock_tps. At the end, for each ratio min / median / max over the rounds and the verdict: the
median against the target (--target, issue 27: 0.98). The greedy tokens of the check prompt must
be equal on every process (stock and kvstack, every config and round).

The last line carries every figure:

    RESULT none_ttft=MEDIAN[MIN-MAX] none_tput=... lmcache_ttft=... lmcache_tput=... (then the
    median absolute figures per side) tokens=equal runs=N target=0.98 verdict=meets|BELOW host=CPU

Exit status: 0; 1 when an engine process failed (its figures are n/a, its log is kept and named);
2 when the tokens differ between processes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstack.testbed.engine import failure_reason  # noqa: E402

CONFIGS = ("none", "lmcache")
SIDES = ("stock", "kvstack")
CHECK_TOKENS = 8
TTFT_REPS = 5  # distinct prompts timed per process: the median is the process's TTFT
TPUT_REPS = 3  # batches timed per process: the median is the process's throughput
TPUT_PROMPT = 64  # tokens of each request of the throughput batch
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
               "LMCACHE_DISABLE_BANNER": "1"}


def build_model(dest: Path, hidden: int, layers: int) -> Path:
    """A random-weight Llama (kvstack.testbed.tiny_models' "llama", wider and deeper) in `dest`."""
    from kvstack.testbed import tiny_models as tm

    base = tm.MODELS["llama"]
    heads = max(4, hidden // 64)
    cfg = dict(base.config, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=2, head_dim=max(32, hidden // heads),
               max_position_embeddings=16384)
    stamp = dest / "bench-config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    spec = tm.TinyModel(name="llama-bench", architecture=base.architecture, config_class=base.config_class,
                        config=cfg, engine=dict(base.engine))
    tm._write_model(spec, dest)  # weights and the tiny models' tokenizer (train_tokenizer)
    stamp.write_text(json.dumps(cfg))
    return dest


def prompt(kind: str, i: int, n: int) -> list[int]:
    """Token ids of prompt `i` of `kind` ("check", "ttft", "warm", "batch"): the same on every side
    and round, distinct from every other prompt of a process (no prefix-cache or LMCache hit)."""
    rng = random.Random(f"{kind}-{i}")
    return [rng.randrange(3, 1000) for _ in range(n)]


# ------------------------------------------------------------------------------------------
# Engine process
# ------------------------------------------------------------------------------------------

def child(args) -> None:
    """One engine process: one side (the overlay in $KVSTACK_OVERLAY, or none), one config."""
    from kvstack.release import overlay

    overlaid = overlay.install()  # stock vLLM: before vLLM is imported
    from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs

    apply_engine_env()
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = llm_kwargs("llama", args.model_dir, max_model_len=max(args.prompt_tokens, TPUT_PROMPT)
                    + max(args.output_tokens, CHECK_TOKENS) + 16, max_num_seqs=args.batch,
                    max_num_batched_tokens=max(args.prompt_tokens, args.batch * TPUT_PROMPT))
    if args.config == "lmcache":
        kw["enable_prefix_caching"] = False  # distinct prompts anyway: nothing hits
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    try:
        llm = LLM(**kw)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(3)
    res = {"side": args.side, "config": args.config, "startup_s": round(time.perf_counter() - t0, 2)}
    # The control that the stock side ran stock's code: modules imported from the overlay.
    root = os.environ.get(overlay.ENV)
    res["overlaid_modules"] = (sum(1 for m in list(sys.modules.values())
                                   if str(getattr(m, "__file__", "") or "").startswith(root))
                               if overlaid and root else 0)
    try:
        _measure(args, llm, SamplingParams, res)
    except BaseException as exc:  # an engine that died must not leave this process hanging
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(3)
    print(json.dumps(res), flush=True)
    os._exit(0)  # in-process LMCache engines do not exit on their own (docs/hybrid-lmcache.md)


def _measure(args, llm, SamplingParams, res: dict) -> None:
    def gen(prompts, sp):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0, outs

    # 1. warm-up; the check prompt's tokens are compared between processes
    _, outs = gen([prompt("check", 0, args.prompt_tokens)], SamplingParams(temperature=0, max_tokens=CHECK_TOKENS))
    res["tokens"] = list(outs[0].outputs[0].token_ids)
    gen([prompt("warm", i, TPUT_PROMPT) for i in range(args.batch)],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # 2. TTFT
    one = SamplingParams(temperature=0, max_tokens=1)
    ttfts = []
    for i in range(TTFT_REPS):
        t, outs = gen([prompt("ttft", i, args.prompt_tokens)], one)
        if int(outs[0].num_cached_tokens or 0):
            raise RuntimeError(f"TTFT prompt {i} hit {outs[0].num_cached_tokens} cached tokens")
        ttfts.append(t)
    res["ttft_s"] = statistics.median(ttfts)
    res["ttft_all_s"] = [round(t, 4) for t in ttfts]
    # 3. throughput
    sp = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    tps = []
    for r in range(TPUT_REPS):
        t, outs = gen([prompt("batch", r * args.batch + i, TPUT_PROMPT) for i in range(args.batch)], sp)
        tps.append(sum(len(o.outputs[0].token_ids) for o in outs) / t)
    res["tps"] = statistics.median(tps)
    res["tps_all"] = [round(x, 1) for x in tps]


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------

def short_host() -> str:
    """The CPU in one word (no spaces: the RESULT line splits on them)."""
    from kvstack.testbed.precision import cpu_features

    f = cpu_features()
    model = re.sub(r"\((R|TM|tm)\)|\bCPU\b|@.*$|\bProcessor\b", "", f["model"])
    isa = "AMX" if f["amx"] else ("AVX512" if f["avx512"] else "noAVX512")
    return "_".join(model.split() + [f"{f['cores']}cores", isa])


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}[{min(xs):.2f}-{max(xs):.2f}]" if xs else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="rounds (default 5): each runs every config on both sides")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="TTFT prompt length (default 1024)")
    ap.add_argument("--batch", type=int, default=8, help="requests of the throughput batch (default 8)")
    ap.add_argument("--output-tokens", type=int, default=64, help="tokens per request of the batch (default 64)")
    ap.add_argument("--hidden", type=int, default=512, help="model hidden size (default 512)")
    ap.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--target", type=float, default=0.98, help="the median ratio to meet (default 0.98)")
    ap.add_argument("--engine-timeout", type=float, default=600, help="seconds per engine process (default 600)")
    ap.add_argument("--model-root", default=str(REPO / "build" / "bench-models"))
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        child(args)
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"unknown configs {bad}")
    if args.runs < 1 or args.batch < 1 or args.output_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--runs, --batch, --output-tokens and --prompt-tokens must be positive")

    from kvstack.testbed.family_table import build_stock_overlay

    start = time.monotonic()
    model = build_model(Path(args.model_root) / f"llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    stock_overlay = build_stock_overlay(work / "stock-overlay")
    print(f"model: {model} ({size / 2**20:.1f} MiB of weights); TTFT prompt {args.prompt_tokens} tokens, "
          f"batch {args.batch} x {args.output_tokens} tokens; configs {','.join(configs)}; {args.runs} rounds; "
          f"stock overlay {stock_overlay}", flush=True)
    base_env = {k: v for k, v in os.environ.items() if k != "KVSTACK_OVERLAY"}
    base_env.update({"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "HF_HUB_OFFLINE": "1"})

    def engine(rnd: int, config: str, side: str) -> dict:
        env = dict(base_env)
        if side == "stock":
            env["KVSTACK_OVERLAY"] = str(stock_overlay)
        if config == "lmcache":
            env.update(LMCACHE_ENV)
        cmd = [sys.executable, __file__, "--role", "measure", "--side", side, "--config", config,
               "--model-dir", str(model), "--prompt-tokens", str(args.prompt_tokens), "--batch", str(args.batch),
               "--output-tokens", str(args.output_tokens)]
        log = work / f"round{rnd}-{config}-{side}.log"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.engine_timeout)
            text, rc = proc.stdout + "\n" + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = ((exc.stdout or b"").decode(errors="replace") + "\n"
                    + (exc.stderr or b"").decode(errors="replace"))
            log.write_text(text[-50000:])
            return {"error": f"did not finish in {args.engine_timeout:.0f} s: {failure_reason(text)} (log {log})"}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        out = json.loads(lines[-1]) if lines else {}
        if rc != 0 or "error" in out or not out:
            log.write_text(text[-50000:])
            return {"error": f"{out.get('error') or f'exited {rc}: {failure_reason(text)}'} (log {log})"}
        if side == "stock" and not out.get("overlaid_modules"):
            return {"error": "the stock side imported no module from the stock overlay"}
        return out

    # results[config][side] = [per round result]
    results = {c: {s: [] for s in SIDES} for c in configs}
    ratios = {c: {"ttft": [], "tput": []} for c in configs}
    failed = False
    for rnd in range(args.runs):
        for ci, config in enumerate(configs):
            order = SIDES if (rnd + ci) % 2 == 0 else SIDES[::-1]
            got = {}
            for side in order:
                r = engine(rnd, config, side)
                got[side] = r
                results[config][side].append(r)
                head = f"round {rnd + 1}/{args.runs} {config:7s} {side:7s}"
                if "error" in r:
                    failed = True
                    print(f"{head} FAILED: {r['error']}", flush=True)
                else:
                    print(f"{head} TTFT {r['ttft_s']:.4f} s (of {r['ttft_all_s']}), {r['tps']:.1f} tok/s "
                          f"(of {r['tps_all']}), start-up {r['startup_s']:.1f} s, tokens {r['tokens']}"
                          + (f", {r['overlaid_modules']} stock modules" if side == "stock" else ""), flush=True)
            s, k = got["stock"], got["kvstack"]
            if "error" in s or "error" in k:
                continue
            tt, tp = s["ttft_s"] / k["ttft_s"], k["tps"] / s["tps"]
            ratios[config]["ttft"].append(tt)
            ratios[config]["tput"].append(tp)
            print(f"round {rnd + 1}/{args.runs} {config:7s} kvstack vs stock: TTFT {tt:.3f}x, throughput {tp:.3f}x "
                  f"(> 1: kvstack faster)", flush=True)

    # tokens: every process's check-prompt tokens must be the same
    seen = {(c, s, i): r["tokens"] for c in configs for s in SIDES
            for i, r in enumerate(results[c][s]) if "error" not in r}
    distinct = {tuple(t) for t in seen.values()}
    tokens_equal = len(distinct) <= 1
    if seen:
        ref = next(iter(seen.values()))
        print(f"tokens: {'equal' if tokens_equal else 'DIFFER'} on {len(seen)} processes "
              f"(check prompt's {CHECK_TOKENS} greedy tokens {ref})", flush=True)
        if not tokens_equal:
            for key, t in seen.items():
                print(f"  round {key[2] + 1} {key[0]} {key[1]}: {t}", flush=True)

    fields, below = [], []
    for config in configs:
        for what, label in (("ttft", "TTFT"), ("tput", "throughput")):
            xs = ratios[config][what]
            if xs:
                med = statistics.median(xs)
                ok = med >= args.target
                if not ok:
                    below.append(f"{config}_{what}")
                print(f"{config:7s} {label:10s} kvstack/stock speed ratio: median {med:.3f}, min {min(xs):.3f}, "
                      f"max {max(xs):.3f} over {len(xs)} rounds: {'meets' if ok else 'BELOW'} target {args.target}",
                      flush=True)
            else:
                below.append(f"{config}_{what}")
            fields.append(f"{config}_{what}={spread(xs)}")
    for config in configs:  # absolute figures: medians over the rounds
        for side in SIDES:
            ok = [r for r in results[config][side] if "error" not in r]
            fields.append(f"{config}_{side}_ttft_s=" + (f"{statistics.median(r['ttft_s'] for r in ok):.4f}"
                                                        if ok else "n/a"))
            fields.append(f"{config}_{side}_tps=" + (f"{statistics.median(r['tps'] for r in ok):.1f}"
                                                     if ok else "n/a"))
    verdict = "n/a" if failed and not any(ratios[c]["ttft"] for c in configs) else ("meets" if not below else "BELOW")
    print(f"verdict: {verdict} (target {args.target} on the median of every ratio"
          + (f"; below or missing: {', '.join(below)}" if below else "") + f"); {time.monotonic() - start:.0f} s",
          flush=True)
    if failed:
        print(f"logs of failed engines: {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    fields += [f"tokens={'equal' if tokens_equal and seen else ('DIFFER' if seen else 'n/a')}",
               f"runs={args.runs}", f"target={args.target}", f"verdict={verdict}", f"host={short_host()}"]
    print("RESULT " + " ".join(fields), flush=True)
    if seen and not tokens_equal:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
