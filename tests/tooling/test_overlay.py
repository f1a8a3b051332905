"""kvstack/release/overlay.py without a venv: fake site-packages, fixture patches, a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import REPO, make_patch

from kvstack.release import overlay


@pytest.fixture
def site(tmp_path):
    site = tmp_path / "site-packages"
    (site / "vllm" / "sub").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "sub" / "__init__.py").write_text("")
    (site / "vllm" / "sub" / "mod.py").write_text("VALUE = 'installed'\nOTHER = 1\n")
    return site


def _patch(tmp_path: Path, site: Path) -> Path:
    text = make_patch(tmp_path, "vllm/sub/mod.py", "VALUE = 'installed'", "VALUE = 'patched'", "fixture",
                      site)
    path = tmp_path / "0001-fixture.patch"
    path.write_text(text)
    return path


@pytest.mark.parametrize("inside_git", [False, True], ids=["plain-folder", "inside-a-git-work-tree"])
def test_build_overlay_applies_and_reverses(tmp_path, site, inside_git):
    """Also inside another repository's work tree (e.g. build/ of a checkout), where a bare
    `git apply` would skip every file silently and exit 0."""
    patch = _patch(tmp_path, site)
    base = tmp_path / "checkout"
    if inside_git:
        subprocess.run(["git", "init", "-q", str(base)], check=True)
    dest = base / "build" / "overlay"
    files = overlay.build_overlay([patch], site, dest)
    assert files == ["vllm/sub/mod.py"]
    assert "VALUE = 'patched'" in (dest / "vllm/sub/mod.py").read_text()
    # reversed: from an installation that has the patch, back to the file before it
    (site / "vllm/sub/mod.py").write_text((dest / "vllm/sub/mod.py").read_text())
    overlay.build_overlay([patch], site, dest, reverse=True)
    assert "VALUE = 'installed'" in (dest / "vllm/sub/mod.py").read_text()


def test_build_overlay_names_the_patch_that_does_not_apply(tmp_path, site):
    patch = _patch(tmp_path, site)
    (site / "vllm/sub/mod.py").write_text("something else\n")
    with pytest.raises(RuntimeError, match="0001-fixture.patch does not apply"):
        overlay.build_overlay([patch], site, tmp_path / "ov")


def test_install_puts_the_overlay_in_front(tmp_path, site):
    patch = _patch(tmp_path, site)
    dest = tmp_path / "ov"
    overlay.build_overlay([patch], site, dest)
    code = ("from kvstack.release import overlay; assert overlay.install(); "
            "import vllm.sub.mod as m; print(m.VALUE, m.__file__)")
    env = {**os.environ, overlay.ENV: str(dest),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == ["patched", str(dest / "vllm/sub/mod.py")]
