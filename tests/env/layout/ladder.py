"""The layout ladder (the patches of patches/vllm/series that say `Kvstack-Issue: 3`) as the
layout tests see it: each patch is tested at its place in the series.

`state_root(dest, upto)` gives a folder laid out like site-packages holding every file the
ladder touches as it is once the series is applied up to and including `upto` (with
`include=False`: up to just before it, the negative control; `upto=None`: before the whole
ladder, i.e. 0.25.1 with kvstack's earlier patches). It is built from the installed vLLM,
which is never modified:
  - the venv has the whole series (the kvstack venv after `make env`): the ladder patches
    after the cut are taken out of copies of the installed files (git apply -R, last first);
  - the venv lacks the ladder: the patches up to the cut are applied to copies.
A patch whose files the later patches do not touch therefore sees exactly the installed file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvstack.release import overlay  # noqa: E402

# The ladder is a backport: only base 0.25 carries it (vLLM 0.27+ has it upstream).
SERIES_DIR = REPO / "patches" / "0.25" / "vllm"
ISSUE = "3"


def series_patches() -> list[Path]:
    return overlay.series_patches(SERIES_DIR)


def ladder() -> list[Path]:
    return overlay.issue_patches(SERIES_DIR, ISSUE)


def touched(patch: Path) -> list[str]:
    return overlay.touched_files(patch)


def find_patch(subject: str, target: str | None = None) -> Path:
    """The series patch whose header names `subject` (and, when given, that changes `target`)."""
    for patch in series_patches():
        text = patch.read_text()
        head = " ".join(text.split("\n---\n", 1)[0].split())  # the Subject: line may be folded
        if subject in head and (target is None or f"+++ b/{target}" in text):
            return patch
    pytest.fail(f"no patch '{subject}' in {SERIES_DIR}/series", pytrace=False)


def installed_root() -> Path:
    try:
        import vllm
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable with {sys.executable} ({exc}); run in the kvstack "
                    "venv", pytrace=False)
    return Path(vllm.__path__[0]).parent


@lru_cache(maxsize=1)
def ladder_in_venv() -> bool:
    """Whether the installed vLLM has the ladder: its last patch of installed files comes out
    without a conflict (apply is all or nothing, so then every one of them is in)."""
    import tempfile

    last = [p for p in ladder() if any(f.startswith("vllm/") for f in touched(p))][-1]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            overlay.build_overlay([last], installed_root(), Path(tmp) / "o", reverse=True)
        except RuntimeError:
            return False
    return True


def state_root(dest: Path, upto: Path | None, *, include: bool = True) -> Path:
    """Every file the ladder touches, in the state 'series applied up to `upto`' (see the
    module docstring). Returns dest."""
    steps = ladder()
    if upto is None:
        cut = 0
    else:
        assert upto in steps, f"{upto.name} is not a patch of the layout ladder"
        cut = steps.index(upto) + (1 if include else 0)
    if ladder_in_venv():
        overlay.build_overlay(steps[cut:], installed_root(), dest, reverse=True, files_of=steps)
    else:
        overlay.build_overlay(steps[:cut], installed_root(), dest, files_of=steps)
    return dest


def check_applies(patch: Path, source_root: Path, dest: Path) -> None:
    """`patch` (-p1) applies to copies, under dest, of the files it touches in source_root (a
    tree or site-packages laid out like one)."""
    files = touched(patch)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_root / rel, dest / rel)
    res = subprocess.run(["git", "apply", "-p1", "--check", *[f"--include={rel}" for rel in files],
                          str(patch)], cwd=dest, capture_output=True, text=True)
    assert res.returncode == 0, f"{patch.name} does not apply to {source_root}: {res.stderr}"
