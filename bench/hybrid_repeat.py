"""Repeat-prompt TTFT of a hybrid model (Qwen3-Next layout) on the CPU engine, with and without LMCache.

    .venv/bin/python bench/hybrid_repeat.py [--prompt-tokens 4096] [--hidden 768] [--layers 16]

Builds a random-weight Qwen3NextForCausalLM (3 gated delta-net layers per full-attention layer,
343 MiB of bf16 weights at the defaults) under build/bench-models/, then, each in a fresh
process: (a) no KV connector: a warm-up prompt of the same length, the prompt, then the same prompt again, timing the second;
(b) LMCacheConnectorV1 with a local CPU backend: a warm-up prompt, the prompt (stored, hybrid state saved), the
engine's KV cache zeroed, the same prompt again, timing the second (loaded: K/V + hybrid state).
TTFT = wall time of a generate() with max_tokens=1. Prints both and the ratio (the headline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(dest: Path, hidden: int, layers: int) -> Path:
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


def child(args) -> None:
    from kvstack.testbed.tiny_models import apply_engine_env

    apply_engine_env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(model=args.model_dir, tokenizer=args.model_dir, dtype="bfloat16",
              mamba_ssm_cache_dtype="float32", max_model_len=args.prompt_tokens + 64,
              max_num_batched_tokens=args.step, max_num_seqs=1, enforce_eager=True, seed=0,
              enable_prefix_caching=False)
    if args.mode == "lmcache":
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    llm = LLM(**kw)
    prompt = [(i * 7919) % 900 + 3 for i in range(args.prompt_tokens)]
    sp = SamplingParams(temperature=0, max_tokens=1)
    # Warm-up on another prompt of the same length: the first prefill of a size pays one-time costs.
    warm = [(i * 104729) % 900 + 3 for i in range(args.prompt_tokens)]
    llm.generate([{"prompt_token_ids": warm}], sp, use_tqdm=False)
    t0 = time.perf_counter()
    first = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    cold = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    for kv in runner.kv_caches:  # a repeat must not find anything in the engine itself
        for t in (kv if isinstance(kv, (list, tuple)) else [kv]):
            t.zero_()
    t0 = time.perf_counter()
    second = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    repeat = time.perf_counter() - t0
    print(json.dumps({"mode": args.mode, "cold_s": cold, "repeat_s": repeat,
                      "first": list(first[0].outputs[0].token_ids),
                      "second": list(second[0].outputs[0].token_ids)}), flush=True)
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="LMCache chunk size")
    ap.add_argument("--step", type=int, default=256,
                    help="max_num_batched_tokens, a multiple of --chunk (hybrid state is saved at step "
                         "boundaries, so step == chunk lets a repeat reuse all but the last chunk)")
    ap.add_argument("--mode", choices=["none", "lmcache"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        child(args)
        return 0
    model = build_model(REPO / "build" / "bench-models" / f"qwen3next-h{args.hidden}-l{args.layers}",
                        args.hidden, args.layers)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model: {model} ({size / 2**20:.0f} MiB of weights), prompt {args.prompt_tokens} tokens")
    results = {}
    state_dir = REPO / "build" / "bench-models" / "hybrid-state"
    for mode in ("none", "lmcache"):
        env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_CHUNK_SIZE": str(args.chunk),
               "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "4",
               "LMCACHE_HYBRID_STATE_DIR": str(state_dir), "LMCACHE_DISABLE_BANNER": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [sys.executable, __file__, "--mode", mode, "--model-dir", str(model),
               "--prompt-tokens", str(args.prompt_tokens), "--step", str(args.step)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if not line:
            print(res.stdout[-3000:], res.stderr[-3000:])
            return 1
        results[mode] = json.loads(line[-1])
        r = results[mode]
        print(f"{mode:8s} cold TTFT {r['cold_s']:.3f} s, repeat TTFT {r['repeat_s']:.3f} s")
    same = results["none"]["second"] == results["lmcache"]["second"]
    ratio = results["none"]["repeat_s"] / results["lmcache"]["repeat_s"]
    print(f"repeat TTFT without LMCache / with LMCache hybrid restore: {ratio:.2f}x "
          f"(first tokens {'equal' if same else 'DIFFER'})")
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
