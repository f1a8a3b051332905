"""Issue 3, step [3/N]: layers bind their KV cache, Mamba pages are one tensor (kvstack patch).

The patch (patches/vllm, subject "bind_kv_cache: one KV cache tensor per layer") makes
vLLM 0.25.1's runner hand every layer one tensor through `AttentionLayerBase.bind_kv_cache`;
Mamba layers get their pages as one (num_blocks, 1, 1, page_size_bytes) int8 tensor and derive
their conv/ssm views from it; `TransferTopology.get_transfer_cache_regions` is gone.

Two states of vLLM are compared, each an overlay of the files the layout ladder touches put in
front of the installed modules by a meta-path finder (ladder.state_root; the shared venv is
never modified): "patched", the series up to this patch (in the kvstack venv: the installed
files), and "unpatched", the series without the ladder (0.25.1 with kvstack's earlier
patches: the ladder taken out again). Checks:
- end to end on the CPU engine (each run in its own process): the tiny Qwen3-Next (GDN +
  attention) and the tiny Llama give identical greedy tokens patched and unpatched; the
  Mamba views the engine bound are 0.25.1's (data_ptr, shape, stride, dtype), and the CPU
  runner inherits the patched `_reshape_kv_cache_tensors`;
- bind_cases.py (one subprocess): the views, the runners (V1, V2), `bind_kv_cache`, transfer
  regions for a Mamba and an attention layer, Mooncake, NIXL (hybrid) and offloading
  registration; and the same cases unpatched as a negative control (they must fail there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ladder import find_patch as _find, series_patches, state_root, touched
from ladder import overlay as kv_overlay

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bind_worker.py"
CASES = HERE / "bind_cases.py"
SUBJECT = "bind_kv_cache: one KV cache tensor per layer"
MARKER = ("vllm/model_executor/layers/attention_layer_base.py", "def bind_kv_cache(")
ENV_KEYS = ("KVSTACK_BIND_OVERLAY", "KVSTACK_CONNECTOR_OVERLAY")
# Cases that hold on 0.25.1 as well (the rest must fail there).
UNPATCHED_PASS = {"test_overlay_is_in_use"}


def find_patch() -> Path:
    return _find(SUBJECT)


@pytest.fixture(scope="module")
def overlay(tmp_path_factory) -> Path:
    """The series up to this patch."""
    root = state_root(tmp_path_factory.mktemp("bind-overlay"), find_patch())
    assert MARKER[1] in (root / MARKER[0]).read_text()
    return root


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory) -> Path:
    """The series without the layout ladder (0.25.1 + kvstack's earlier patches)."""
    root = state_root(tmp_path_factory.mktemp("bind-unpatched"), None)
    assert MARKER[1] not in (root / MARKER[0]).read_text()
    return root


def clean_env(overlay_dir: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    if overlay_dir is not None:
        env["KVSTACK_BIND_OVERLAY"] = str(overlay_dir)
    return env


def run_cases(tmp: Path, overlay_dir: Path | None) -> dict[str, str]:
    junit = tmp / "junit.xml"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         f"--junitxml={junit}", "--rootdir", str(HERE), str(CASES)],
        capture_output=True, text=True, env=clean_env(overlay_dir), cwd=HERE, timeout=600)
    assert junit.exists(), f"inner run failed ({res.returncode}):\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        out[case.get("name", "")] = ("passed" if bad is None and case.find("skipped") is None
                                     else f"{bad.get('message', '') if bad is not None else 'skipped'}"
                                          f"\n{(bad.text or '')[-1500:] if bad is not None else ''}")
    return out


@pytest.fixture(scope="module")
def cases(overlay, tmp_path_factory) -> dict[str, str]:
    return run_cases(tmp_path_factory.mktemp("bind-cases"), overlay)


