"""vLLM's own tests (the base's pinned sdist) against the base's patched CPU environment: no new
failures and no stale entries in the base's ledger ci/upstream/<base>/expected-failures.txt.

Runs on the base in effect ($KVSTACK_BASE; tests/conftest.py sets it from the installed vLLM/LMCache
when unset), so `make test` checks each base against its own ledger.
The slow test runs the base's selection, kvstack.testbed.upstream_tests.PATHS_BY_BASE (upstream's
tests of what the base's series changes; 3-6 minutes on one core). The fast tests check the ledger
and the comparison rules the slow one relies on.
"""

from __future__ import annotations

import json
import sys

import pytest

from kvstack.release.pins import base_names, default_base
from kvstack.testbed.upstream_tests import (
    FAILED,
    HUB_SOURCE,
    PASSED,
    SKIPPED,
    UPSTREAM_CI,
    LedgerEntry,
    compare,
    default_paths,
    default_python,
    keeps_full_cleanup,
    ledger_file,
    read_ledger,
    run_suite,
    sdist_tests,
    stage_hub,
)

pytestmark = pytest.mark.env

BASE = default_base()
SDIST_TESTS = sdist_tests(BASE)


def test_ledger_entries_name_real_tests_with_reasons():
    ledger = ledger_file(BASE)
    assert ledger == UPSTREAM_CI / BASE / "expected-failures.txt"
    entries = read_ledger(ledger)
    assert entries, f"the ledger {ledger} is empty"
    for e in entries:
        assert len(e.reason) > 15, f"line {e.lineno}: reason too thin: {e.reason!r}"
        assert any(e.file == p or e.file.startswith(p + "/") for p in default_paths(BASE)), \
            f"line {e.lineno}: {e.file} is outside the suite's selection"
        if SDIST_TESTS.is_dir():
            assert (SDIST_TESTS.parent / e.file).is_file(), f"line {e.lineno}: no file {e.file}"
    if SDIST_TESTS.is_dir():
        for p in default_paths(BASE):
            assert (SDIST_TESTS.parent / p).exists(), f"base {BASE}: the selection's {p} is not in the sdist"


def test_every_base_has_a_ledger_and_a_venv_rule(monkeypatch):
    monkeypatch.delenv("KVSTACK_VENV", raising=False)
    default = (UPSTREAM_CI.parents[1] / "vllm" / "default").read_text().strip()
    for base in base_names():
        assert ledger_file(base).is_file(), f"base {base} has no ledger {ledger_file(base)}"
        read_ledger(ledger_file(base))  # well-formed
        venv = ".venv" if base == default else f".venv-{base}"
        assert default_python(base) == UPSTREAM_CI.parents[1] / venv / "bin" / "python"
    monkeypatch.setenv("KVSTACK_VENV", "/somewhere")
    assert str(default_python(BASE)) == "/somewhere/bin/python"


def test_compare_new_expected_stale():
    ledger = [
        LedgerEntry("tests/a/test_x.py::test_cuda[1]", "needs CUDA", 1),  # still fails: expected
        LedgerEntry("tests/a/test_x.py::test_fixed", "needs CUDA", 2),  # passes now: stale
        LedgerEntry("tests/a/test_ray.py", "collection error: needs ray", 3),  # still fails
        LedgerEntry("tests/a/test_gone.py::test_old", "needs a checkpoint", 4),  # not collected
        LedgerEntry("tests/b/test_y.py::test_z", "outside the selection", 5),  # out of scope
        LedgerEntry("tests/a/test_glob.py::test_p[*]", "needs CUDA", 6),  # wildcard
    ]
    results = [
        {"nodeid": "tests/a/test_x.py::test_cuda[1]", "outcome": FAILED},
        {"nodeid": "tests/a/test_x.py::test_fixed", "outcome": PASSED},
        {"nodeid": "tests/a/test_x.py::test_new", "outcome": FAILED},
        {"nodeid": "tests/a/test_x.py::test_skip", "outcome": SKIPPED},
        {"nodeid": "tests/a/test_ray.py", "outcome": FAILED},
        {"nodeid": "tests/a/test_glob.py::test_p[a-b]", "outcome": FAILED},
    ]
    expected, new, stale = compare(results, ledger, ["tests/a"], filtered=False)
    assert sorted(n for n, _ in expected) == [
        "tests/a/test_glob.py::test_p[a-b]", "tests/a/test_ray.py", "tests/a/test_x.py::test_cuda[1]"]
    assert [r["nodeid"] for r in new] == ["tests/a/test_x.py::test_new"]
    assert [(e.lineno, why) for e, why in stale] == [
        (2, "now passed"), (4, "not collected (gone or renamed?)")]
    # A filtered run (-k) cannot tell a missing test from a deselected one.
    _, _, stale = compare(results, ledger, ["tests/a"], filtered=True)
    assert [e.lineno for e, _ in stale] == [2]
    # '[' in an exact entry is literal, not a character class.
    assert not LedgerEntry("tests/a.py::t[ab]", "r", 1).matches("tests/a.py::ta")


