"""Issue 3, step 2/N for ROCM_AITER_FA, ROCM_AITER_UNIFIED_ATTN and TURBOQUANT (kvstack patches).

The patches (patches/vllm 0011, 0012, 0013) move these backends' KV caches to the standardized
blocks-first, head-major logical shape (num_blocks, num_kv_heads, block_size, content):
- ROCM_AITER_FA and ROCM_AITER_UNIFIED_ATTN: vLLM 0.25.1's (B, 2, N, H, D) becomes
  (B, H, N, 2D), K and V recovered as views by `split_packed_kv_cache`, no stride order
  (physical = logical, as upstream 0.26.0); AITER's shuffle KV layout is refused by
  ROCM_AITER_FA (it cannot live in the packed cache without an AITER kernel change);
- TURBOQUANT: its quantized slot cache (B, N, H, slot) becomes (B, H, N, slot); the kernels
  get the token-major view (`tq_token_major_view`); the store launcher passes the cache
  tensor instead of `view(-1)`.
ROCM_ATTN and HPC_ATTN keep their 0.25.1 layouts, as upstream 0.26.0 did.

Checked on CPU by rocm_tq_worker.py, one subprocess per backend (see its docstring for what
is real and what is a stand-in): shapes, stride orders, the views, refusals of non-packed
caches (and of the shuffle mode), the cache-update paths through the backends' own methods
(the compiled `reshape_and_cache_flash` and AITER's rope-and-cache by torch stand-ins; the
TurboQuant Triton store and decode kernels for real, under TRITON_INTERPRET=1, compared byte
for byte with 0.25.1's launcher on a token-major cache), and the unified
backend's forward() against a float64 reference (AITER's unified_attention by a torch
stand-in). AITER is not installed (no ROCm): nothing here runs an AITER kernel.

Which backend module is tested: the files as they are once the series is applied up to the
patch (ladder.state_root: the installed ones in the kvstack venv; the shared venv is never
modified). Negative control: the same worker on the files without the ladder (0.25.1's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ladder
from ladder import series_patches, state_root, touched

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
BK = "vllm/v1/attention/backends"

BACKENDS = {
    "rocm_aiter_fa": dict(
        subject="rocm_aiter_fa: pack K and V into the content dim",
        targets=[f"{BK}/rocm_aiter_fa.py"],
        marker="ROCM_AITER_FA expects a packed KV cache",
        cases=["shape_and_block_size", "physical_order_is_logical", "split_views",
               "split_refuses_unpacked_cache",
               *[f"{kind}_{dt}" for dt in ("bfloat16", "float16", "fp8")
                 for kind in ("store", "rope_store")],
               "shuffle_mode_refused", "impl_builds_without_shuffle"],
        # layout-independent cases, which also pass on the unpatched file
        unpatched_pass={"physical_order_is_logical", "impl_builds_without_shuffle"},
    ),
    "rocm_aiter_unified_attn": dict(
        subject="rocm_aiter_unified_attn: pack K and V into the content dim",
        targets=[f"{BK}/rocm_aiter_unified_attn.py"],
        marker="ROCM_AITER_UNIFIED_ATTN expects a packed KV cache",
        cases=["shape_and_block_size", "physical_order_is_logical", "split_views",
               "split_refuses_unpacked_cache",
               *[f"{kind}_{dt}" for dt in ("bfloat16", "float16", "fp8")
                 for kind in ("store", "rope_store")],
               "forward_bfloat16", "forward_float16", "forward_fp8",
               "no_stride_order_in_rocm_attn_parent"],
        unpatched_pass={"physical_order_is_logical", "no_stride_order_in_rocm_attn_parent"},
    ),
    "turboquant_attn": dict(
        subject="turboquant_attn: make the TurboQuant cache head-major",
        targets=[f"{BK}/turboquant_attn.py", "vllm/v1/attention/ops/triton_turboquant_store.py"],
        marker="TURBOQUANT expects a KV cache",
        cases=["shape_head_major", "physical_order_is_logical", "token_major_view",
               "refuses_unpacked_cache", "store_turboquant_4bit_nc", "store_turboquant_k8v4",
               "decode_forward_turboquant_4bit_nc"],
        unpatched_pass={"physical_order_is_logical"},
        # the store/decode cases write out of bounds with the unpatched code (see worker)
        unpatched_only=["shape_head_major", "physical_order_is_logical", "token_major_view",
                        "refuses_unpacked_cache"],
    ),
}


def unfold(text: str) -> str:
    """The patch with folded mail headers (a long Subject continues on the next line) joined."""
    head, sep, body = text.partition("\n\n")
    return head.replace("\n ", " ") + sep + body


def find_patch(backend: str) -> Path:
    info = BACKENDS[backend]
    return ladder.find_patch(info["subject"], info["targets"][0])


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory) -> Path:
    """vLLM's files without the layout ladder (0.25.1 + kvstack's earlier patches)."""
    return state_root(tmp_path_factory.mktemp("unpatched"), None)


def run_worker(backend: str, files: list[Path], only: list[str] | None = None) -> dict:
    env = dict(os.environ)
    if backend == "turboquant_attn":
        env["TRITON_INTERPRET"] = "1"
    if only:
        env["KVSTACK_LAYOUT_CASES"] = ",".join(only)
    res = subprocess.run(
        [sys.executable, str(HERE / "rocm_tq_worker.py"), backend, *map(str, files)],
        capture_output=True, text=True, env=env, timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    out = json.loads(lines[-1])
    out.pop("_meta", None)
    return out


_RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory, unpatched):
    def get(backend: str) -> dict:
        if backend not in _RESULTS:
            info = BACKENDS[backend]
            dest = state_root(tmp_path_factory.mktemp(f"patched-{backend}"), find_patch(backend))
            assert info["marker"] in (dest / info["targets"][0]).read_text()
            files = [dest / t for t in info["targets"]]
            if backend == "turboquant_attn":  # the reference: 0.25.1's store launcher
                files.append(unpatched / info["targets"][1])
            _RESULTS[backend] = run_worker(backend, files)
        return _RESULTS[backend]
    return get


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_worker_ran_every_case(results, backend):
    assert sorted(results(backend)) == sorted(BACKENDS[backend]["cases"])


@pytest.mark.parametrize("backend,case", [(b, c) for b, info in BACKENDS.items()
                                          for c in info["cases"]])
def test_case(results, backend, case):
    got = results(backend).get(case)
    assert got is not None, f"worker did not report {case}"
    assert got["ok"], got["detail"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_negative_control_unpatched_fails(backend, unpatched):
    """The same cases on the unpatched files fail, except the layout-independent ones."""
    info = BACKENDS[backend]
    only = info.get("unpatched_only")
    assert info["marker"] not in (unpatched / info["targets"][0]).read_text()
    # turboquant: the unpatched turboquant_attn.py with the unpatched store launcher
    files = [unpatched / t for t in info["targets"]]
    got = run_worker(backend, files, only)
    assert sorted(got) == sorted(only or info["cases"])
    passed = {c for c, r in got.items() if r["ok"]}
    assert passed == info["unpatched_pass"], f"unexpected results on the unpatched file: {passed}"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_patch_applies_to_sdist_and_site_packages(tmp_path, pristine_tree, unpatched, backend):
    """The same -p1 patch applies to the pristine sdist tree and to the installed package as it
    is before the ladder (no other patch touches these files)."""
    patch = find_patch(backend)
    assert touched(patch) == BACKENDS[backend]["targets"]
    ladder.check_applies(patch, pristine_tree("vllm"), tmp_path / "sdist")
    ladder.check_applies(patch, unpatched, tmp_path / "site")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_patch_trailers_and_files(backend):
    patch = find_patch(backend)
    head = unfold(patch.read_text()).split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert f"Subject: [PATCH] [kvstack] {BACKENDS[backend]['subject']}" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    assert touched(patch) == BACKENDS[backend]["targets"]


def test_series_position_and_independence():
    """The three sit together after the connector patch and before the 3/N bind_kv_cache
    patch, and touch no file another patch of the series touches, so they apply after the
    earlier patches and the bind_kv_cache patch still applies after them."""
    series = {p.name: p for p in series_patches()}
    names = list(series)
    ours = [find_patch(b).name for b in BACKENDS]
    i = names.index(ours[0])
    assert names[i: i + 3] == ours
    connector = [j for j, n in enumerate(names) if "kv_connector-one-transfer-region" in n]
    bind = [j for j, n in enumerate(names) if "bind_kv_cache" in n]
    assert connector and connector[0] < i, names
    assert bind and bind[0] > i + 2, names
    mine = {f for b in BACKENDS for f in BACKENDS[b]["targets"]}
    for name in names:
        if name not in ours:
            assert not mine & set(touched(series[name])), name
