"""The patch round trip: series -> git work tree -> series, byte-identical.

    import: a fresh git work tree of the pristine pinned sdist, committed and
            tagged `kvstack-base`, with every series patch `git am`-ed on top
            (one commit per patch, authorship and dates from the patch).
    export: `git format-patch kvstack-base..HEAD` with fixed options, written
            back to patches/<component>/ together with a regenerated series.

Fixed format-patch options make the bytes depend only on the commits:
--zero-commit (no commit ids), --full-index (no abbreviation that varies with
the object count), --no-signature (no git version), --no-renames, -N ([PATCH]).
Import then export therefore reproduces the patches exactly (tested).

Typical work on a patch:
    scripts/import_patches.sh vllm build/vllm-work   # tree with our commits
    cd build/vllm-work && $EDITOR ... && git commit --amend / git rebase -i
    scripts/export_patches.sh vllm build/vllm-work   # rewrites patches/<base>/vllm/ ($KVSTACK_BASE, else vllm/default)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvstack.release.fetch import cached_sdist, extract_sdist
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, load_pin

BASE_TAG = "kvstack-base"
FORMAT_PATCH = ["format-patch", "--zero-commit", "--full-index", "--no-signature", "--no-renames",
                "-N", "--stat=80", "--encoding=UTF-8"]
# Commits made by the tooling itself (the base) get a fixed identity and date.
BASE_ENV = {"GIT_AUTHOR_NAME": "kvstack", "GIT_AUTHOR_EMAIL": "kvstack@localhost",
            "GIT_COMMITTER_NAME": "kvstack", "GIT_COMMITTER_EMAIL": "kvstack@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}


def git(cwd: Path, *args: str, env: dict | None = None) -> str:
    res = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "advice.detachedHead=false", *args],
                         cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}:\n{res.stderr.strip()}")
    return res.stdout


def import_series(component: str, worktree: Path, series_dir: Path | None = None,
                  source: Path | None = None) -> list[str]:
    """Make worktree = pristine upstream (tagged kvstack-base) + one commit per series patch."""
    pin = load_pin(component)
    if worktree.exists() and any(worktree.iterdir()):
        raise RuntimeError(f"{worktree} exists and is not empty; pick a new folder")
    if source is not None:
        shutil.copytree(source, worktree, symlinks=True)
    else:
        extract_sdist(cached_sdist(pin), worktree)
    git(worktree, "init", "--quiet", "-b", "upstream")
    # The sdist may carry its own ignore rules; the base must hold every file.
    git(worktree, "add", "--all", "--force", ".")
    git(worktree, "-c", "user.name=kvstack", "-c", "user.email=kvstack@localhost", "commit", "--quiet",
        "--no-verify", "-m", f"{pin.project} {pin.version} (pristine sdist)", env=BASE_ENV)
    git(worktree, "tag", BASE_TAG)
    git(worktree, "checkout", "--quiet", "-b", "kvstack")
    patches = read_series(series_dir or pin.series_dir)
    if patches:
        git(worktree, "-c", "user.name=kvstack", "-c", "user.email=kvstack@localhost",
            "am", "--quiet", "--no-3way", "--keep-non-patch", "--committer-date-is-author-date", *map(str, patches))
    return [p.name for p in patches]


def export_series(worktree: Path, series_dir: Path, base: str = BASE_TAG) -> list[str]:
    """Write base..HEAD of worktree as series_dir/*.patch + series (old patches replaced)."""
    git(worktree, "rev-parse", "--verify", base)
    series_dir.mkdir(parents=True, exist_ok=True)
    header = []
    series = series_dir / "series"
    if series.exists():  # keep the series file's leading comment block
        for line in series.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
    for old in series_dir.glob("*.patch"):
        old.unlink()
    out = git(worktree, *FORMAT_PATCH, "-o", str(series_dir.resolve()), f"{base}..HEAD")
    names = [Path(line).name for line in out.splitlines() if line.strip()]
    series.write_text("\n".join(header + names) + "\n")
    return names


def main_import(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/import_patches.sh",
                                     description="Make a git work tree: pristine pinned sdist + one commit per patch.")
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("worktree", type=Path, help="new folder to create")
    parser.add_argument("--series-dir", type=Path, help="series to import (default patches/<component>/)")
    parser.add_argument("--source", type=Path, help="copy this tree as the base instead of the pinned sdist")
    args = parser.parse_args(argv)
    try:
        names = import_series(args.component, args.worktree, args.series_dir, args.source)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{args.worktree}: base tagged {BASE_TAG}, {len(names)} patch commit(s) on branch kvstack")
    return 0


def main_export(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/export_patches.sh",
                                     description="Regenerate patches/<component>/ and its series from a work tree.")
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("worktree", type=Path)
    parser.add_argument("--series-dir", type=Path, help="where to write (default patches/<component>/)")
    parser.add_argument("--base", default=BASE_TAG, help=f"upstream base commit (default {BASE_TAG})")
    args = parser.parse_args(argv)
    try:
        names = export_series(args.worktree, args.series_dir or load_pin(args.component).series_dir, args.base)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {len(names)} patch(es): {' '.join(names) or '(none)'}")
    return 0
