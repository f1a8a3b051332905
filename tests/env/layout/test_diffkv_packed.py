"""Issue 3, step 2/N for the DiffKV backends: K and V packed, head-major (kvstack patches).

Two patches: "triton_attn_diffkv: pack K/V into the content dim" (the backend
and the DiffKV Triton store kernel's head_stride) and "flash_attn_diffkv: pack K/V
into the content dim". Both change the cache from vLLM 0.25.1's token-major
(num_blocks, block_size, num_kv_heads, head_size + head_size_v) to the logical
(num_blocks, num_kv_heads, block_size, head_size + head_size_v), K = content
[0, head_size), V = [head_size, head_size + head_size_v), NHD/HND stride orders.

Checked on CPU (diffkv_worker.py, one subprocess per backend, Triton under
TRITON_INTERPRET=1 at tiny shapes, head_size 32 and head_size_v 64):
- shapes (auto, bf16, and fp8 for FLASH_ATTN_DIFFKV: the same shape), the block-size
  check, NHD/HND stride orders with and without the cross-layer dimension, blocks-first;
- the K/V views: shapes (B, N, H, 32) and (B, N, H, 64), the cache's strides (NHD, HND),
  same storage, K at content offset 0, V at head_size; bf16, and uint8 (fp8) storage;
- refusal (ValueError) of a 5-D cache, a 2 * head_size cache, a wrong content dim, a 3-D
  cache and a strided content dim, by the helper and by do_kv_cache_update;
- round trip through the backend's own do_kv_cache_update and the real DiffKV Triton
  store kernel: every slot's K and V at the right place, padded slots (-1) skipped, other
  slots and the bytes before the storage offset untouched; TRITON_ATTN_DIFFKV fp32, fp16,
  bf16; FLASH_ATTN_DIFFKV bf16, fp16, fp8 (scaled, uint8 storage; inputs on the fp8
  grid, because the interpreter truncates where the GPU rounds); NHD and HND;
- TRITON_ATTN_DIFFKV forward(): the real unified_attention_diffkv over the packed views
  is bit-identical to the same kernel over the same tokens in the 0.25.1 layout and
  matches a float64 reference (fp32, fp16; no bf16 in the interpreter);
- FLASH_ATTN_DIFFKV forward(): the views it hands to flash-attn are the packed views
  (data_ptr, strides, fp8 retyped), and attention read through them by a float64 torch
  stand-in for flash_attn_varlen_func matches a float64 reference (bf16, fp8);
- negative controls: the unpatched files (0.25.1's) fail the layout cases (see
  UNPATCHED_PASSES for the few that do not depend on the layout), and the patched
  FLASH_ATTN_DIFFKV with the unpatched (0.25.1) store kernel writes HND caches wrong.

The files under test are the installed ones as they are once the series is applied up to
each patch (ladder.state_root: later patches of the ladder taken out of copies; the shared
venv is never modified), loaded first in the worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ladder
from ladder import series_patches, state_root, touched

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
OPS = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
BACKENDS = {
    "triton_attn_diffkv": {
        "subject": "triton_attn_diffkv: pack K/V into the content dim",
        "parent": "vllm/v1/attention/backends/triton_attn.py",
        "marker": "{backend_name} expects a packed KV cache",  # an f-string in the file
        "touches": ["vllm/v1/attention/backends/triton_attn_diffkv.py", OPS],
    },
    "flash_attn_diffkv": {
        "subject": "flash_attn_diffkv: pack K/V into the content dim",
        "parent": "vllm/v1/attention/backends/flash_attn.py",
        "marker": "FLASH_ATTN_DIFFKV expects a packed KV cache",
        "touches": ["vllm/v1/attention/backends/flash_attn_diffkv.py"],
    },
}
COMMON = ["shape", "stride_orders", "blocks_first", "split_views", "refuses_unpacked_cache"]
CASES = {
    "triton_attn_diffkv": COMMON + [
        f"{kind}_{layout}_{dtype}" for layout in ("NHD", "HND")
        for kind, dtypes in (("store", ("float32", "float16", "bfloat16")),
                             ("forward", ("float32", "float16")))
        for dtype in dtypes
    ],
    "flash_attn_diffkv": COMMON + [
        f"{kind}_{layout}_{dtype}" for layout in ("NHD", "HND")
        for kind, dtypes in (("store", ("bfloat16", "float16", "fp8")),
                             ("forward", ("bfloat16", "fp8")))
        for dtype in dtypes
    ],
}


def target(backend: str) -> str:
    return f"vllm/v1/attention/backends/{backend}.py"


def files(backend: str) -> list[str]:
    """What the worker loads from the overlay, in load order."""
    return [OPS, BACKENDS[backend]["parent"], target(backend)]


def find_patch(backend: str) -> Path:
    return ladder.find_patch(BACKENDS[backend]["subject"])


def build_overlay(source_root: Path, dest: Path, rels: list[str], *, upto: Path | None) -> Path:
    """Copy rels from source_root to dest and apply, in series order, every series patch
    (up to and including `upto`; None: none) that touches one of them."""
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_root / rel, dest / rel)
    if upto is None:
        return dest
    for patch in series_patches():
        mine = [rel for rel in rels if rel in touched(patch)]
        if mine:
            cmd = ["git", "apply", "-p1", *[f"--include={rel}" for rel in mine], str(patch)]
            res = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
            assert res.returncode == 0, f"{patch.name} does not apply to {source_root}: {res.stderr}"
        if patch == upto:
            break
    return dest


def patched_overlay(backend: str, dest: Path) -> Path:
    """The series up to this backend's patch."""
    state_root(dest, find_patch(backend))
    assert BACKENDS[backend]["marker"] in (dest / target(backend)).read_text()
    return dest


