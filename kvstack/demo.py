"""`kvstack demo`: a short greedy generation through the (patched) vLLM CPU engine.

It writes a tiny random-weight model (kvstack.tiny_models) into a cache folder, starts the real
vLLM engine in this process with the offline `LLM` API, generates a few tokens greedily for a fixed
prompt and prints each step. The text is gibberish (the weights are random); what the demo shows
is that the installed engine, with kvstack's patch stack applied, loads and runs a model end to end.
The last line of the output is `generated: <text>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvstack import tiny_models

DEFAULT_MAX_TOKENS = 16


def _printable(text: str) -> str:
    """`text` on one line: control and other unprintable characters shown as escapes."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _say(step: int, total: int, message: str) -> None:
    print(f"[{step}/{total}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstack demo",
        description="Make a tiny random-weight model, start the vLLM CPU engine on it, greedily "
                    "generate a few tokens for a fixed prompt and print each step. The output ends "
                    "with a line 'generated: <text>'.",
    )
    parser.add_argument("--model", choices=tiny_models.MODEL_NAMES, default="llama",
                        help="which tiny model to run (default: %(default)s)")
    parser.add_argument("--cache-dir", default=str(tiny_models.DEFAULT_OUT),
                        help="where tiny models are written and reused (default: %(default)s)")
    parser.add_argument("--prompt", default=tiny_models.DEMO_PROMPT, help="prompt text (default: a fixed sentence)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="tokens to generate (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's INFO log lines")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
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
    prompt_ids = list(llm.get_tokenizer().encode(args.prompt))
    _say(4, total, f"prompt: {args.prompt!r} -> {len(prompt_ids)} token ids {prompt_ids}")

    # 5. Greedy generation.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([args.prompt], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    if list(out.prompt_token_ids or []) != prompt_ids:
        print(f"note: the engine used prompt token ids {list(out.prompt_token_ids or [])}", flush=True)
    _say(5, total, f"generated {len(token_ids)} token ids in {gen_s:.2f} s (greedy): {token_ids}")

    # 6. The text.
    _say(6, total, f"text of the generated tokens: {completion.text!r} (finish reason: {completion.finish_reason})")
    del llm
    print(f"generated: {_printable(completion.text)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
