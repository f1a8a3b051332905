"""Tiny hybrids whose recurrent state matters, for restore claims that can fail: Qwen3-Next (gated
delta-net, GDN) and Granite-4 (Mamba2).

The random tiny Qwen3-Next (kvstack.testbed.tiny_models) forgets its recurrent state within a token:
A_log ~ 2 gives a per-token decay of about exp(-10), and its GDN outputs are small beside the
residual stream, so restoring a zeroed state gives the same greedy tokens as restoring the right
one; a "same tokens" claim built on it could not fail. `long_memory_qwen3next` copies it with a slow
decay (A_log = log(A_DECAY): exp(-A * softplus(.)) ~ 0.97 per token), conv1d, GDN out_proj and
lm_head scaled, so the state carries the prefix and a wrong or zeroed state changes the output.
`long_memory_copy("granite4", ...)` does the same to the tiny Granite-4's Mamba2 mixers (A_log,
conv1d and out_proj under ``mamba.``): the random one forgets its state as fast.

`zeroing_switch()` is the negative control's other half: while it is on, every hybrid state
LMCache's vLLM adapter restores is zeroed (a restore the tokens do not depend on could not fail a
comparison; with these models a zeroed state must change them).

From the shell (docs/hybrid-lmcache-usage.md's example): OUT/NAME, then OUT/NAME-long-memory:

    python -m kvstack.testbed.long_memory --out build/tiny-models qwen3next [granite4]

Used by the demo (it must run from an installed kvstack), the family table, bench/hybrid_repeat.py
and the tests (through tests/env/lmcache/hybrid_models.py). A copy is kept while its recipe and the source model's stamp
are the same, and writers running at once do not collide.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from kvstack.testbed import tiny_models

A_DECAY = 0.02
SCALES = {"linear_attn.out_proj.weight": 8.0, "linear_attn.conv1d.weight": 10.0}
LM_HEAD_SCALE = 20.0
STAMP = "long-memory.json"
# The recurrent mixer's weights, per tiny model: (the A_log key's suffix, the scaled weights).
MIXERS = {"qwen3next": ("linear_attn.A_log", SCALES),
          "granite4": ("mamba.A_log", {"mamba.out_proj.weight": 8.0, "mamba.conv1d.weight": 10.0})}


def long_memory_qwen3next(src: Path, dest: Path) -> Path:
    """A copy of the tiny Qwen3-Next at `src` in `dest` with a long-memory GDN state (kept when
    `dest` already holds the same recipe)."""
    return long_memory_copy("qwen3next", src, dest)


def long_memory_copy(model: str, src: Path, dest: Path) -> Path:
    """A copy of the tiny hybrid `model` (a key of MIXERS) at `src` in `dest` with a long-memory
    recurrent state (kept when `dest` already holds the same recipe)."""
    import torch
    from safetensors.torch import load_file, save_file

    a_log, scales = MIXERS[model]
    recipe = _recipe(src, model)
    if is_current(src, dest, model):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))  # one per writer
    changed = 0
    for p in src.iterdir():
        if not p.is_file():
            continue
        if p.suffix != ".safetensors":
            shutil.copy2(p, tmp / p.name)
            continue
        tensors = load_file(str(p))
        for key, t in tensors.items():
            scale = next((s for suffix, s in scales.items() if key.endswith(suffix)), None)
            if key == "lm_head.weight":
                scale = LM_HEAD_SCALE
            if key.endswith(a_log):
                tensors[key] = torch.full_like(t, math.log(A_DECAY))
                changed += 1
            elif scale is not None:
                tensors[key] = (t.to(torch.float32) * scale).to(t.dtype).contiguous()
                changed += 1
        save_file(tensors, str(tmp / p.name), metadata={"format": "pt"})
    if not changed:
        raise RuntimeError(f"{src}: no {model} recurrent-mixer weights to change")
    (tmp / STAMP).write_text(json.dumps(recipe))
    shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:  # another writer got there first: theirs is the same copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_current(src, dest, model):
            raise
    return dest


def _recipe(src: Path, model: str = "qwen3next") -> dict:
    """What decides the copy's bytes: the scaling, and the source model (its files' sizes and the
    stamp kvstack.testbed.tiny_models writes next to them, which has their sha256)."""
    stamp = src / tiny_models.STAMP
    a_log, scales = MIXERS[model]
    recipe = {"a_decay": A_DECAY, "scales": scales, "lm_head": LM_HEAD_SCALE,
              "src": {p.name: p.stat().st_size for p in sorted(src.iterdir()) if p.is_file()},
              "src_stamp": stamp.read_text() if stamp.is_file() else None}
    if model != "qwen3next":  # Qwen3-Next's stamp stays what it was (copies on disk stay current)
        recipe["a_log"] = a_log
    return recipe


def is_current(src: Path, dest: Path, model: str = "qwen3next") -> bool:
    """Whether `dest` already holds the long-memory copy of the model `model` at `src`."""
    try:
        return json.loads((dest / STAMP).read_text()) == _recipe(src, model)
    except (OSError, ValueError):
        return False


def zeroing_switch() -> list[bool]:
    """A switch (a one-element list: set [0] to True) that zeroes every hybrid state LMCache's vLLM
    adapter restores while it is on. Installed once per process, in the engine's process (the
    adapter's ``scatter_states``); off when returned the first time."""
    import lmcache.integration.vllm.vllm_v1_adapter as adapter

    scatter = adapter.scatter_states
    if hasattr(scatter, "kvstack_zero"):
        return scatter.kvstack_zero
    switch = [False]

    def scatter_maybe_zeroed(caches, layout, blocks, states):
        if switch[0]:
            states = {k: [t * 0 for t in v] for k, v in states.items()}
        return scatter(caches, layout, blocks, states)

    scatter_maybe_zeroed.kvstack_zero = switch
    adapter.scatter_states = scatter_maybe_zeroed
    return switch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvstack.testbed.long_memory",
        description="Write each tiny hybrid NAME (kvstack tiny-models) into OUT/NAME and its copy with a "
                    "long-memory recurrent state into OUT/NAME-long-memory: a wrong or zeroed restored "
                    "state changes that one's tokens (the random one forgets its state within a token).")
    ap.add_argument("names", nargs="+", metavar="NAME", choices=sorted(MIXERS))
    ap.add_argument("--out", default=str(tiny_models.DEFAULT_OUT), help="parent folder (default: %(default)s)")
    args = ap.parse_args(argv)
    for name in args.names:
        src = tiny_models.make_model(name, Path(args.out) / name)
        dest = long_memory_copy(name, src, Path(args.out) / f"{name}-long-memory")
        print(f"{name}-long-memory: {dest} (long-memory recurrent state)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
