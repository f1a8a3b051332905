#!/usr/bin/env python3
"""Patched vs unpatched, end to end, per attention backend: the KV-cache layout ladder (issue 3).

The ladder is the patches of patches/0.25/vllm/series (base 0.25; it is upstream from vLLM 0.27) whose header says `Kvstack-Issue: 3`. For each
attention backend and each tiny random-weight model (llama, llama4, qwen3next), run greedy
generation twice, each in its own process: once with the ladder and once without it. Nothing
installed is modified: one of the two sides is the installed vLLM as it is, the other one an
overlay (kvstack/release/overlay.py: copies of the files the ladder touches, put in front of the
installed package).
  - vLLM with kvstack's whole series applied (the usual case: the kvstack venv or image):
    the unpatched side is an overlay with the ladder taken out again (git apply -R).
  - vLLM without the ladder (a pristine wheel, or one with only the earlier patches): the
    patched side is an overlay with the ladder applied.
Prints identical/different per backend and model; the last line sums it up.

GPU machine: a venv or the cuda image with the pinned CUDA wheel and kvstack's series
(scripts/apply_patches.sh --site-packages ...), then

    python ci/gpu/check_layout.py                     # FLASH_ATTN, FLASHINFER, TRITON_ATTN

Without a GPU, `--backends CPU` runs the same comparison on vLLM's CPU engine (CI does:
tests/env/layout/test_gpu_check_script.py).

Exit status: 0 every pair identical; 1 a pair differs or a run failed; 2 bad usage, or the
ladder neither applies to nor comes out of the installed vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_BACKENDS = "FLASH_ATTN,FLASHINFER,TRITON_ATTN"
MODELS = "llama,llama4,qwen3next"
PROMPTS = [[(i * 37) % 900 + 3 for i in range(n)] for n in (5, 37, 100, 300)]


def child(model: str, backend: str, work: Path, out: Path) -> None:
    from kvstack.release import overlay
    from kvstack.testbed import tiny_models

    overlay.install()  # $KVSTACK_OVERLAY, when set: the patched run
    tiny_models.apply_engine_env()
    from vllm import LLM, SamplingParams

    model_dir = tiny_models.make_model(model, work / "models" / model)
    kw = tiny_models.llm_kwargs(model, model_dir, max_model_len=512)
    if backend != "CPU":
        kw.update(attention_config={"backend": backend}, gpu_memory_utilization=0.3)
        kw.update(tiny_models.apply_gpu_env(model))  # no FlashInfer carried: its fallbacks
        if os.environ.get("KVSTACK_LAYOUT_JOBS", "1") != "1":
            # runs share the GPU: a fixed KV cache skips vLLM's memory profiling, which fails
            # when another process frees device memory meanwhile
            kw.update(gpu_memory_utilization=0.08, kv_cache_memory_bytes=512 << 20)
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


def run(model: str, backend: str, work: Path, tag: str, overlay_dir: Path | None,
        jobs: int = 1) -> list | str:
    """One greedy run in a child process; `overlay_dir` (when set) is put in front of vLLM."""
    out = work / f"{backend}-{model}-{tag}.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "KVSTACK_OVERLAY"}
    env["KVSTACK_LAYOUT_JOBS"] = str(jobs)
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
        return f"run failed ({tag}): no overlaid module was imported"
    return result["tokens"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Exit: 0 identical, 1 different/failed, 2 usage/apply.")
    ap.add_argument("--backends", default=DEFAULT_BACKENDS,
                    help=f"comma-separated vLLM attention backends, or CPU (default {DEFAULT_BACKENDS})")
    ap.add_argument("--models", default=MODELS, help=f"comma-separated tiny models (default {MODELS})")
    ap.add_argument("--series-dir", type=Path, default=ROOT / "patches" / "0.25" / "vllm",
                    help="the series holding the ladder (default patches/0.25/vllm)")
    ap.add_argument("--issue", default="3",
                    help="the ladder is the series' patches with this Kvstack-Issue (default 3)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check",
                    help="scratch folder: models, overlay, per-run results and logs")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time (default 1); above 1 each GPU run takes a fixed 512 MiB "
                         "KV cache (kv_cache_memory_bytes) instead of profiling device memory")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, backend, work, out = args.child
        child(model, backend, Path(work), Path(out))
        return 0

    from kvstack.release import overlay

    spec = importlib.util.find_spec("vllm")
    # origin None: a namespace package (the checkout's vllm/ of pins), not an installed vLLM
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        print(f"error: vLLM is not importable with {sys.executable}", file=sys.stderr)
        return 2
    site = Path(list(spec.submodule_search_locations)[0]).parent
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        patches = overlay.issue_patches(args.series_dir, args.issue)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not patches:
        print(f"error: no patch in {args.series_dir}/series says Kvstack-Issue: {args.issue}",
              file=sys.stderr)
        return 2
    sides, problems = None, []
    for reverse in (True, False):  # the ladder installed already, else not yet
        try:
            files = overlay.build_overlay(patches, site, args.work / "overlay", reverse=reverse)
        except (OSError, RuntimeError) as e:
            problems.append(str(e))
            continue
        sides = ({"unpatched": args.work / "overlay", "patched": None} if reverse
                 else {"unpatched": None, "patched": args.work / "overlay"})
        how = ("installed vLLM has the ladder; unpatched side = overlay with it taken out"
               if reverse else "installed vLLM lacks the ladder; patched side = overlay with it")
        break
    if sides is None:
        print("error: the ladder neither comes out of nor applies to the installed vLLM "
              f"({site}); is it another version, or partly patched?\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 2
    print(f"vLLM at {site}; ladder: {len(patches)} patch(es) of {args.series_dir}/series "
          f"(Kvstack-Issue: {args.issue}), {len(files)} file(s); {how}", flush=True)

    failures = 0
    backends = [b for b in args.backends.split(",") if b]
    models = [m for m in args.models.split(",") if m]
    pairs = [(b, m) for b in backends for m in models]
    jobs = max(1, args.jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # --jobs runs side by side
        futures = [(b, m, pool.submit(run, m, b, args.work, "unpatched", sides["unpatched"], jobs),
                    pool.submit(run, m, b, args.work, "patched", sides["patched"], jobs))
                   for b, m in pairs]
        for backend, model, f_base, f_patched in futures:  # in order, as each pair completes
            base, patched = f_base.result(), f_patched.result()
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
