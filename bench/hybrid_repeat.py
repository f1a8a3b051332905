"""Repeat-prompt TTFT of a hybrid model (Qwen3-Next layout) on the CPU engine: every way to reuse it.

Headline: route 3 vs recompute, i.e. a repeat served by a NEW engine process whose only source is a
shared LMCache backend (an lmcache_server on 127.0.0.1) holding both the K/V and the hybrid
(Mamba/GDN) state, compared with computing the prompt again.

    .venv/bin/python bench/hybrid_repeat.py                     # defaults: 343 MiB model, 4128 tokens
    .venv/bin/python bench/hybrid_repeat.py --prompt-tokens 544 --hidden 128 --layers 4 --step 256   # small

Builds a random-weight Qwen3NextForCausalLM (3 gated delta-net layers per full-attention layer)
under build/bench-models/ and gives it a long-memory recurrent state (kvstack.testbed.long_memory: the
random one forgets its state within a token, so a wrong restored state would give the same tokens;
the prompt ends a few tokens past the last step boundary, so the restored state decides them),
then measures, each figure in its own engine process(es), all in one run:

 1. recompute       no KV connector, no prefix cache: the repeat is computed again (the baseline).
 2. vllm-cache      vLLM's own hybrid prefix caching (enable_prefix_caching, mamba_cache_mode="align"),
                    the repeat in the same engine (what a user already has, one process only).
 3. lmcache-inproc  in-process LMCacheConnectorV1 (kvstack's patched adapter) with an `lmcache_server`
                    on 127.0.0.1 as the only store: engine A computes the prompt, stores its K/V and
                    hybrid state in the server and exits; a NEW engine process B, sharing nothing with A
                    but the server (no local CPU tier, no files), serves the repeat from it. The
                    negative control: B then serves it once more with the restored states zeroed;
                    that must hit as much and change the tokens ("control held"), or the "equal"
                    above could not have failed.
 4. lmcache-mp      LMCache's multi-process route: `python -m lmcache.v1.multiprocess.server` on
                    127.0.0.1 + LMCacheMPConnector (align mode): engine A, then a NEW engine B.
 5. lmcache+vllm    one engine with LMCacheConnectorV1 AND vLLM's prefix cache (align), repeat TTFT
                    compared with 2 (must not be slower).

TTFT = wall time of generate(max_tokens=1) after a warm-up prompt of the same length in the same
process; routes 1, 2 and 5 (one engine) time the repeat REPEATS times and report the median, routes 3
and 4 time the new process's first repeat (the one served from the shared backend). Tokens: the 8 greedy tokens of the repeat (served from the route's cache) must equal the
recompute run's ("equal"/"DIFFER" per route). A route that cannot run prints "n/a (<why>)".
The last line, `RESULT ...`, carries every figure: seconds of the recompute repeat, then each
route's repeat TTFT as a speed-up ratio over recompute (x), 5 also over 2. The line before it,
`HEADLINE ...`, states route 3 against recompute, with its control.
Exit status: 0, or 2 when a route that ran produced different tokens or route 3's control failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstack.testbed.engine import failure_reason  # noqa: E402

ROUTES = ("recompute", "vllm-cache", "lmcache-inproc", "lmcache-mp", "lmcache+vllm")
CHECK_TOKENS = 8
REPEATS = 3  # timed repeats in the same engine (routes 1, 2, 5): the median is reported


def build_model(dest: Path, hidden: int, layers: int) -> Path:
    """The bench's model in `dest`: the random-weight one (made in dest-random) with a long-memory
    recurrent state."""
    from kvstack.testbed.long_memory import long_memory_copy

    random = _build_random_model(dest.with_name(dest.name + "-random"), hidden, layers)
    return long_memory_copy("qwen3next", random, dest)


def _build_random_model(dest: Path, hidden: int, layers: int) -> Path:
    from kvstack.testbed import tiny_models as tm

    base = tm.MODELS["qwen3next"]
    heads = max(4, hidden // 64)
    cfg = dict(base.config, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
               num_attention_heads=heads, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=64,
               linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
               max_position_embeddings=16384)
    stamp = dest / "bench-config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    spec = tm.TinyModel(name="qwen3next-bench", architecture=base.architecture,
                        config_class=base.config_class, config=cfg, engine=dict(base.engine))
    tm._write_model(spec, dest)
    stamp.write_text(json.dumps(cfg))
    return dest


# ------------------------------------------------------------------------------------------
# Engine process
# ------------------------------------------------------------------------------------------

def child(args) -> None:
    """One engine process. --role: what this process does (see main)."""
    from kvstack.testbed.tiny_models import apply_engine_env

    apply_engine_env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    role = args.role
    align = role in ("apc", "mp-a", "mp-b", "lmc-apc")
    kw = dict(model=args.model_dir, tokenizer=args.model_dir, dtype="bfloat16",
              mamba_ssm_cache_dtype="float32", max_model_len=args.prompt_tokens + 64,
              max_num_batched_tokens=args.step, max_num_seqs=1, enforce_eager=True, seed=0,
              enable_prefix_caching=align)
    if align:
        # vLLM caches hybrid prefixes in whole blocks; one block per step (LMCache's MP connector
        # asks for block_size <= max_num_batched_tokens < 2 * block_size on 0.5.3).
        kw.update(mamba_cache_mode="align", block_size=args.step)
    if role in ("lmc-a", "lmc-b", "lmc-apc"):
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    elif role in ("mp-a", "mp-b"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": args.port,
                                       "lmcache.mp.mq_timeout": 60})
    try:
        llm = LLM(**kw)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(3)
    try:
        _measure(args, llm, SamplingParams)
    except BaseException as exc:  # an engine that died must not leave this process hanging
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(3)


def _measure(args, llm, SamplingParams) -> None:
    role = args.role
    prompt = [(i * 7919) % 900 + 3 for i in range(args.prompt_tokens)]
    warm = [(i * 104729) % 900 + 3 for i in range(args.prompt_tokens)]
    one = SamplingParams(temperature=0, max_tokens=1)
    check = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS)

    def gen(p, sp):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    res = {"role": role, "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    # Warm-up on another prompt of the same length: the first prefill of a size pays one-time costs.
    gen(warm, one)
    if role in ("lmc-a", "mp-a"):  # compute and store the prompt, then leave
        res["cold_s"], res["tokens"], _ = gen(prompt, check)
        print(json.dumps(res), flush=True)
        time.sleep(args.flush_s)  # puts to the server are asynchronous
        os._exit(0)
    if role in ("recompute", "apc", "lmc-apc"):  # the prompt once, then the timed repeat
        res["cold_s"], res["first_tokens"], _ = gen(prompt, check)
    if role == "mp-b":
        llm.reset_prefix_cache()  # the warm-up left nothing of the prompt, but be explicit
    if role in ("recompute", "apc", "lmc-apc"):
        # same engine: the repeat can be timed again; the median of REPEATS (one timing on 2 busy
        # cores moved these by 10-25%)
        times = []
        for _ in range(REPEATS):
            t, _, res["cached"] = gen(prompt, one)
            times.append(t)
        res["repeat_s"] = sorted(times)[len(times) // 2]
        res["repeat_all_s"] = [round(t, 3) for t in times]
    else:  # a new process's first repeat is the one served from the shared backend
        res["repeat_s"], _, res["cached"] = gen(prompt, one)
    if role == "mp-b":
        llm.reset_prefix_cache()  # the token check must be served by LMCache too
    _, res["tokens"], res["check_cached"] = gen(prompt, check)
    if role == "lmc-b":  # the negative control: the same repeat with the restored states zeroed
        from kvstack.testbed.long_memory import zeroing_switch

        zeroing_switch()[0] = True
        _, res["zeroed_tokens"], res["zeroed_cached"] = gen(prompt, check)
    print(json.dumps(res), flush=True)
    if role in ("lmc-b", "lmc-apc"):
        time.sleep(1.0)
    os._exit(0)  # in-process LMCache engines do not exit on their own (docs/hybrid-lmcache.md)


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------

def control_held(r: dict) -> bool:
    """Route 3's negative control: the zeroed-state repeat hit as much and gave other tokens."""
    return r.get("zeroed_cached") == r["check_cached"] and r.get("zeroed_tokens") not in (None, r["tokens"])


