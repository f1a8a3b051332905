"""The checkout's top level: vllm/ and lmcache/ hold each component's pins (tracked) and its fetched
sources (src/, git-ignored), and neither may turn into a Python package that hides the installed one.

Neither folder has an __init__.py, so for Python each is at most a namespace-package candidate (PEP 420):
while the import system scans sys.path, a regular package (or module) found anywhere wins at once, and
a folder without __init__.py is used only when nothing else is found. So `import vllm` / `import
lmcache` with the checkout's root on sys.path (cwd = the root with `python -m pytest` or `python -c`,
or PYTHONPATH=root as scripts/*.sh set it) still load the installed packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import REPO
from kvstack.release.pins import COMPONENTS, DEFAULT_FILE, base_names, default_base, load_pin


def _git(*args: str) -> list[str]:
    res = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if res.returncode not in (0, 1):
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    return [ln for ln in res.stdout.splitlines() if ln]


def test_component_folders_hold_the_pins_and_no_python():
    for comp in COMPONENTS:
        folder = REPO / comp
        assert folder.is_dir(), folder
        assert not (folder / "__init__.py").exists(), f"{comp}/__init__.py would hide the installed {comp}"
        assert not list(folder.glob("*.py")) and not list(folder.glob("*.so")), f"no module in {comp}/"
        for suffix in (".py", ".pyc", ".so", ".pth"):
            assert not (REPO / f"{comp}{suffix}").exists(), f"{comp}{suffix} at the root would win over {comp}/"
        for base in base_names():
            pin = load_pin(comp, base)
            assert pin.file == folder / f"{base}.env" and pin.file.is_file()
            assert pin.tree == folder / "src" / base
    assert (REPO / DEFAULT_FILE).read_text().strip() in base_names()


def test_only_the_pins_are_tracked_and_the_sources_are_ignored():
    tracked = _git("ls-files", "--", "vllm", "lmcache")
    assert tracked, "the pins are tracked"
    expected = {str(DEFAULT_FILE)} | {f"{c}/{b}.env" for c in COMPONENTS for b in base_names()}
    assert set(tracked) == expected, tracked
    probes = [f"{c}/src/{default_base()}/{f}" for c in COMPONENTS for f in ("PKG-INFO", f"{c}/__init__.py", "x.env")]
    assert _git("check-ignore", "--no-index", *probes) == probes, "the fetched sources are git-ignored"
    assert not _git("check-ignore", "--no-index", *expected), "the pins are not ignored"


def _run(code: str, cwd: Path, pythonpath: list[Path], *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


SHOW = """
import importlib, json, sys
assert sys.path[0] == '', sys.path[:3]  # cwd first, as with python -m pytest
out = {}
for name in ("vllm", "lmcache"):
    m = importlib.import_module(name)
    out[name] = [getattr(m, "__file__", None), list(getattr(m, "__path__", []))]
from kvstack.release.doctor import package_root
out["package_root"] = {c: str(package_root(c)) if package_root(c) else None for c in ("vllm", "lmcache")}
print(json.dumps(out))
"""


def test_installed_regular_packages_win_from_the_root(tmp_path):
    """Hermetic (-S: no site-packages): a stand-in 'installed' vllm and lmcache after the checkout's root
    on sys.path are the ones imported from the root; without them, the root's folders are namespace
    packages, which doctor does not take for an installation."""
    import json

    site = tmp_path / "site-packages"
    for comp in COMPONENTS:
        (site / comp).mkdir(parents=True)
        (site / comp / "__init__.py").write_text("INSTALLED = True\n")
    res = _run(SHOW, REPO, [REPO, site], "-S")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for comp in COMPONENTS:
        assert got[comp][0] == str(site / comp / "__init__.py"), got
        assert got[comp][1] == [str(site / comp)], got
        assert got["package_root"][comp] == str(site)
    # The control: nothing installed -> a namespace package of the checkout's folder (no __file__), which
    # is why kvstack never takes a spec without an origin for an installed vLLM or LMCache.
    res = _run(SHOW, REPO, [REPO], "-S")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for comp in COMPONENTS:
        assert got[comp][0] is None and set(got[comp][1]) == {str(REPO / comp)}, got
        assert got["package_root"][comp] is None, got


FIND = """
import importlib.util, json, sys
print(json.dumps({n: (s.origin if (s := importlib.util.find_spec(n)) else None) for n in ("vllm", "lmcache")}))
"""


def test_this_interpreters_vllm_and_lmcache_load_from_the_root(tmp_path):
    """With this interpreter (a base's venv under `make test`): from the root, with the root on
    PYTHONPATH too, vllm and lmcache resolve to the same installed files as from elsewhere (the import
    system's own lookup, without running the packages' __init__)."""
    import json

    elsewhere = _run(FIND, tmp_path, [])
    assert elsewhere.returncode == 0, elsewhere.stderr
    installed = json.loads(elsewhere.stdout)
    if not any(installed.values()):
        pytest.skip(f"neither vLLM nor LMCache is installed for {sys.executable}")
    here = _run(FIND, REPO, [REPO])
    assert here.returncode == 0, here.stderr
    got = json.loads(here.stdout)
    for comp, origin in installed.items():
        if origin is None:
            continue
        assert got[comp] == origin, f"{comp} from the root: {got[comp]}, installed: {origin}"
        # the installed package, never the root's folder (a venv may live under the root: .venv)
        assert Path(origin).name == "__init__.py" and Path(origin).parent != REPO / comp
