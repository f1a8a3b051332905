"""Helpers shared by kvstack's tests (imported as `kvtest`; conftest.py holds only fixtures)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_script(name: str, *args, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run scripts/<name> as a user would and capture its output."""
    res = subprocess.run(["bash", str(REPO / "scripts" / name), *map(str, args)], capture_output=True,
                         text=True, env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    if check and res.returncode != 0:
        raise AssertionError(f"{name} {args} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its sha256 and mode: two equal digests = byte-identical trees."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest() + oct(path.stat().st_mode)
    return out


def make_patch(tmp: Path, rel: str, old_line: str, new_line: str, subject: str, source: Path) -> str:
    """A git format-patch style patch replacing old_line with new_line in source/rel."""
    work = tmp / f"mk-{abs(hash((rel, subject))) % 10**8}"
    (work / "a" / rel).parent.mkdir(parents=True, exist_ok=True)
    (work / "b" / rel).parent.mkdir(parents=True, exist_ok=True)
    text = (source / rel).read_text()
    assert old_line in text, f"{old_line!r} not in {rel}"
    (work / "a" / rel).write_text(text)
    (work / "b" / rel).write_text(text.replace(old_line, new_line, 1))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--full-index", f"a/{rel}", f"b/{rel}"], cwd=work,
                          capture_output=True, text=True).stdout
    header = textwrap.dedent(f"""\
        From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
        From: kvstack test <kvstack@localhost>
        Date: Sat, 1 Jan 2000 00:00:00 +0000
        Subject: [PATCH] {subject}

        A fixture patch made by the tests.

        Upstream-Status: Inappropriate [test fixture]
        ---
        """)
    return header + diff + "--\n2.39.5\n\n"


def on_default_base() -> bool:
    """Whether the tests run on the base named in vllm/default ($KVSTACK_BASE, which
    tests/conftest.py sets from the venv, names the base they run on)."""
    default = (REPO / "vllm" / "default").read_text().strip()
    return os.environ.get("KVSTACK_BASE", default) == default


def default_base_only(why: str):
    """A skip mark for the other bases (CI time: `make test` runs each base's engine tests on the
    subset that differs between bases). `why`: what makes this check the same on every base (kvstack's
    own code, a user path the docs show on the default base) and what checks the other bases instead."""
    import pytest

    return pytest.mark.skipif(not on_default_base(), reason=f"default base only (CI time): {why}")