def run_worker(backend: str, overlay: Path, *cases: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, str(HERE / "diffkv_worker.py"), backend, str(overlay), *cases],
        capture_output=True, text=True, env=env, timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def results(backend, tmp_path_factory) -> dict:
    return run_worker(backend, patched_overlay(backend, tmp_path_factory.mktemp(backend)))


def test_worker_ran_every_case(backend, results):
    assert sorted(results) == sorted(CASES[backend])


def test_every_case_passes(backend, results):
    failed = {name: got["detail"] for name, got in results.items() if not got["ok"]}
    assert not failed, "\n".join(f"{name}:\n{detail}" for name, detail in failed.items())


# What still passes on the unpatched 0.25.1 files: blocks-first; the physical stride
# orders (only the logical shape moves, the bytes of an NHD or HND cache are where they
# were); and TRITON_ATTN_DIFFKV's own NHD store + attention, which is self-consistent in
# 0.25.1. Its HND forward fails: the 0.25.1 store kernel put heads head_size + head_size_v
# apart whatever the layout, so 0.25.1 wrote HND DiffKV caches wrong.
UNPATCHED_PASSES = {
    "triton_attn_diffkv": ["blocks_first", "forward_NHD_float16", "forward_NHD_float32",
                           "stride_orders"],
    "flash_attn_diffkv": ["blocks_first", "stride_orders"],
}


def test_negative_control_unpatched(backend, tmp_path):
    """The same cases on the unpatched 0.25.1 files fail, except the layout-neutral ones."""
    got = run_worker(backend, state_root(tmp_path, None))  # the ladder taken out
    passed = sorted(name for name, r in got.items() if r["ok"])
    assert passed == UNPATCHED_PASSES[backend], passed


def test_hnd_store_needs_the_head_stride(tmp_path):
    """FLASH_ATTN_DIFFKV patched, store kernel left at 0.25.1: NHD (same bytes as
    token-major) still stores right, HND does not (the kernel assumed head_size +
    head_size_v between heads)."""
    backend = "flash_attn_diffkv"
    unpatched = state_root(tmp_path / "unpatched", None)
    assert "tile_i * head_stride" not in (unpatched / OPS).read_text()
    overlay = patched_overlay(backend, tmp_path / "overlay")
    shutil.copy2(unpatched / OPS, overlay / OPS)
    got = run_worker(backend, overlay, "store_NHD_bfloat16", "store_HND_bfloat16")
    assert got["store_NHD_bfloat16"]["ok"], got["store_NHD_bfloat16"]["detail"]
    assert not got["store_HND_bfloat16"]["ok"]


def test_patches_apply_to_sdist_and_site_packages(backend, tmp_path, pristine_tree):
    """The -p1 patches apply, after their predecessors in the series, to the pristine
    sdist and to the installed package."""
    build_overlay(pristine_tree("vllm"), tmp_path / "sdist", files(backend),
                  upto=find_patch(backend))
    build_overlay(state_root(tmp_path / "before", None), tmp_path / "site", files(backend),
                  upto=find_patch(backend))


def test_series_order():
    """Both come after their parents' patches and the connector patch, and before [3/N]."""
    names = [p.name for p in series_patches()]
    triton, flash = find_patch("triton_attn_diffkv").name, find_patch("flash_attn_diffkv").name
    assert names.index(triton) < names.index(flash), "flash_attn_diffkv needs the head_stride"
    for before in ("kv_connector-one-transfer-region", "-triton_attn-pack", "-flash_attn-pack"):
        first = [n for n in names if before in n]
        assert first and names.index(first[0]) < names.index(triton), before
    later = [n for n in names if "bind_kv_cache" in n]
    if later:
        assert names.index(flash) < names.index(later[0])


def test_patch_trailers(backend):
    text = find_patch(backend).read_text()
    head = text.split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert f"Subject: [PATCH] [kvstack] {BACKENDS[backend]['subject']}" in head
    assert "Why:" in head and "How:" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    assert sorted(touched(find_patch(backend))) == sorted(BACKENDS[backend]["touches"])
