"""`kvstack doctor` in the built environment: passes as built, fails naming a reverted patched file.

The revert happens in an overlay, never in the real venv: the installed `vllm`/`lmcache` package is
copied with hard links into a temp dir that comes first on PYTHONPATH, and only the reverted file is
replaced by a real copy of the pristine upstream file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.release.doctor import package_root
from kvstack.release.patchstack import PACKAGE, read_series, touched_paths
from kvstack.release.pins import COMPONENTS, load_pin


def doctor(env=None):
    return subprocess.run([sys.executable, "-m", "kvstack.cli", "doctor"], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_doctor_passes_in_the_built_environment():
    res = doctor()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all pins and patches match" in res.stdout
    for comp in COMPONENTS:
        for patch in read_series(load_pin(comp).series_dir):
            installs = any(rel.split("/", 1)[0] == PACKAGE[comp] for rel in touched_paths(patch))
            state = "applied" if installs else "nothing to apply here"  # e.g. a patch of tests/
            assert f"{comp}/{patch.name}: {state}" in res.stdout


def _first_patched_file():
    for comp in COMPONENTS:
        for patch in read_series(load_pin(comp).series_dir):
            for rel in touched_paths(patch):
                if rel.startswith(PACKAGE[comp] + "/") and (load_pin(comp).tree / rel).is_file():
                    return comp, patch, rel
    return None


def test_doctor_fails_naming_a_reverted_file(tmp_path, pinned_tree):
    found = _first_patched_file()
    if found is None:
        pytest.fail("the patch stack changes no installed file yet, so there is nothing to revert")
    comp, patch, rel = found
    site = package_root(comp)
    overlay = tmp_path / "overlay"
    shutil.copytree(site / PACKAGE[comp], overlay / PACKAGE[comp], copy_function=os.link)
    target = overlay / rel
    target.unlink()  # break the hard link before writing
    from kvstack.release.fetch import cached_sdist, extract_sdist

    pristine = tmp_path / "pristine"
    extract_sdist(cached_sdist(load_pin(comp)), pristine)
    shutil.copy2(pristine / rel, target)
    res = doctor({"PYTHONPATH": str(overlay)})
    assert res.returncode == 1, res.stdout
    assert f"{comp}/{patch.name}: NOT applied" in res.stdout
    assert rel in res.stdout


def test_doctor_fails_on_a_version_mismatch(tmp_path):
    # A fake dist-info of another version shadows the real one: doctor must name it.
    fake = tmp_path / "fake"
    (fake / "lmcache-0.4.0.dist-info").mkdir(parents=True)
    (fake / "lmcache-0.4.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache\nVersion: 0.4.0\n")
    res = doctor({"PYTHONPATH": str(fake)})
    assert res.returncode == 1
    assert f"lmcache 0.4.0 (pin {load_pin('lmcache').version})" in res.stdout
    assert "is no base of kvstack (the bases are: 0.25 (vLLM 0.25.1 + LMCache 0.5.3), 0.32" in res.stdout
