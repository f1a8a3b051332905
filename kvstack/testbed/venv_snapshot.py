"""Venvs the tests install from the package index, built once per content hash, copied for each use.

A test that needs a fresh venv with the pinned wheels installed the way a user or the image installs
them (tests/env/test_own_install.py, tests/env/test_image_install.py) spends minutes of pip on each
run, for a result that depends only on the install's inputs: the install commands, the pin files,
the install scripts they run, the interpreter. `provide` keeps that venv in kvstack's cache under
the hash of those inputs (``$KVSTACK_CACHE/venvs/<what>-<hash>``, only the current one per `what`
stays, as scripts/venv_cache.sh keeps `make env`'s: 3-6 GB each) and gives each run a copy
(scripts/venv_copy.sh: its own path rewritten where a venv names it), on which the test then runs
its steps. The container builder does the same for the image: its deps stage is a layer cached by
the same inputs.

``KVSTACK_VENV_CACHE=0`` builds every time and keeps nothing (as for `make env`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvstack.release.pins import cache_dir

REPO = Path(__file__).resolve().parents[2]
COPY = REPO / "scripts" / "venv_copy.sh"
SWITCH = "KVSTACK_VENV_CACHE"


def base_interpreter() -> str:
    """The interpreter a venv made from this one runs on: this process's base interpreter (not a
    venv's bin/python, whose path differs between checkouts while the venvs made from it do not)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _name(path: Path) -> str:
    """A file's name in the key: its path in the checkout (the same in every clone), else its name."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def key_of(what: str, inputs: Iterable[str | Path]) -> str:
    """The hash of what the venv depends on: `what`, the base interpreter (version and path), each
    input (a file's bytes and its path in the checkout, or a string as given). Nothing of the
    checkout's own location is in it, so every clone finds what another one kept."""
    h = hashlib.sha256(f"{what}\n{sys.version.split()[0]} {base_interpreter()}\n".encode())
    for item in inputs:
        if isinstance(item, Path):
            h.update(f"file {_name(item)}\n".encode() + item.read_bytes() + b"\n")
        else:
            h.update(f"text {item}\n".encode())
    return h.hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def copy_venv(src: Path, dest: Path, origin: Path | None = None) -> None:
    subprocess.run(["bash", str(COPY), str(src), str(dest), str(origin or src)], check=True)


def provide(dest: Path, what: str, inputs: Iterable[str | Path], build: Callable[[Path], None]) -> str:
    """`dest` becomes the venv of `inputs`: a copy of the cached one, else `build(dest)` (which creates
    and installs it; an exception leaves nothing cached) and a copy kept for the next time. Returns a
    line saying which, with the seconds it took."""
    t0 = time.monotonic()
    snap = cache_dir() / "venvs" / f"{what}-{key_of(what, inputs)}"
    if enabled() and (snap / "venv" / "pyvenv.cfg").is_file() and (snap / "origin").is_file():
        copy_venv(snap / "venv", dest, Path((snap / "origin").read_text().strip()))
        _prune_others(snap, what)
        return f"{what}: the venv copied from {snap} in {time.monotonic() - t0:.0f} s"
    build(dest)
    built = time.monotonic() - t0
    if not enabled():
        return f"{what}: the venv built in {built:.0f} s ({SWITCH}=0: not kept)"
    partial = snap.with_name(snap.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(dest), str(partial / "venv")], check=True)
    (partial / "origin").write_text(f"{dest}\n")
    shutil.rmtree(snap, ignore_errors=True)
    partial.rename(snap)
    _prune_others(snap, what)
    return f"{what}: the venv built in {built:.0f} s and kept in {snap}"


def _prune_others(snap: Path, what: str) -> None:
    """Only the venv of the current inputs stays (an input changed and back builds again, minutes,
    where keeping the old one costs 3-6 GB of every run's disk); a build in progress (.partial)
    stays, as does a longer name that starts like this one's."""
    for old in snap.parent.glob(f"{what}-*"):
        if old != snap and not old.name.endswith(".partial") and old.name[len(what) + 1:].isalnum():
            shutil.rmtree(old, ignore_errors=True)
