"""Issue 3, step 2/N for FLEX_ATTENTION: K and V packed into the content dim (kvstack patch).

The patch changes the FlexAttention backend's KV cache from vLLM 0.25.1's
(num_blocks, 2, block_size, num_kv_heads, head_size) to the standardized
(num_blocks, num_kv_heads, block_size, 2 * head_size), always token-major (NHD) in memory,
and recovers K/V as views (`split_packed_kv_cache`, `flatten_packed_kv_view`). It touches
no compiled code.

Checked on CPU (packed_backend_worker.py, one subprocess for all cases; see its docstring):
- shape, stride orders with and without the cross-layer dimension (the same for both
  layout settings, as in 0.25.1), blocks-first;
- the K/V views: shape (B, N, H, D), strides of the packed cache, same storage, K at content
  offset 0 and V at head_size; the flattened (tokens, H, D) views are views too;
- refusal (ValueError) of a 0.25.1 5-D cache, a wrong content dim and a 3-D cache (by the
  helper and by do_kv_cache_update), and of a head-major physical order when flattening;
- round trip: the backend's own do_kv_cache_update writes K/V for some slots (padded with
  slot -1) and they read back through the packed cache and through the views; other slots
  and the bytes before the cache's storage offset stay zero (fp32, fp16, bf16);
- end to end: FlexAttentionMetadataBuilder.build (the real method, on a stand-in builder
  object), FlexAttentionImpl.forward and torch's compiled flex_attention (inductor, CPU)
  over the packed cache, compared with a float64 torch reference (fp32, bf16; a prefill
  and a decode on shuffled blocks).

No fp8 case: FlexAttention supports no fp8 KV cache in 0.25.1 (checked: "fp8" is refused by
supports_kv_cache_dtype) and the patch adds none.
Not the real store kernel: the CPU wheel has no compiled `reshape_and_cache_flash`, which
do_kv_cache_update calls as torch.ops._C_cache_ops.reshape_and_cache_flash. The worker
registers a torch reference of the CUDA op's contract under that name (slot ->
(slot // size(1), slot % size(1)), written through the views the backend passes, i.e.
addressed by their strides as the kernel does). The attention itself is the real
flex_attention, compiled for CPU (about 40 s here, on first run).

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

BACKEND = "flex_attention"
TARGET = f"vllm/v1/attention/backends/{BACKEND}.py"
SUBJECT = "flex_attention: pack K and V into the content dim"
MARKER = "FLEX_ATTENTION expects a packed KV cache"

CASES = [
    "shape_auto",
    "no_fp8_cache",
    "stride_orders",
    "blocks_first_and_cross_layer",
    "split_views",
    "split_refuses_unpacked_cache",
    "flatten_refuses_head_major_order",
    *[f"store_NHD_{dtype}" for dtype in ("float32", "float16", "bfloat16")],
    *[f"forward_NHD_{dtype}" for dtype in ("float32", "bfloat16")],
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