def main() -> int:
    from kvstack.testbed.backend_servers import free_port, running

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4128,
                    help="prompt length (default 4128: a repeat restores 4096 and computes the last 32 "
                         "tokens; after a longer tail the long-memory state is forgotten again and "
                         "route 3's control could not hold)")
    ap.add_argument("--hidden", type=int, default=768, help="model hidden size (default 768: 343 MiB)")
    ap.add_argument("--layers", type=int, default=16, help="layers, a multiple of 4 (default 16)")
    ap.add_argument("--chunk", type=int, default=256, help="LMCache chunk size of the in-process route")
    ap.add_argument("--step", type=int, default=512,
                    help="max_num_batched_tokens of every engine (the same for all routes), a multiple of "
                         "--chunk; also the block size of the align-mode engines (routes 2, 4, 5) and the "
                         "chunk size of the MP server, so it must hold the model's Mamba page (default 512)")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated subset of {','.join(ROUTES)}")
    ap.add_argument("--flush-s", type=float, default=3.0, help="seconds engine A waits for its puts")
    ap.add_argument("--engine-timeout", type=float, default=900, help="seconds per engine process")
    ap.add_argument("--model-root", default=str(REPO / "build" / "bench-models"))
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        child(args)
        return 0
    if args.step % args.chunk:
        ap.error("--step must be a multiple of --chunk")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    bad = [r for r in routes if r not in ROUTES]
    if bad:
        ap.error(f"unknown routes {bad}")
    if "recompute" not in routes:
        routes.insert(0, "recompute")  # every ratio is against it
    model = build_model(Path(args.model_root) / f"qwen3next-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model: {model} ({size / 2**20:.0f} MiB of weights), prompt {args.prompt_tokens} tokens, "
          f"step {args.step}, LMCache chunk {args.chunk}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hybrid-repeat-"))
    base_env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    base_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

    def engine(role: str, env_extra: dict | None = None, port: int = 0) -> dict:
        cmd = [sys.executable, __file__, "--role", role, "--model-dir", str(model), "--prompt-tokens",
               str(args.prompt_tokens), "--step", str(args.step), "--port", str(port),
               "--flush-s", str(args.flush_s), "--chunk", str(args.chunk)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env={**base_env, **(env_extra or {})},
                                 timeout=args.engine_timeout)
        except subprocess.TimeoutExpired as exc:
            tail = ((exc.stdout or b"").decode(errors="replace") + "\n" + (exc.stderr or b"").decode(errors="replace"))
            (work / f"{role}.log").write_text(tail[-20000:])
            raise RuntimeError(f"engine {role} did not finish in {args.engine_timeout} s: {failure_reason(tail)}")
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        out = json.loads(lines[-1]) if lines else {}
        if res.returncode != 0 or "error" in out or not out:
            tail = (res.stdout + "\n" + res.stderr)[-20000:]
            (work / f"{role}.log").write_text(tail)
            raise RuntimeError(out.get("error") or f"engine {role} exited {res.returncode}: {failure_reason(tail)}")
        return out

    results: dict[str, dict] = {}

    def run_route(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # a route that cannot run is reported, the others go on
            results[name] = {"na": " ".join(str(exc).split())[:400]}

    def lmc_env(port: int) -> dict:
        # The server is the only store: K/V and the hybrid state both go there (no local CPU tier).
        return {"LMCACHE_CHUNK_SIZE": str(args.chunk), "LMCACHE_LOCAL_CPU": "False",
                "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{port}",
                "LMCACHE_REMOTE_SERDE": "naive"}

    def route_inproc():
        port = free_port()
        server = [str(Path(sys.executable).with_name("lmcache_server")), "127.0.0.1", str(port)]
        with running(server, port, work / "lmcache_server.log", base_env, what="lmcache_server"):
            a = engine("lmc-a", lmc_env(port))
            b = engine("lmc-b", lmc_env(port))
        b["a_tokens"] = a["tokens"]
        return b

    def route_mp():
        port = free_port()
        server = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port",
                  str(port), "--chunk-size", str(args.step), "--l1-size-gb", "2", "--eviction-policy", "LRU",
                  "--supported-transfer-mode", "auto", "--disable-observability"]
        with running(server, port, work / "mp_server.log", base_env, what="LMCache MP server"):
            a = engine("mp-a", port=port)
            b = engine("mp-b", port=port)
        b["a_tokens"] = a["tokens"]
        return b

    plan = {
        "recompute": lambda: engine("recompute"),
        "vllm-cache": lambda: engine("apc"),
        "lmcache-inproc": route_inproc,
        "lmcache-mp": route_mp,
        "lmcache+vllm": lambda: engine("lmc-apc", {"LMCACHE_CHUNK_SIZE": str(args.chunk), "LMCACHE_LOCAL_CPU": "True",
                                                   "LMCACHE_MAX_LOCAL_CPU_SIZE": "4"}),
    }
    for name in routes:
        run_route(name, plan[name])
        r = results[name]
        if "na" in r:
            print(f"{name:15s} n/a ({r['na']})", flush=True)
        else:
            print(f"{name:15s} repeat TTFT {r['repeat_s']:.3f} s ({r['cached']} tokens cached, block "
                  f"{r['block_size']})", flush=True)

    base = results["recompute"]
    if "na" in base:
        print(f"RESULT recompute=n/a ({base['na']})")
        return 1
    ref = base["first_tokens"]
    differ = False
    fields = [f"recompute_s={base['repeat_s']:.3f}"]
    for name in routes[1:]:
        r = results[name]
        key = name.replace("+", "_plus_").replace("-", "_")
        if "na" in r:
            fields.append(f"{key}=n/a")
            continue
        same = r["tokens"] == ref and r.get("a_tokens", ref) == ref and r.get("first_tokens", ref) == ref
        differ |= not same
        ratio = base["repeat_s"] / r["repeat_s"]
        line = f"{name}: repeat TTFT {r['repeat_s']:.3f} s = {ratio:.2f}x vs recompute"
        if name == "lmcache+vllm" and "na" not in results.get("vllm-cache", {"na": 1}):
            vs = results["vllm-cache"]["repeat_s"] / r["repeat_s"]
            line += f", {vs:.2f}x vs vllm-cache"
            fields.append(f"{key}_vs_vllm_cache={vs:.2f}x")
        print(f"{line}; first tokens {'equal' if same else 'DIFFER'}", flush=True)
        fields.append(f"{key}={ratio:.2f}x({'equal' if same else 'DIFFER'},cached={r['cached']})")
    for name in routes[1:]:
        if "na" in results[name]:
            print(f"{name}: n/a ({results[name]['na']})", flush=True)
    print(f"logs of failed engines: {work}" if any("na" in r for r in results.values()) else "", flush=True)
    if "lmcache-inproc" in routes:
        r = results["lmcache-inproc"]
        if "na" in r:
            head = f"n/a ({r['na']})"
        else:
            same = r["tokens"] == ref and r["a_tokens"] == ref
            held = control_held(r)
            differ |= not held
            print(f"lmcache-inproc control: the restored states zeroed, {r['zeroed_cached']} tokens "
                  f"cached, tokens {'differ (held)' if held else 'EQUAL: FAILED, the equality could not fail'}",
                  flush=True)
            fields.append(f"lmcache_inproc_control={'held' if held else 'FAILED'}")
            head = (f"{r['repeat_s']:.3f} s vs recompute {base['repeat_s']:.3f} s = "
                    f"{base['repeat_s'] / r['repeat_s']:.2f}x, {r['cached']} tokens cached, "
                    f"tokens {'equal' if same else 'DIFFER'}, zeroed-state control "
                    f"{'held' if held else 'FAILED'}")
        print("HEADLINE repeat served by a new engine process through a shared lmcache_server (route 3): "
              + head, flush=True)
    print("RESULT " + " ".join(fields), flush=True)
    return 2 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
