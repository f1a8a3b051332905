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


# -- the parallel pass's order: longest module first (tests/longest_first.py) -------------------------

def test_longest_first_order_and_estimates(tmp_path):
    import longest_first as lf

    seconds = {"tests/a.py": 10.0, "tests/b.py": 300.0}
    # a module it does not know: a base plus a second per test
    assert lf.expected_seconds("tests/new.py", 5, seconds) == lf.UNKNOWN_BASE_S + 5 * lf.UNKNOWN_PER_TEST_S
    assert lf.order({"tests/a.py": 50, "tests/new.py": 3, "tests/b.py": 1}, seconds) == [
        "tests/b.py", "tests/new.py", "tests/a.py"]
    # a base's own figures win over another base's; a missing or broken file means no figures
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"0.32": {"tests/a.py": 1.0}, "0.25": {"tests/a.py": 2.0, "tests/b.py": 3.0}}))
    assert lf.load_seconds("0.32", f) == {"tests/a.py": 1.0, "tests/b.py": 3.0}
    assert lf.load_seconds(None, tmp_path / "none.json") == {}
    f.write_text("{")
    assert lf.load_seconds("0.32", f) == {}


def test_module_seconds_from_junit(tmp_path):
    import longest_first as lf

    (tmp_path / "tests" / "env").mkdir(parents=True)
    (tmp_path / "tests" / "env" / "test_x.py").write_text("")
    junit = tmp_path / "parallel-0.32.xml"
    junit.write_text('<testsuites><testsuite name="pytest">'
                     '<testcase classname="tests.env.test_x" name="a" time="1.5"/>'
                     '<testcase classname="tests.env.test_x.TestY" name="b" time="2.0"/>'
                     '<testcase classname="tests.gone" name="c" time="9"/></testsuite></testsuites>')
    assert lf.seconds_from_junit(junit, tmp_path) == {"tests/env/test_x.py": 3.5}


def test_committed_module_seconds_name_existing_modules():
    """A renamed module would silently fall back to the unknown estimate: the file names only
    modules that exist (regenerate it with `python tests/longest_first.py build/junit/parallel-*.xml`)."""
    table = json.loads((REPO / "tests" / "module_seconds.json").read_text())
    assert table, "tests/module_seconds.json is empty"
    gone = [m for modules in table.values() for m in modules if not (REPO / m).is_file()]
    assert not gone, gone


@pytest.mark.parametrize("longest_first", [True, False])
def test_xdist_hands_out_the_longest_module_first(tmp_path, longest_first):
    """One worker runs the modules in the order the scheduler hands them out: with the figures file
    the module it says is longest goes first though it has the fewest tests. The control (xdist's own
    loadfile order, the hook not installed): the module with the most tests goes first."""
    if not _has_xdist():
        pytest.skip("pytest-xdist is not installed in this interpreter")
    hook = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})

        def pytest_xdist_make_scheduler(config, log):
            from longest_first import make_scheduler
            return make_scheduler(config, log)
    """) if longest_first else ""
    (tmp_path / "conftest.py").write_text(hook)
    log = tmp_path / "order.log"
    for name, n in (("test_many", 6), ("test_some", 3), ("test_one", 1)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
            import pytest

            @pytest.mark.parametrize("i", range({n}))
            def test_it(i):
                open({str(log)!r}, "a").write("{name}\\n")
        """))
    seconds = tmp_path / "seconds.json"
    seconds.write_text(json.dumps({"x": {"test_one.py": 500.0, "test_some.py": 100.0, "test_many.py": 5.0}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(KVSTACK_MODULE_SECONDS=str(seconds), KVSTACK_BASE="x")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
                          "--dist", "loadfile", "test_many.py", "test_some.py", "test_one.py"],
                         cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    ran = list(dict.fromkeys(log.read_text().split()))
    want = ["test_one", "test_some", "test_many"] if longest_first else ["test_many", "test_some", "test_one"]
    assert ran == want, (ran, res.stdout)
