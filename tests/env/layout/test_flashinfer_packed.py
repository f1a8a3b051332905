"""Issue 3, step 2/N for FLASHINFER: K and V packed into the content dim (kvstack patch).

The patch changes the FlashInfer backend's KV cache from vLLM 0.25.1's
(num_blocks, 2, block_size, num_kv_heads, head_size) to the standardized
(num_blocks, num_kv_heads, block_size, 2 * head_size) (fp8: the same shape), and the nvfp4
cache to (num_blocks, 2 * num_kv_heads, block_size, data + scale dim), K heads first, HND
only (nvfp4 + NHD is refused: the compiled nvfp4 kernels cannot address it). K/V are views
(`split_packed_kv_cache` for the store op, `flashinfer_kv_cache_views` for FlashInfer).

Checked on CPU (flashinfer_packed_worker.py, one subprocess; see its docstring):
- shapes (auto, bf16/fp16, fp8 variants, nvfp4 in HND), nvfp4 + NHD refused by
  get_kv_cache_shape, NHD/HND stride orders with and without the cross-layer dimension,
  blocks-first;
- the views: shape, strides, same storage, K at content offset 0 and V at head_size (bf16,
  fp8) or V at the second head group (nvfp4), for the store op and in FlashInfer's layout;
  nvfp4 data/scale views through 0.25.1's own helper;
- refusal (ValueError) of a 0.25.1 5-D cache, a wrong content dim, wrong head count and a
  3-D cache, by both helpers, do_kv_cache_update and forward; of an nvfp4 cache laid out
  token-major (NHD) or not dense per block side (cross-layer);
- round trip through the backend's own do_kv_cache_update (the real FlashInferImpl): bf16,
  fp16, fp8 (scaled); NHD and HND; padded slots skipped, other slots and the bytes before
  the storage offset untouched; read back through the cache and FlashInfer's views;
- nvfp4 (HND): the bytes written are byte-identical to what 0.25.1's backend writes into
  its 5-D cache, and land where the forward's data/scale views read them;
- forward(): the native prefill/decode wrappers get the (k, v) views (same data_ptr and
  strides) and attention through them matches a float64 reference (bf16, fp8; NHD, HND);
  the trtllm-gen decode and trtllm prefill (HND) likewise, fp8 prefill through the
  backend's Triton dequant kernel (run by Triton's interpreter on CPU).

Not the real kernels: FlashInfer is not installed here (and is CUDA only), so `flashinfer`
is replaced by stand-in modules; the compiled `reshape_and_cache_flash` (incl. its nvfp4
dispatch) is a torch reference of its address arithmetic; FlashInfer's wrappers and trtllm
entry points are float64 torch references of their documented paged (k, v) contract. That
the real kernels accept the views (strides; the trtllm-gen cubins of FlashInfer 0.6.13 in
particular) needs a GPU run (see docs/layout-backport.md).

Which backend module is tested: the file as it is once the series is applied up to this
patch (ladder.state_root: the installed one in the kvstack venv; the shared venv is never
modified). Negative control: the same worker on the file as it is just before this patch
(0.25.1's) fails every case but the layout-independent one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ladder import check_applies, find_patch, series_patches, state_root, touched

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "flashinfer_packed_worker.py"
TARGET = "vllm/v1/attention/backends/flashinfer.py"
SUBJECT = "flashinfer: pack K and V into the content dim"
MARKER = "def flashinfer_kv_cache_views("
# Cases that hold for the 0.25.1 layout as well (the rest must fail there).
UNPATCHED_PASS = {"blocks_first"}

CASES = [
    "shape_auto_and_fp8",
    "shape_nvfp4_hnd",
    "shape_nvfp4_nhd_refused",
    "stride_orders",
    "blocks_first",
    "store_views_bf16_fp8",
    "flashinfer_views_bf16_fp8",
    "views_nvfp4_hnd",
    "refuses_unpacked_caches",
    "nvfp4_nhd_cache_refused",
    *[f"store_{layout}_{dtype}" for layout in ("NHD", "HND")
      for dtype in ("bfloat16", "float16", "fp8")],
    "store_nvfp4_hnd_same_bytes_as_0251",
    *[f"forward_native_{layout}_{dtype}" for layout in ("NHD", "HND")
      for dtype in ("bfloat16", "fp8")],
    "forward_trtllm_HND_bfloat16",
    "forward_trtllm_HND_fp8",
    "fp8_dequant_kernel_reads_packed_views",
]


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory) -> Path:
    """vLLM 0.25.1's flashinfer.py: the file just before this patch (no earlier patch touches it)."""
    path = state_root(tmp_path_factory.mktemp("before"), find_patch(SUBJECT), include=False) / TARGET
    assert MARKER not in path.read_text(), path
    return path


@pytest.fixture(scope="module")
def patched_file(tmp_path_factory) -> Path:
    path = state_root(tmp_path_factory.mktemp("patched-site"), find_patch(SUBJECT)) / TARGET
    assert MARKER in path.read_text(), path
    return path


def run_worker(backend: Path, reference: Path) -> dict:
    res = subprocess.run([sys.executable, str(WORKER), str(backend), str(reference)],
                         capture_output=True, text=True, env=dict(os.environ), timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    out = json.loads(lines[-1])
    assert out.pop("_flashinfer_installed") is False, "expected FlashInfer absent (CPU venv)"
    return out


@pytest.fixture(scope="module")
def results(patched_file, reference_file) -> dict:
    return run_worker(patched_file, reference_file)


def test_worker_ran_every_case(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    got = results.get(case)
    assert got is not None, f"worker did not report {case}"
    assert got["ok"], got["detail"]


def test_cases_fail_on_the_unpatched_backend(reference_file):
    """Negative control: the same checks on 0.25.1's flashinfer.py fail."""
    got = run_worker(reference_file, reference_file)
    assert sorted(got) == sorted(CASES)
    passed = {name for name, r in got.items() if r["ok"]}
    assert passed == UNPATCHED_PASS, f"passed on the unpatched backend: {sorted(passed)}"


def test_patch_applies_to_sdist_and_site_packages(tmp_path, pristine_tree, reference_file):
    """The same -p1 patch applies to the pristine sdist tree and to the installed package as it
    is before this patch."""
    patch = find_patch(SUBJECT)
    check_applies(patch, pristine_tree("vllm"), tmp_path / "sdist")
    check_applies(patch, reference_file.parents[4], tmp_path / "site")


def test_patch_trailers_and_scope():
    patch = find_patch(SUBJECT)
    head = patch.read_text().split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert f"Subject: [PATCH] [kvstack] {SUBJECT}" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    assert touched(patch) == [TARGET], "the patch must touch only the FlashInfer backend"


def test_series_order():
    """After the connector patch it needs, before the 3/N bind_kv_cache patch."""
    names = [p.name for p in series_patches()]
    mine = find_patch(SUBJECT).name
    connector = next(n for n in names if "kv_connector-one-transfer-region" in n)
    bind = next(n for n in names if "bind_kv_cache-one-KV-cache-tensor" in n)
    assert names.index(connector) < names.index(mine) < names.index(bind)
