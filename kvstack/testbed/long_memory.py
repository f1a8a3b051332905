"""A tiny Qwen3-Next whose gated delta-net (GDN) state matters, for restore claims that can fail.

The random tiny Qwen3-Next (kvstack.testbed.tiny_models) forgets its recurrent state within a token:
A_log ~ 2 gives a per-token decay of about exp(-10), and its GDN outputs are small beside the
residual stream, so restoring a zeroed state gives the same greedy tokens as restoring the right
one; a "same tokens" claim built on it could not fail. `long_memory_qwen3next` copies it with a slow
decay (A_log = log(A_DECAY): exp(-A * softplus(.)) ~ 0.97 per token), conv1d, GDN out_proj and
lm_head scaled, so the state carries the prefix and a wrong or zeroed state changes the output.

Used by the demo (it must run from an installed kvstack) and by the tests (through
tests/env/lmcache/hybrid_models.py). A copy is kept while its recipe and the source model's stamp
are the same, and writers running at once do not collide.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from kvstack.testbed import tiny_models

A_DECAY = 0.02
SCALES = {"linear_attn.out_proj.weight": 8.0, "linear_attn.conv1d.weight": 10.0}
LM_HEAD_SCALE = 20.0
STAMP = "long-memory.json"


def long_memory_qwen3next(src: Path, dest: Path) -> Path:
    """A copy of the tiny Qwen3-Next at `src` in `dest` with a long-memory GDN state (kept when
    `dest` already holds the same recipe)."""
    import torch
    from safetensors.torch import load_file, save_file

    recipe = _recipe(src)
    if is_current(src, dest):
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
            scale = next((s for suffix, s in SCALES.items() if key.endswith(suffix)), None)
            if key == "lm_head.weight":
                scale = LM_HEAD_SCALE
            if key.endswith("linear_attn.A_log"):
                tensors[key] = torch.full_like(t, math.log(A_DECAY))
                changed += 1
            elif scale is not None:
                tensors[key] = (t.to(torch.float32) * scale).to(t.dtype).contiguous()
                changed += 1
        save_file(tensors, str(tmp / p.name), metadata={"format": "pt"})
    if not changed:
        raise RuntimeError(f"{src}: no gated delta-net weights to change")
    (tmp / STAMP).write_text(json.dumps(recipe))
    shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:  # another writer got there first: theirs is the same copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_current(src, dest):
            raise
    return dest


def _recipe(src: Path) -> dict:
    """What decides the copy's bytes: the scaling, and the source model (its files' sizes and the
    stamp kvstack.testbed.tiny_models writes next to them, which has their sha256)."""
    stamp = src / tiny_models.STAMP
    return {"a_decay": A_DECAY, "scales": SCALES, "lm_head": LM_HEAD_SCALE,
            "src": {p.name: p.stat().st_size for p in sorted(src.iterdir()) if p.is_file()},
            "src_stamp": stamp.read_text() if stamp.is_file() else None}


def is_current(src: Path, dest: Path) -> bool:
    """Whether `dest` already holds the long-memory copy of the model at `src`."""
    try:
        return json.loads((dest / STAMP).read_text()) == _recipe(src)
    except (OSError, ValueError):
        return False
