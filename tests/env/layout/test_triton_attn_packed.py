"""Issue 3, step 2/N for TRITON_ATTN: K and V packed into the content dim (kvstack patch).

The patch changes the Triton backend's KV cache from vLLM 0.25.1's
(num_blocks, 2, block_size, num_kv_heads, head_size) to the standardized
(num_blocks, num_kv_heads, block_size, 2 * head_size) and recovers K/V as views. It
touches no kernel: the unmodified 0.25.1 Triton kernels must take the packed views.

Checked on CPU, kernels under TRITON_INTERPRET=1 at tiny shapes (layout_worker.py, one
subprocess for all cases; see its docstring for why a subprocess):
- shapes (auto, int8/int4 per-token-head), NHD/HND stride orders with and without the
  cross-layer dimension, blocks-first properties, zero-copy views, refusal of 5-D caches;
- the backend's own do_kv_cache_update writes every slot's K and V to the right place of
  the packed cache and nothing else (fp32, fp16, bf16; NHD and HND; non-zero storage offset);
- unified attention over the packed views is bit-identical to attention over the same tokens
  in the 0.25.1 layout, and matches a float64 reference (fp32, fp16);
- int8 per-token-head: the inline scale views point at the right bytes, dequantised K/V
  match the input, attention matches the reference on the dequantised K/V.

Which backend module is tested: the installed one when the series is applied to the venv,
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
TARGET = "vllm/v1/attention/backends/triton_attn.py"
SERIES_DIRS = [REPO / "patches" / "vllm", REPO / "patches" / "pending" / "vllm"]
SUBJECT = "triton_attn: pack K and V into the content dim"

CASES = [
    "shape_auto",
    "shape_int8_per_token_head",
    "shape_int4_per_token_head",
    "stride_orders",
    "blocks_first_and_cross_layer",
    "split_views_are_views",
    "split_refuses_unpacked_cache",
    *[f"store_{layout}_{dtype}" for layout in ("NHD", "HND")
      for dtype in ("float32", "float16", "bfloat16")],
    *[f"attention_{layout}_{dtype}" for layout in ("NHD", "HND")
      for dtype in ("float32", "float16")],
    "int8_per_token_head_NHD",
    "int8_per_token_head_HND",
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
    if "def split_packed_kv_cache(" in installed.read_text():
        return installed  # the series is applied to this environment
    dest = tmp_path_factory.mktemp("patched-site")
    apply_to_copy(find_patch(), installed.parents[4], dest)
    return dest / TARGET


@pytest.fixture(scope="module")
def results(patched_file) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(HERE / "layout_worker.py"), str(patched_file)],
                         capture_output=True, text=True, env=env, timeout=900)
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
    if "def split_packed_kv_cache(" not in installed.read_text():
        apply_to_copy(patch, installed.parents[4], tmp_path / "site", check_only=True)


def test_patch_trailers():
    text = find_patch().read_text()
    head = text.split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    touched = [line[6:] for line in text.splitlines() if line.startswith("+++ b/")]
    assert touched == [TARGET], "the patch must touch only the Triton backend (no compiled code)"
