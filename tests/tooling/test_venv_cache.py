"""scripts/venv_cache.sh, the first half of `make env`: the pinned wheels' venv built once per
inputs and copied into a new checkout from kvstack's cache, its own path rewritten where a venv
names it. Run with a stand-in for build_env.sh (KVSTACK_BUILD_ENV) that lays out a venv the way
`python -m venv` + pip do and counts its runs: the cache is what these tests pin, not pip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "venv_cache.sh"

FAKE_BUILD_ENV = r"""#!/usr/bin/env bash
# stand-in for build_env.sh --deps-only: a venv's layout, its path where a real venv names it
set -euo pipefail
[ "$3" = --deps-only ] || { echo "called without --deps-only: $*" >&2; exit 9; }
v="$KVSTACK_VENV"
echo run >> "$COUNT"
mkdir -p "$v/bin" "$v/lib/python3.11/site-packages/pkg"
ln -sf "$(command -v python3)" "$v/bin/python"
printf '#!%s/bin/python\nimport pkg\n' "$v" > "$v/bin/tool"; chmod +x "$v/bin/tool"
printf 'VIRTUAL_ENV="%s"\nexport VIRTUAL_ENV\n' "$v" > "$v/bin/activate"
printf 'home = /usr/bin\ncommand = /usr/bin/python3 -m venv %s\n' "$v" > "$v/pyvenv.cfg"
echo 'DATA = 1' > "$v/lib/python3.11/site-packages/pkg/__init__.py"
echo "stamp" > "$v/.kvstack-deps"
"""


@pytest.fixture
def bed(tmp_path):
    fake = tmp_path / "build_env.sh"
    fake.write_text(FAKE_BUILD_ENV)
    env = {**os.environ, "KVSTACK_CACHE": str(tmp_path / "cache"), "KVSTACK_BUILD_ENV": str(fake),
           "COUNT": str(tmp_path / "count")}
    env.pop("KVSTACK_VENV_CACHE", None)
    return tmp_path, fake, env


def _run(env, venv, *extra, **more):
    res = subprocess.run(["bash", str(SCRIPT), "--base", "0.32", "--venv", str(venv), *extra],
                         env={**env, **more}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stderr


def _runs(tmp):
    return len((tmp / "count").read_text().split()) if (tmp / "count").exists() else 0


def test_built_once_then_copied_with_its_path_rewritten(bed):
    tmp, _, env = bed
    a, b = tmp / "one" / ".venv", tmp / "two" / ".venv"
    _run(env, a)
    assert _runs(tmp) == 1
    snaps = list((tmp / "cache" / "venvs").iterdir())
    assert [s.name.startswith("0.32-") for s in snaps] == [True]
    out = _run(env, b)
    assert _runs(tmp) == 1, "the second venv was built again instead of copied"
    assert "from the cache" in out and "copied to" in out
    assert (b / "bin" / "tool").read_text().startswith(f"#!{b}/bin/python\n")
    assert f'VIRTUAL_ENV="{b}"' in (b / "bin" / "activate").read_text()
    assert str(b) in (b / "pyvenv.cfg").read_text() and str(a) not in (b / "pyvenv.cfg").read_text()
    assert (b / "lib/python3.11/site-packages/pkg/__init__.py").read_text() == "DATA = 1\n"
    assert not any(p.name.endswith(".partial") for p in b.parent.iterdir())
    # the copy runs: its script's #! line names its own python
    assert subprocess.run([str(b / "bin" / "tool")], env={**env, "PYTHONPATH": str(
        b / "lib/python3.11/site-packages")}).returncode == 0
    # the cached venv itself is left as it was built
    assert (snaps[0] / "venv" / "bin" / "tool").read_text().startswith(f"#!{a}/bin/python\n")
    # a venv that has its wheels is left alone
    assert _run(env, b) == "" and _runs(tmp) == 1


def test_other_install_scripts_build_again(bed):
    """The control: the key covers the install script (and the pins, and python): an edited
    build_env.sh is a new venv, never the old one's copy."""
    tmp, fake, env = bed
    _run(env, tmp / "one" / ".venv")
    fake.write_text(FAKE_BUILD_ENV + "# edited\n")
    _run(env, tmp / "two" / ".venv")
    assert _runs(tmp) == 2
    # only the venv of the current inputs stays (3-6 GB each)
    assert len(list((tmp / "cache" / "venvs").iterdir())) == 1
    fake.write_text(FAKE_BUILD_ENV + "# edited again\n")
    _run(env, tmp / "three" / ".venv")
    assert _runs(tmp) == 3
    fake.write_text(FAKE_BUILD_ENV)  # back to the first inputs: built again, the others removed
    _run(env, tmp / "four" / ".venv")
    assert _runs(tmp) == 4
    (snap,) = (tmp / "cache" / "venvs").iterdir()
    # a copy from the cache removes the others too (a cache that held two before this change),
    # not a build in progress (.partial) nor another base's venvs
    others = ("0.32-0123456789abcdef", "0.32-feedfeedfeedfeed.partial", "0.25-0123456789abcdef")
    for other in others:
        (tmp / "cache" / "venvs" / other / "venv").mkdir(parents=True)
    out = _run(env, tmp / "five" / ".venv")
    assert _runs(tmp) == 4 and "from the cache" in out
    assert "removing the cached venv of other inputs" in out
    assert sorted(p.name for p in (tmp / "cache" / "venvs").iterdir()) == sorted(
        [snap.name, "0.32-feedfeedfeedfeed.partial", "0.25-0123456789abcdef"])


def test_switched_off_it_builds_and_keeps_nothing(bed):
    tmp, _, env = bed
    _run(env, tmp / "one" / ".venv", KVSTACK_VENV_CACHE="0")
    _run(env, tmp / "two" / ".venv", KVSTACK_VENV_CACHE="0")
    assert _runs(tmp) == 2
    assert not (tmp / "cache" / "venvs").exists()


def test_help_and_bad_usage():
    res = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "KVSTACK_VENV_CACHE=0" in res.stdout
    res = subprocess.run(["bash", str(SCRIPT), "--nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown argument --nope" in res.stderr
