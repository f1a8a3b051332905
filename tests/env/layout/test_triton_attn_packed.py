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

TARGET = "vllm/v1/attention/backends/triton_attn.py"
SUBJECT = "triton_attn: pack K and V into the content dim"
MARKER = "def split_packed_kv_cache("  # in the backend once the patch is applied

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


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    target = patched_file(tmp_path_factory.mktemp("patched-site"), SUBJECT, TARGET)
    assert MARKER in target.read_text(), target
    return run_worker(["layout_worker.py", str(target)], {**os.environ, "TRITON_INTERPRET": "1"})


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
    check_trailers(SUBJECT, TARGET, subject_line=False)
