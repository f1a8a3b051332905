"""One fresh CPU engine running tiny gpt-oss (a sliding-window and a full-attention layer, both
with sinks; bf16, block size 32) on vLLM's non-AMX CPU attention kernel (the "vec" ISA: AMX is
hidden from vLLM's ISA choice, so an AMX host runs what every CPU without AMX runs) with two
OpenMP threads; one prompt three times, then a short and a long prompt together three times, with
the prefix cache off. Prints "THREADS n" (the OpenMP threads), "ENV {...}" (the OpenMP variables)
and "RUNS [...]" (six runs: the tokens of each prompt).

--hma off: the hybrid KV cache manager off (both layers in one KV cache group with mixed windows,
as vLLM runs the model with LMCacheConnectorV1). --split-mixed: the negative control, kvstack's
cpu_attn patch undone (the group's KV split kept on). Used by test_cpu_attn_mixed_windows.py."""

import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--model-dir", required=True)
ap.add_argument("--hma", choices=["on", "off"], required=True)
ap.add_argument("--split-mixed", action="store_true")
args = ap.parse_args()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
# Two OpenMP threads on every core of the machine, whatever this process's share of the cores is (a
# test worker's is one core): with one thread the CPU attention never splits the KV, and with two
# threads on one core one of them may take every task, so the control could not fail.
os.environ["OMP_NUM_THREADS"] = "2"
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
import torch  # noqa: E402

torch.set_num_threads(2)  # whatever an OpenMP variable the caller's environment carries says

torch.cpu._is_amx_tile_supported = lambda: False  # vLLM's CPU attention takes the "vec" kernel
from vllm import LLM, SamplingParams  # noqa: E402

from kvstack.testbed import tiny_models  # noqa: E402

if args.split_mixed:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    CPUAttentionMetadataBuilder._mixed_windows = lambda self: False
tiny_models.apply_engine_env()
llm = LLM(**tiny_models.llm_kwargs("gpt_oss", args.model_dir, max_num_batched_tokens=64,
                                   enable_prefix_caching=False,
                                   disable_hybrid_kv_cache_manager=args.hma == "off"))
# One prompt alone, then a short and a long one decoding together (the long one's first KV split,
# outside the sliding window, then follows the short one's work in the same thread's task list).
runs = []
for lens in ([200], [40, 300]):
    prompts = [[(i * 53) % 900 + 3 for i in range(n)] for n in lens]
    for _ in range(3):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
print("THREADS " + str(torch.get_num_threads()), flush=True)
print("ENV " + json.dumps({k: v for k, v in os.environ.items()
                           if k.startswith(("OMP_", "KMP_", "GOMP_", "VLLM_CPU_"))}), flush=True)
print("RUNS " + json.dumps(runs), flush=True)
sys.stdout.flush()
os._exit(0)
