"""One fresh CPU engine (tiny Llama, bf16, block size 32: vLLM's AMX attention kernel on an AMX
CPU) whose first step is a prompt of N tokens; prints "TOKENS [...]". With --no-amx-permission,
torch.cpu._init_amx is made a no-op first (what the engine did before kvstack's cpu_worker patch):
the test's negative control. Used by test_amx_first_step.py."""

import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--model-dir", required=True)
ap.add_argument("--tokens", type=int, default=1)
ap.add_argument("--no-amx-permission", action="store_true")
args = ap.parse_args()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
import torch  # noqa: E402

if args.no_amx_permission:
    torch.cpu._init_amx = lambda: True
from vllm import LLM, SamplingParams  # noqa: E402

from kvstack.testbed import tiny_models  # noqa: E402

tiny_models.apply_engine_env()
llm = LLM(**tiny_models.llm_kwargs("llama", args.model_dir, dtype="bfloat16", block_size=32,
                                   enable_prefix_caching=False))
prompt = [(i * 37) % 900 + 3 for i in range(args.tokens)]
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0),
                   use_tqdm=False)
print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
sys.stdout.flush()
os._exit(0)
