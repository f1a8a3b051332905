#!/usr/bin/env python3
"""Patched vs unpatched, end to end, per attention backend: the KV-cache layout ladder (issue 3).

For each attention backend and each tiny random-weight model (llama, llama4, qwen3next), run
greedy generation twice, each in its own process: with the installed vLLM as it is (unpatched:
without the layout patches) and with the layout patches overlaid on it (kvstack/overlay.py: the
patched files are put in front of the installed package; nothing installed is modified). Prints
identical/different per backend and model; the last line sums it up.

GPU machine: a venv or the cuda image with the pinned CUDA wheel and kvstack's main series
(scripts/apply_patches.sh --site-packages ...), then

    python ci/gpu/check_layout.py                     # FLASH_ATTN, FLASHINFER, TRITON_ATTN

Without a GPU, `--backends CPU` runs the same comparison on vLLM's CPU engine (CI does:
tests/env/layout/test_gpu_check_script.py).

Exit status: 0 every pair identical; 1 a pair differs or a run failed; 2 bad usage, or the
patches do not apply to the installed vLLM (e.g. they are applied already).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_BACKENDS = "FLASH_ATTN,FLASHINFER,TRITON_ATTN"
MODELS = "llama,llama4,qwen3next"
PROMPTS = [[(i * 37) % 900 + 3 for i in range(n)] for n in (5, 37, 100, 300)]


def child(model: str, backend: str, work: Path, out: Path) -> None:
    from kvstack import overlay, tiny_models

    overlay.install()  # $KVSTACK_OVERLAY, when set: the patched run
    tiny_models.apply_engine_env()
    from vllm import LLM, SamplingParams

    model_dir = tiny_models.make_model(model, work / "models" / model)
    kw = tiny_models.llm_kwargs(model, model_dir, max_model_len=512)
    if backend != "CPU":
        kw.update(attention_config={"backend": backend}, gpu_memory_utilization=0.3)
    llm = LLM(**kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    root = os.environ.get(overlay.ENV, "")
    loaded = sorted(n for n, m in list(sys.modules.items())
                    if root and str(getattr(m, "__file__", "") or "").startswith(root))
    out.write_text(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                               "overlaid_modules": loaded}))
    os._exit(0)  # skip engine teardown: the result is written


def run(model: str, backend: str, work: Path, overlay_dir: Path | None) -> list | str:
    tag = "patched" if overlay_dir else "unpatched"
    out = work / f"{backend}-{model}-{tag}.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "KVSTACK_OVERLAY"}
    if overlay_dir:
        env["KVSTACK_OVERLAY"] = str(overlay_dir)
    res = subprocess.run([sys.executable, __file__, "--child", model, backend, str(work), str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    if not out.exists():
        (work / f"{backend}-{model}-{tag}.log").write_text(res.stdout + res.stderr)
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"run failed ({tag}, exit {res.returncode}): {tail[0][:200]}"
    result = json.loads(out.read_text())
    if overlay_dir and not result["overlaid_modules"]:
        return "run failed (patched): no overlaid module was imported"
    return result["tokens"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Exit: 0 identical, 1 different/failed, 2 usage/apply.")
    ap.add_argument("--backends", default=DEFAULT_BACKENDS,
                    help=f"comma-separated vLLM attention backends, or CPU (default {DEFAULT_BACKENDS})")
    ap.add_argument("--models", default=MODELS, help=f"comma-separated tiny models (default {MODELS})")
    ap.add_argument("--series-dir", type=Path, default=ROOT / "patches" / "pending" / "vllm",
                    help="the patches to overlay (default patches/pending/vllm, the layout ladder)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check",
                    help="scratch folder: models, overlay, per-run results and logs")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, backend, work, out = args.child
        child(model, backend, Path(work), Path(out))
        return 0

    from kvstack import overlay

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        print(f"error: vLLM is not importable with {sys.executable}", file=sys.stderr)
        return 2
    site = Path(list(spec.submodule_search_locations)[0]).parent
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        patches = overlay.series_patches(args.series_dir)
        files = overlay.build_overlay(patches, site, args.work / "overlay")
    except (OSError, RuntimeError) as e:
        print(f"error: {e}\n(are these patches applied to {site} already? compare against a vLLM "
              "with kvstack's main series only)", file=sys.stderr)
        return 2
    print(f"vLLM at {site}; overlay: {len(patches)} patch(es) from {args.series_dir}, "
          f"{len(files)} file(s)", flush=True)

    failures = 0
    backends = [b for b in args.backends.split(",") if b]
    models = [m for m in args.models.split(",") if m]
    for backend in backends:
        for model in models:
            base = run(model, backend, args.work, None)
            patched = run(model, backend, args.work, args.work / "overlay")
            if isinstance(base, str) or isinstance(patched, str):
                verdict = base if isinstance(base, str) else patched
                failures += 1
            elif base == patched:
                verdict = "identical"
            else:
                verdict = "DIFFERENT"
                failures += 1
            print(f"{backend:12s} {model:10s} {verdict}", flush=True)
    total = len(backends) * len(models)
    print(f"RESULT {total - failures}/{total} identical (backends {','.join(backends)}; "
          f"models {','.join(models)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
