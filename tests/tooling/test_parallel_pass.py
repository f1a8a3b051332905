"""`make test`'s two passes: the parallel pass's workers keep to disjoint shares of the cores
(kvstack.testbed.workers, called by tests/conftest.py), and the passes' junit files are merged into the
one file the matrix reads (kvstack.matrix.results.merge_junit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstack.matrix.results import merge_junit, read_junit
from kvstack.testbed.workers import worker_share

REPO = Path(__file__).resolve().parents[2]


def test_worker_shares_split_the_cores():
    assert worker_share([0, 1], 0, 2) == [0] and worker_share([0, 1], 1, 2) == [1]
    assert [worker_share(list(range(7)), i, 3) for i in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]


@pytest.mark.serial  # needs the cores a parallel-pass worker does not have
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores")
@pytest.mark.parametrize("pinned", [True, False])
def test_xdist_workers_run_on_disjoint_cores(tmp_path, pinned):
    """Two workers, each test reports its process's and a child process's allowed cores. Pinned: the
    workers' sets are disjoint, cover the cores, and the child inherits its worker's. The control
    (the same run without the pinning call): both workers see every core."""
    if not _has_xdist():
        pytest.skip("pytest-xdist is not installed in this interpreter")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from kvstack.testbed.workers import pin_xdist_worker
        if {pinned!r}:
            pin_xdist_worker()
    """))
    (tmp_path / "test_cores.py").write_text(textwrap.dedent("""
        import json, os, subprocess, sys, pytest

        @pytest.mark.parametrize("i", range(4))
        def test_report(i):
            child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            out = os.path.join(os.environ["REPORT_DIR"], f"cores-{os.environ['PYTEST_XDIST_WORKER']}-{i}.json")
            open(out, "w").write(json.dumps({"worker": os.environ["PYTEST_XDIST_WORKER"],
                                       "own": sorted(os.sched_getaffinity(0)), "child": json.loads(child),
                                       "omp": os.environ.get("OMP_NUM_THREADS")}))
    """))
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["REPORT_DIR"] = str(reports_dir)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          str(tmp_path / "test_cores.py")],
                         cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    reports = [json.loads(p.read_text()) for p in reports_dir.glob("cores-*.json")]
    assert len(reports) == 4, res.stdout
    by_worker: dict[str, set] = {}
    for r in reports:
        assert r["child"] == r["own"], r  # what a worker starts keeps to its cores
        by_worker.setdefault(r["worker"], set()).update(r["own"])
    everything = set(os.sched_getaffinity(0))
    if pinned:
        assert len(by_worker) == 2, by_worker  # 4 tests on 2 workers: both ran some
        a, b = by_worker.values()
        assert a and b and not a & b and a | b <= everything, by_worker
        assert all(r["omp"] == str(len(r["own"])) for r in reports)
    else:
        assert all(s == everything for s in by_worker.values()), by_worker


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def _junit(path: Path, cases: list[tuple[str, str]]) -> Path:
    body = "".join(f'<testcase classname="tests.t" name="{n}">{x}</testcase>' for n, x in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{len(cases)}">'
                    f"{body}</testsuite></testsuites>")
    return path


def test_merged_junit_holds_both_passes(tmp_path):
    par = _junit(tmp_path / "parallel-x.xml", [("a", ""), ("b", "<skipped/>")])
    ser = _junit(tmp_path / "serial-x.xml", [("c", "<failure message='m'/>")])
    out = tmp_path / "tests-x.xml"
    assert merge_junit(out, [par, ser, tmp_path / "missing.xml"]) == 3
    got = {c.name: c.outcome for c in read_junit(out)}
    assert got == {"a": "passed", "b": "skipped", "c": "failed"}
    # a bare <testsuite> root (another junit writer) merges the same
    bare = tmp_path / "bare.xml"
    bare.write_text('<testsuite name="x"><testcase classname="tests.t" name="d"/></testsuite>')
    assert merge_junit(out, [par, bare]) == 3
    # the command `make test` runs
    res = subprocess.run([sys.executable, "-m", "kvstack.matrix.merge", str(out), str(par), str(ser)],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0 and "3 test cases" in res.stdout, res.stdout + res.stderr
    assert "Warning" not in res.stderr, res.stderr


def test_the_make_target_runs_both_passes():
    """`make test-base` runs the non-serial tests on TEST_JOBS workers, then the serial ones, then
    merges their junit files into the one the matrix reads (checked on the dry-run's commands)."""
    res = subprocess.run(["make", "-n", "--no-print-directory", "test-base", "TEST_JOBS=2",
                          "VENV=.venv-none", "BASE=0.32"], cwd=REPO, capture_output=True, text=True)
    text = res.stdout
    assert '-m "not serial" -n 2 --dist loadfile' in text, text
    assert "-m serial" in text and "kvstack.matrix.merge build/junit/tests-0.32.xml" in text, text
    one = subprocess.run(["make", "-n", "--no-print-directory", "test-base", "TEST_JOBS=0",
                          "VENV=.venv-none", "BASE=0.32"], cwd=REPO, capture_output=True, text=True)
    assert '-m "not serial"' in one.stdout and "--dist" not in one.stdout, one.stdout  # one process