def test_cases_all_pass(cases):
    assert len(cases) >= 15, sorted(cases)
    bad = {name: outcome for name, outcome in cases.items() if outcome != "passed"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_cases_fail_without_the_patch(unpatched, tmp_path):
    """Negative control: on vLLM 0.25.1 (the ladder taken out) the [3/N] cases fail."""
    got = run_cases(tmp_path, unpatched)
    passed = {name.split("[", 1)[0] for name, outcome in got.items() if outcome == "passed"}
    assert passed == UNPATCHED_PASS, sorted(passed)


# ---- end to end on the CPU engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(overlay, unpatched, tiny_model_dir, tmp_path_factory):
    """model -> {"patched": result, "unpatched": result}; one engine per process."""
    tmp = tmp_path_factory.mktemp("bind-e2e")
    runs: dict[str, dict[str, dict]] = {}
    for model in ("qwen3next", "llama"):
        model_dir = tiny_model_dir(model)
        for label, ov in (("patched", overlay), ("unpatched", unpatched)):
            out = tmp / f"{model}-{label}.json"
            res = subprocess.run([sys.executable, str(WORKER), model, str(model_dir), str(out)],
                                 capture_output=True, text=True, env=clean_env(ov), cwd=HERE,
                                 timeout=600)
            assert res.returncode == 0 and out.exists(), (
                f"{model} {label} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-4000:]}")
            runs.setdefault(model, {})[label] = json.loads(out.read_text())
    return runs


def strip_ptr(views: list[dict]) -> list[dict]:
    return [{k: v for k, v in view.items() if k != "data_ptr"} for view in views]


@pytest.mark.parametrize("model", ["qwen3next", "llama"])
def test_e2e_greedy_tokens_identical(e2e, model):
    runs = e2e[model]
    assert runs["patched"]["overlay"] and runs["unpatched"]["overlay"]
    assert runs["patched"]["tokens"] == runs["unpatched"]["tokens"]
    assert all(len(t) == 12 for t in runs["patched"]["tokens"])


def test_e2e_mamba_views_are_0251s(e2e):
    """Qwen3-Next: every GDN layer's bound views are those 0.25.1 builds from the same
    allocation (data_ptr, shape, stride, dtype), and the same as the unpatched engine's."""
    runs = e2e["qwen3next"]
    patched = runs["patched"]
    assert patched["mamba"], "no Mamba layer in the tiny Qwen3-Next"
    for name, layer in patched["mamba"].items():
        assert layer["type"] == "tuple" and len(layer["views"]) == 2, name
        assert layer["views"] == layer["reference_0251"], name
        # the page is padded (here to the attention page): block stride = the page
        assert layer["views"][0]["stride"][0] * 2 == layer["page_size_bytes"]  # bf16 conv
    # the unpatched engine bound the same views
    unpatched = runs["unpatched"]
    assert sorted(unpatched["mamba"]) == sorted(patched["mamba"])
    for name, layer in unpatched["mamba"].items():
        assert layer["views"] == layer["reference_0251"], f"reference is not 0.25.1's: {name}"
        assert strip_ptr(patched["mamba"][name]["views"]) == strip_ptr(layer["views"]), name
    assert {k: strip_ptr([v]) for k, v in patched["attention"].items()} == {
        k: strip_ptr([v]) for k, v in unpatched["attention"].items()}


def test_e2e_hybrid_backend_list_and_transfer_regions(e2e):
    """The backend list vLLM builds for the tiny Qwen3-Next starts with the GDN backend (its
    first layer is a GDN layer), then the attention backend. With that list a P/D connector's
    TransferTopology finds the packed attention layout and every cache of the engine gets its
    one region (attention: the layer's packed tensor; GDN: the layer's page tensor, block
    stride = the page). Before the fix the GDN backend was probed, the layout stayed
    blocks-first and the packed attention cache was refused ("mixing KV cache layouts")."""
    patched = e2e["qwen3next"]["patched"]
    backends = patched["attn_backends"]
    assert backends[0] == "GDN_ATTN" and "CPU_ATTN" in backends, backends
    regions = patched["transfer_regions"]
    assert "error" not in regions, regions["error"]
    assert regions["layout"] == "packed"
    layers = {**patched["mamba"], **patched["attention"]}
    assert sorted(k for k in regions if k != "layout") == sorted(layers)
    for name, layer in patched["mamba"].items():
        assert regions[name] == [[layer["views"][0]["data_ptr"], layer["page_size_bytes"]]], name
    for name, view in patched["attention"].items():
        assert [r[0] for r in regions[name]] == [view["data_ptr"]], name
    llama = e2e["llama"]["patched"]
    assert llama["attn_backends"] == ["CPU_ATTN"]
    assert llama["transfer_regions"]["layout"] == "packed", llama["transfer_regions"]
    assert e2e["qwen3next"]["unpatched"]["transfer_regions"] is None  # 0.25.1: no such API


def test_e2e_runner_binds_one_tensor_per_layer(e2e):
    """The CPU runner inherits the patched _reshape_kv_cache_tensors: with the patch every
    runner KV cache is one tensor, Mamba pages (num_blocks, 1, 1, page) int8 starting at the
    conv view; 0.25.1 keeps a [conv, ssm] list there."""
    runs = e2e["qwen3next"]
    patched = runs["patched"]
    assert patched["runner_class"] == "CPUModelRunner" and patched["reshape_inherited"]
    assert patched["has_bind_kv_cache"]
    caches = patched["runner_kv_caches"]
    assert all(c["kind"] == "tensor" for c in caches)
    pages = [c for c in caches if c["dtype"] == "torch.int8"]
    assert len(pages) == len(patched["mamba"])
    conv_ptrs = {layer["views"][0]["data_ptr"] for layer in patched["mamba"].values()}
    page_size = next(iter(patched["mamba"].values()))["page_size_bytes"]
    for page in pages:
        assert page["shape"][1:] == [1, 1, page_size] and page["data_ptr"] in conv_ptrs
    # 0.25.1 keeps a [conv, ssm] list
    assert sum(c["kind"] == "list" for c in runs["unpatched"]["runner_kv_caches"]) == len(pages)
    assert not runs["unpatched"]["has_bind_kv_cache"]


def test_patch_trailers_and_order():
    patch = find_patch()
    head = patch.read_text().split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44456, "
            "in vLLM 0.27.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.27.0" in head
    assert "Kvstack-Issue: 3" in head
    assert all(f.startswith("vllm/") and f.endswith(".py") for f in touched(patch))
    # after the connector patch it builds on
    names = [p.name for p in series_patches()]
    connector = next(n for n in names if "kv_connector-one-transfer-region" in n)
    assert names.index(connector) < names.index(patch.name)


def test_patch_applies_to_sdist(tmp_path, pristine_tree):
    """The -p1 series up to this patch applies to the pristine sdist tree too."""
    patch = find_patch()
    upto = series_patches()[:series_patches().index(patch) + 1]
    files = kv_overlay.build_overlay(upto, pristine_tree("vllm"), tmp_path / "sdist")
    assert set(touched(patch)) <= set(files)