def test_a_failure_that_passes_unpatched_is_a_regression(tmp_path):
    """The unpatched rerun's verdict (the control of the slow test's regression check)."""
    from kvstack.testbed.upstream_tests import Summary, write_ledger

    s = Summary(base="x", selection=["tests/a"], filtered=False,
                unpatched={"tests/a/t.py::ok_upstream": PASSED, "tests/a/t.py::cuda": FAILED,
                           "tests/a/t_collect.py": PASSED})
    assert s.regressions == ["tests/a/t.py::ok_upstream", "tests/a/t_collect.py"]
    assert not s.ok and "REGRESSION tests/a/t.py::ok_upstream" in s.text()
    assert Summary(base="x", selection=[], filtered=False,
                   unpatched={"tests/a/t.py::cuda": FAILED}).ok
    write_ledger(tmp_path / "l.tsv", [{"nodeid": "tests/a/t.py::cuda", "outcome": FAILED},
                                      {"nodeid": "tests/a/t.py::p", "outcome": PASSED}],
                 {"tests/a/t.py::cuda": FAILED})
    assert (tmp_path / "l.tsv").read_text().splitlines()[1:] == [
        "tests/a/t.py::cuda\tfailed\tfailed", "tests/a/t.py::p\tpassed\t-"]


def test_hub_stand_in_is_config_only_and_loads(tmp_path, monkeypatch):
    models = stage_hub(tmp_path / "hf_home")
    assert {"facebook/opt-125m", "Qwen/Qwen3-0.6B", "Qwen/Qwen1.5-7B"} <= set(models)
    files = sorted(p.name for p in (tmp_path / "hf_home").rglob("*") if p.is_file())
    assert set(files) == {"main", "config.json"}, files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import try_to_load_from_cache

    for model in models:
        got = try_to_load_from_cache(model, "config.json", cache_dir=str(tmp_path / "hf_home" / "hub"))
        assert isinstance(got, str), f"{model}: the hub cache layout is not what huggingface_hub reads"
        org, name = model.split("/")
        assert json.loads(open(got).read()) == json.loads((HUB_SOURCE / org / name / "config.json").read_text())


def test_only_engine_files_unfreeze_the_heap_in_upstreams_cleanup():
    """The run keeps the import-time heap frozen through upstream's per-test cleanup (its full
    collection over vLLM's imports was 80% of the selection's time) except for tests of files that
    start an engine or a distributed environment, whose cleanup unfreezes as upstream's does."""
    assert keeps_full_cleanup("llm = LLM(model=path, enforce_eager=True)", ())
    assert keeps_full_cleanup("init_distributed_environment(world_size=1, rank=0)", ())
    assert keeps_full_cleanup("", ("tmp_path", "dist_init"))
    assert not keeps_full_cleanup("scheduler = create_scheduler(vllm_config)", ("tmp_path",))
    if SDIST_TESTS.is_dir():
        unit = SDIST_TESTS / "v1" / "kv_connector" / "unit"
        assert keeps_full_cleanup((unit / "test_multi_connector.py").read_text(), ())
        core = SDIST_TESTS / "v1" / "core"
        assert not keeps_full_cleanup((core / "test_kv_cache_utils.py").read_text(), ())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_upstream_regression(capsys):
    if not (SDIST_TESTS / "conftest.py").is_file():
        pytest.fail(f"the vLLM sdist of base {BASE} is not fetched: run "
                    f"KVSTACK_BASE={BASE} scripts/fetch_sources.sh")
    # Run under the venv's python (.venv/bin/python -m pytest): that venv is the one tested (the
    # runner refuses it when its vLLM is not the base's pin).
    with capsys.disabled():
        summary = run_suite(base=BASE, python=sys.executable)
    print(summary.text())
    assert summary.counts.get(PASSED, 0) > 0, summary.text()
    assert not summary.new_failures and not summary.stale, summary.text()
    # never worse than upstream: no test passes with the series taken out and fails with it
    assert summary.unpatched is not None and not summary.regressions, summary.text()
