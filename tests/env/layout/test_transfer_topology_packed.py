"""Issue 3, step [2/N a]: KV connectors accept the packed K/V cache (kvstack patch).

The patch makes vLLM 0.25.1's TransferTopology and the NIXL, Mooncake and MoRI-IO connectors
register one transfer region per layer for the packed cache
(num_blocks, num_kv_heads, block_size, 2 * head_size), transfer whole blocks (contiguous
blocks coalesced where the connector can), keep the 5-D layouts of 0.25.1 exactly as they
were and refuse unknown layouts.

The cases live in connector_cases.py and run in one subprocess (`python -m pytest`) against
the files as they are once the series is applied up to this patch (ladder.state_root: the
ladder's later patches taken out of copies of the installed files; the shared venv is never
modified), put in front of the installed modules by a meta-path finder. So the backends are
0.25.1's (5-D) and `get_transfer_cache_regions` (removed by [3/N]) is still there. Real CPU tensors in
both physical orders (HND, NHD), real 0.25.1 backends for the 5-D layouts, mocks only for
the transports (NIXL agent, Mooncake engine).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import ladder
from ladder import touched

pytestmark = pytest.mark.env

HERE = Path(__file__).resolve().parent
CASES_FILE = HERE / "connector_cases.py"
SUBJECT = "kv_connector: one transfer region per layer for"
MARKER = ("vllm/distributed/kv_transfer/kv_connector/utils.py", "def classify_kv_cache_layout(")
TRITON_SUBJECT = "triton_attn: pack K and V into the content dim"
ALLOWED = {
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_layout.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
}


def find_patch(subject: str = SUBJECT) -> Path:
    return ladder.find_patch(subject)


def case_names() -> list[str]:
    tree = ast.parse(CASES_FILE.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[str]]:
    """function name -> outcomes ('passed' / failure text) of its test cases."""
    tmp = tmp_path_factory.mktemp("connector-packed")
    env = {k: v for k, v in os.environ.items() if k != "KVSTACK_CONNECTOR_OVERLAY"}
    env["KVSTACK_CONNECTOR_OVERLAY"] = str(ladder.state_root(tmp / "overlay", find_patch()))
    junit = tmp / "junit.xml"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
         "addopts=", f"--junitxml={junit}", "--rootdir", str(HERE), str(CASES_FILE)],
        capture_output=True, text=True, env=env, cwd=HERE, timeout=900)
    assert junit.exists(), f"inner run failed ({res.returncode}):\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
    out: dict[str, list[str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").split("[", 1)[0]
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            outcome = f"{case.get('name')}: {bad.get('message', '')}\n{(bad.text or '')[-1500:]}"
        elif skipped is not None:
            outcome = f"{case.get('name')}: skipped {skipped.get('message', '')}"
        else:
            outcome = "passed"
        out.setdefault(name, []).append(outcome)
    return out


def test_every_case_ran(results):
    assert sorted(results) == sorted(case_names())


@pytest.mark.parametrize("case", case_names())
def test_case(results, case):
    outcomes = results.get(case)
    assert outcomes, f"{case} did not run"
    bad = [o for o in outcomes if o != "passed"]
    assert not bad, "\n".join(bad)


def test_patch_applies_to_sdist_and_site_packages(tmp_path, pristine_tree):
    """The same -p1 patch applies to the pristine sdist tree and to the installed package as it
    is before this patch."""
    patch = find_patch()
    ladder.check_applies(patch, pristine_tree("vllm"), tmp_path / "sdist")
    before = ladder.state_root(tmp_path / "before", patch, include=False)
    ladder.check_applies(patch, before, tmp_path / "site")
    assert MARKER[1] in (ladder.state_root(tmp_path / "after", patch) / MARKER[0]).read_text()


def test_series_order():
    """The connector patch comes before the first backend that moves to the packed layout."""
    patches = ladder.series_patches()
    connector, triton = find_patch(), find_patch(TRITON_SUBJECT)
    assert patches.index(connector) < patches.index(triton)


def test_patch_trailers_and_scope():
    text = find_patch().read_text()
    head = text.split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    assert set(touched(find_patch())) <= ALLOWED, "Python connector files only (no compiled code)"
