"""Issue 3, step 2/N for FLASH_ATTN: K and V packed into the content dim (kvstack patch).

The patch changes the FlashAttention backend's KV cache from vLLM 0.25.1's
(num_blocks, 2, block_size, num_kv_heads, head_size) to the standardized
(num_blocks, num_kv_heads, block_size, 2 * head_size) and recovers K/V as views
(`split_packed_kv_cache`). It touches no compiled code.

Checked on CPU (packed_backend_worker.py, one subprocess for all cases; see its docstring):
- shapes (auto, and fp8 variants: the same shape), the 0.25.1 block-size check kept,
  NHD/HND stride orders with and without the cross-layer dimension, blocks-first;
- the K/V views: shape (B, N, H, D), strides of the packed cache (NHD and HND), same
  storage, K at content offset 0 and V at head_size, for bf16 and fp8 (uint8 storage);
- refusal (ValueError) of a 0.25.1 5-D cache, a wrong content dim and a 3-D cache, by the
  helper and by do_kv_cache_update;
- round trip: the backend's own do_kv_cache_update writes K/V for some slots (padded with
  slot -1) and they read back through the packed cache and through the views; other slots
  and the bytes before the cache's storage offset stay zero; bf16, fp16 and fp8 (scaled,
  uint8 storage); NHD and HND;
- forward(): the views it hands to the attention kernel are the packed views (same
  data_ptr, strides, fp8 retyped), and attention read through them matches a float64
  reference (bf16, fp8 on the dequantised K/V).

Not the real kernels: the CPU wheel has neither the compiled `reshape_and_cache_flash` nor
vllm-flash-attn. The store op is a torch reference of the CUDA op's contract (slot ->
(slot // size(1), slot % size(1)), written through the views the backend passes, i.e.
addressed by their strides as the kernel does), registered as
`_C_cache_ops::reshape_and_cache_flash` and reached through vLLM's own Python wrapper; the
attention kernel is a float64 torch reference of flash_attn_varlen_func's paged contract.
That the compiled op and flash-attn read strides from their tensors is argued from their
sources in docs/layout-backport.md; it has not run on a GPU yet.

Which backend module is tested: the installed one when the patch is applied to the venv,
otherwise a temporary copy of the installed file with the patch applied (the shared venv
is never modified).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.env

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
BACKEND = "flash_attn"
TARGET = f"vllm/v1/attention/backends/{BACKEND}.py"
SERIES_DIRS = [REPO / "patches" / "vllm", REPO / "patches" / "pending" / "vllm"]
SUBJECT = "flash_attn: pack K and V into the content dim"
MARKER = "FLASH_ATTN expects a packed KV cache"

CASES = [
    "shape_auto",
    "shape_fp8_and_block_size",
    "stride_orders",
    "blocks_first_and_cross_layer",
    "split_views",
    "split_refuses_unpacked_cache",
    *[f"store_{layout}_{dtype}" for layout in ("NHD", "HND")
      for dtype in ("bfloat16", "float16", "fp8")],
    *[f"forward_{layout}_{dtype}" for layout in ("NHD", "HND") for dtype in ("bfloat16", "fp8")],
]


def find_patch() -> Path:
    for series_dir in SERIES_DIRS:
        series = series_dir / "series"
        if not series.exists():
            continue
        for line in series.read_text().splitlines():
            name = line.strip()
            if name and not name.startswith("#") and (series_dir / name).exists():
                text = (series_dir / name).read_text()
                if SUBJECT in text and f"+++ b/{TARGET}" in text:
                    return series_dir / name
    pytest.fail(f"no patch '{SUBJECT}' in any of {[str(d) for d in SERIES_DIRS]}", pytrace=False)


def installed_file() -> Path:
    try:
        import vllm
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable with {sys.executable} ({exc}); run in the kvstack "
                    "venv", pytrace=False)
    return Path(vllm.__path__[0]).parent / TARGET


def apply_to_copy(patch: Path, source_root: Path, dest: Path, *, check_only: bool = False) -> None:
    """Apply `patch` (-p1, rooted at the upstream repo) to a copy of TARGET taken from source_root."""
    (dest / TARGET).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source_root / TARGET, dest / TARGET)
    cmd = ["git", "apply", "-p1", f"--include={TARGET}", str(patch)]
    if check_only:
        cmd.insert(2, "--check")
    res = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    assert res.returncode == 0, f"{patch.name} does not apply to {source_root}: {res.stderr}"


@pytest.fixture(scope="module")
def patched_file(tmp_path_factory) -> Path:
    installed = installed_file()
    if MARKER in installed.read_text():
        return installed  # the patch is applied to this environment
    dest = tmp_path_factory.mktemp("patched-site")
    apply_to_copy(find_patch(), installed.parents[4], dest)
    return dest / TARGET


@pytest.fixture(scope="module")
def results(patched_file) -> dict:
    res = subprocess.run(
        [sys.executable, str(HERE / "packed_backend_worker.py"), BACKEND, str(patched_file)],
        capture_output=True, text=True, env=dict(os.environ), timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_worker_ran_every_case(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    got = results.get(case)
    assert got is not None, f"worker did not report {case}"
    assert got["ok"], got["detail"]


def test_patch_applies_to_sdist_and_site_packages(tmp_path, pinned_tree):
    """The same -p1 patch applies to the pristine sdist tree and to the installed package."""
    patch = find_patch()
    apply_to_copy(patch, pinned_tree("vllm"), tmp_path / "sdist", check_only=True)
    installed = installed_file()
    if MARKER not in installed.read_text():
        apply_to_copy(patch, installed.parents[4], tmp_path / "site", check_only=True)


def test_patch_trailers():
    text = find_patch().read_text()
    head = text.split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert f"Subject: [PATCH] [kvstack] {SUBJECT}" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    touched = [line[6:] for line in text.splitlines() if line.startswith("+++ b/")]
    assert touched == [TARGET], "the patch must touch only the FlashAttention backend"
