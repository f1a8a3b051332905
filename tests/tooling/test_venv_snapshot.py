"""kvstack.testbed.venv_snapshot: the venvs the install tests build from the package index, built once
per hash of their inputs and copied for each run (scripts/venv_copy.sh rewrites the copy's own path).
A stand-in build lays out a venv the way `python -m venv` + pip do and counts its runs: the cache is
what these tests pin, not pip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.testbed import venv_snapshot

REPO = Path(__file__).resolve().parents[2]


class FakeBuild:
    def __init__(self):
        self.runs = 0

    def __call__(self, v: Path) -> None:
        self.runs += 1
        (v / "bin").mkdir(parents=True)
        (v / "lib" / "pkg").mkdir(parents=True)
        (v / "bin" / "python").symlink_to(sys.executable)
        (v / "bin" / "tool").write_text(f"#!{v}/bin/python\nimport sys\nprint(sys.argv[0])\n")
        (v / "bin" / "tool").chmod(0o755)
        (v / "bin" / "activate").write_text(f'VIRTUAL_ENV="{v}"\n')
        (v / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {v}\n")
        (v / "lib" / "pkg" / "data.txt").write_text(f"built at {v}\n")  # not a path a venv rewrites


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(venv_snapshot.SWITCH, raising=False)
    return tmp_path / "cache" / "venvs"


def test_built_once_then_copied_with_its_own_path(tmp_path, cache):
    build, inputs = FakeBuild(), ["install commands", REPO / "vllm" / "0.32.env"]
    a, b = tmp_path / "a" / "venv", tmp_path / "b" / "venv"
    line = venv_snapshot.provide(a, "what", inputs, build)
    assert build.runs == 1 and "built" in line and "kept in" in line
    line = venv_snapshot.provide(b, "what", inputs, build)
    assert build.runs == 1, "the second venv was built again instead of copied"
    assert "copied from" in line
    assert (b / "bin" / "tool").read_text().startswith(f"#!{b}/bin/python\n")
    assert (b / "bin" / "activate").read_text() == f'VIRTUAL_ENV="{b}"\n'
    assert str(b) in (b / "pyvenv.cfg").read_text() and str(a) not in (b / "pyvenv.cfg").read_text()
    assert (b / "lib" / "pkg" / "data.txt").read_text() == f"built at {a}\n"  # site-packages as built
    assert not list(b.parent.glob("*.partial"))
    assert subprocess.run([str(b / "bin" / "tool")], capture_output=True, text=True).stdout.strip() == \
        str(b / "bin" / "tool")
    # what a test does to its copy stays in its copy
    (b / "lib" / "pkg" / "data.txt").write_text("patched\n")
    (snap,) = cache.iterdir()
    assert (snap / "venv" / "lib" / "pkg" / "data.txt").read_text() == f"built at {a}\n"
    c = tmp_path / "c" / "venv"
    venv_snapshot.provide(c, "what", inputs, build)
    assert (c / "lib" / "pkg" / "data.txt").read_text() == f"built at {a}\n" and build.runs == 1


def test_another_input_builds_again_and_only_the_current_stays(tmp_path, cache):
    """The control: a changed input file (or command, or name) is a new venv, never the old one's copy."""
    build = FakeBuild()
    pins = tmp_path / "pins.env"
    pins.write_text("VERSION=1\n")
    venv_snapshot.provide(tmp_path / "1", "what", ["cmd", pins], build)
    pins.write_text("VERSION=2\n")
    venv_snapshot.provide(tmp_path / "2", "what", ["cmd", pins], build)
    assert build.runs == 2
    venv_snapshot.provide(tmp_path / "3", "what", ["other cmd", pins], build)
    venv_snapshot.provide(tmp_path / "4", "other", ["other cmd", pins], build)
    assert build.runs == 4
    assert len(list(cache.glob("what-*"))) == 1 and len(list(cache.glob("other-*"))) == 1
    # a copy from the cache removes the others of its `what` too, not a build in progress nor a
    # longer name that starts like it
    others = ("what-0123456789abcdef", "what-feedfeedfeedfeed.partial", "what-0.32-0123456789abcdef")
    for name in others:
        (cache / name / "venv").mkdir(parents=True)
    line = venv_snapshot.provide(tmp_path / "5", "what", ["other cmd", pins], build)
    assert build.runs == 4 and "copied from" in line
    current = f"what-{venv_snapshot.key_of('what', ['other cmd', pins])}"
    assert sorted(p.name for p in cache.glob("what-*")) == sorted([current, *others[1:]])
    assert venv_snapshot.key_of("what", ["cmd", pins]) != venv_snapshot.key_of("what", ["cmd2", pins])


def test_a_failed_build_keeps_nothing(tmp_path, cache):
    def broken(v: Path) -> None:
        FakeBuild()(v)
        raise AssertionError("pip failed")

    with pytest.raises(AssertionError, match="pip failed"):
        venv_snapshot.provide(tmp_path / "v", "what", ["cmd"], broken)
    assert not cache.exists() or not list(cache.iterdir())


def test_switched_off_it_builds_and_keeps_nothing(tmp_path, cache, monkeypatch):
    monkeypatch.setenv(venv_snapshot.SWITCH, "0")
    build = FakeBuild()
    venv_snapshot.provide(tmp_path / "1", "what", ["cmd"], build)
    line = venv_snapshot.provide(tmp_path / "2", "what", ["cmd"], build)
    assert build.runs == 2 and "not kept" in line
    assert not cache.exists()


def test_copy_script_help_and_bad_usage(tmp_path):
    script = REPO / "scripts" / "venv_copy.sh"
    res = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "SRC DEST [ORIGIN]" in res.stdout
    res = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr
    res = subprocess.run(["bash", str(script), str(tmp_path), str(tmp_path / "x")], capture_output=True, text=True)
    assert res.returncode == 2 and "not a venv" in res.stderr and not (tmp_path / "x").exists()


def test_the_key_does_not_depend_on_which_venv_asks(tmp_path):
    """The install tests run from each checkout's own .venv: the key names the base interpreter
    (what the new venv runs on), so a fresh clone's run finds what another clone's run kept. The
    control: another input gives another key from the same venv."""
    other = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    code = ("import sys; from kvstack.testbed import venv_snapshot as s; "
            "print(s.key_of('what', sys.argv[1:]))")
    res = subprocess.run([str(other / "bin" / "python"), "-c", code, "cmd"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    assert res.stdout.strip() == venv_snapshot.key_of("what", ["cmd"])
    assert venv_snapshot.key_of("what", ["cmd2"]) != venv_snapshot.key_of("what", ["cmd"])


def test_the_key_does_not_depend_on_where_the_checkout_is(tmp_path):
    """A file input counts by its bytes and its path in the checkout, not by the clone's location: a
    fresh clone elsewhere finds what another kept. Two checkouts' copies of the same file (here: two
    folders standing in for them) give one key; the control: changed bytes give another."""
    a, b = tmp_path / "clone-a" / "vllm", tmp_path / "clone-b" / "vllm"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "0.32.env").write_text("VERSION=0.32.0\n")
    assert venv_snapshot.key_of("what", [a / "0.32.env"]) == venv_snapshot.key_of("what", [b / "0.32.env"])
    (b / "0.32.env").write_text("VERSION=0.32.1\n")
    assert venv_snapshot.key_of("what", [a / "0.32.env"]) != venv_snapshot.key_of("what", [b / "0.32.env"])
    # a file of this checkout counts by its path in it
    assert venv_snapshot._name(REPO / "vllm" / "0.32.env") == "vllm/0.32.env"
