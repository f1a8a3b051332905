"""`.ci/run`, CI's entry point: installs the tests' Debian packages where missing
(scripts/ci_packages.sh, progress on stderr), runs `make test` with CI=1 from the repository root,
ends with the run's wall time and the free disk before and after, and exits with make's status
(a `make` stand-in on PATH: the real `make test` is what CI runs around this test)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_with_make(tmp_path: Path, status: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    make = bin_dir / "make"
    make.write_text(f'#!/bin/sh\necho "make $* in $(pwd) CI=$CI"\nexit {status}\n')
    make.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CI", None)
    return subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=tmp_path)


def test_runs_make_test_and_ends_with_its_time(tmp_path):
    res = run_with_make(tmp_path, 0)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0, res.stdout + res.stderr
    assert lines[0] == f"make test in {REPO} CI=1"
    assert lines[-1].startswith("== .ci/run: make test took 0m") and lines[-1].endswith(
        "exit status 0"), lines[-1]
    assert re.search(r", \d+ GB free on disk before it and \d+ GB after, ", lines[-1]), lines[-1]


def test_a_failing_run_still_prints_its_time_and_keeps_the_status(tmp_path):
    res = run_with_make(tmp_path, 3)
    assert res.returncode == 3
    assert res.stdout.strip().splitlines()[-1].endswith("exit status 3"), res.stdout


def test_ci_packages_lists_what_is_missing_and_changes_nothing_with_check(tmp_path):
    """--check names the missing packages without installing; with a PATH holding none of the
    tools they are all missing (the control: the same PATH with them finds them installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "sed"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    script = str(REPO / "scripts" / "ci_packages.sh")
    res = subprocess.run(["bash", script, "--check"], capture_output=True, text=True,
                         env={"PATH": str(bin_dir)}, timeout=60)
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr
    assert "missing: buildah mmdebstrap redis-server" in res.stderr, res.stderr
    bad = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
    for tool in ("buildah", "mmdebstrap", "redis-server"):
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    res = subprocess.run(["bash", script, "--check"], capture_output=True, text=True,
                         env={"PATH": str(bin_dir)}, timeout=60)
    assert res.returncode == 0 and "installed" in res.stderr and "missing" not in res.stderr, res.stderr
