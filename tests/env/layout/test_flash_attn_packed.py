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

Which backend module is tested: the file as it is once the series is applied up to this
patch (ladder.state_root: the installed one in the kvstack venv; the shared venv is never
modified).
"""

from __future__ import annotations

import os

import pytest

from single_file_patch import (check_applies_to_sdist_and_site, check_trailers, patched_file,
                               run_worker)

pytestmark = pytest.mark.env

BACKEND = "flash_attn"
TARGET = f"vllm/v1/attention/backends/{BACKEND}.py"
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


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    target = patched_file(tmp_path_factory.mktemp("patched-site"), SUBJECT, TARGET)
    assert MARKER in target.read_text(), target
    return run_worker(["packed_backend_worker.py", BACKEND, str(target)], dict(os.environ))


def test_worker_ran_every_case(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    got = results.get(case)
    assert got is not None, f"worker did not report {case}"
    assert got["ok"], got["detail"]


def test_patch_applies_to_sdist_and_site_packages(tmp_path, pristine_tree):
    """The same -p1 patch applies to the pristine sdist tree and to the installed package."""
    check_applies_to_sdist_and_site(SUBJECT, TARGET, pristine_tree("vllm"), tmp_path)


def test_patch_trailers():
    check_trailers(SUBJECT, TARGET)
