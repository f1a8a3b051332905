"""Run an installed vLLM with extra patches applied, without modifying the installation.

`build_overlay` copies the Python files a series of -p1 patches touches from an installed
site-packages folder into a scratch folder and applies the patches there, in series order
(all or nothing: `git apply` checks every hunk before writing). With `reverse=True` it takes
them out instead (last patch first): the files as they were before those patches, from an
installation that has them applied. `install` (called in the child
process before vLLM is imported) puts a meta-path finder in front of the installed package, so
each overlaid module replaces the installed one and everything else (compiled extensions
included) is imported from the installation as usual.

Used by ci/gpu/check_layout.py (patched vs unpatched on the same wheel) and by tests that must
not touch the shared venv. Environment variable of the child: KVSTACK_OVERLAY=<folder>.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ENV = "KVSTACK_OVERLAY"


def series_patches(series_dir: Path) -> list[Path]:
    """The patch files of `series_dir/series`, in order (comments and blank lines skipped)."""
    out = []
    for line in (series_dir / "series").read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            path = series_dir / name
            if not path.is_file():
                raise FileNotFoundError(f"{series_dir}/series names {name}, which is not there")
            out.append(path)
    return out


def touched_files(patch: Path) -> list[str]:
    return [ln[6:] for ln in patch.read_text().splitlines() if ln.startswith("+++ b/")]


def issue_patches(series_dir: Path, issue: str) -> list[Path]:
    """The patches of `series_dir/series` whose header names `issue` in its `Kvstack-Issue:`
    trailer (one number, or several separated by commas), in order."""
    out = []
    for patch in series_patches(series_dir):
        head = patch.read_text().split("\n---\n", 1)[0]
        for ln in head.splitlines():
            if ln.startswith("Kvstack-Issue:") and str(issue) in {
                    n.strip() for n in ln.split(":", 1)[1].split(",")}:
                out.append(patch)
                break
    return out


def build_overlay(patches: list[Path], site_packages: Path, dest: Path, *,
                  reverse: bool = False, files_of: list[Path] | None = None) -> list[str]:
    """Copy the files `patches` touch (or, when given, the files `files_of` touch) from
    `site_packages` to `dest` and apply `patches` there in order (`reverse`: take them out,
    last one first). Returns the relative paths of the overlaid files. Raises RuntimeError
    naming the patch that does not apply (dest is then incomplete: callers use a fresh folder)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    files: list[str] = []
    for patch in (patches if files_of is None else files_of):
        for rel in touched_files(patch):
            if rel in files or not rel.startswith("vllm/"):
                continue  # tests/, docs/ ...: not part of the installed package
            src = site_packages / rel
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            if src.exists():
                shutil.copy2(src, dest / rel)
            files.append(rel)
    for patch in (reversed(patches) if reverse else patches):
        includes = [f"--include={rel}" for rel in touched_files(patch) if rel in files]
        if not includes:
            continue
        flags = ["-R"] if reverse else []
        # Inside another git work tree (dest under build/ of a checkout), `git apply` would take
        # paths as relative to that tree's top and silently skip every file outside its cwd:
        # exit 0, nothing applied. The ceiling keeps it from finding a repository above dest.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
        env.pop("GIT_DIR", None)
        env.pop("GIT_WORK_TREE", None)
        res = subprocess.run(["git", "apply", "-p1", *flags, *includes, str(patch.resolve())],
                             cwd=dest, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            how = "cannot be reversed on" if reverse else "does not apply to"
            raise RuntimeError(f"{patch.name} {how} the files of {site_packages}: "
                               f"{res.stderr.strip()}")
    return files


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("vllm."):
            return None
        rel = fullname.replace(".", "/")
        module = self.root / f"{rel}.py"
        if module.is_file():
            return importlib.util.spec_from_file_location(fullname, module)
        package = self.root / rel / "__init__.py"
        if package.is_file():  # its other submodules still come from the installation
            installed = importlib.machinery.PathFinder.find_spec(fullname, path)
            locations = [str(package.parent)]
            if installed is not None and installed.submodule_search_locations:
                locations += list(installed.submodule_search_locations)
            return importlib.util.spec_from_file_location(
                fullname, package, submodule_search_locations=locations)
        return None


def install(root: str | os.PathLike[str] | None = None) -> bool:
    """Put the overlay in `root` (default: $KVSTACK_OVERLAY) in front of the installed vLLM.
    Must run before vLLM is imported. Returns whether an overlay was installed."""
    root = root or os.environ.get(ENV)
    if not root:
        return False
    if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
        raise RuntimeError("kvstack.release.overlay.install() must run before vLLM is imported")
    sys.meta_path.insert(0, _Finder(Path(root)))
    return True
