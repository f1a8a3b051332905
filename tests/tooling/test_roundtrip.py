"""The lossless round trip: import a series into a git work tree, export it back, byte-identical."""

from __future__ import annotations

import filecmp
import subprocess

import pytest

from kvtest import make_patch, run_script
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, base_names, load_pin


def _roundtrip(component, series_dir, tmp_path, base=None):
    work = tmp_path / f"{component}-work"
    env = {"KVSTACK_BASE": base} if base else None  # the pristine sdist of that base
    run_script("import_patches.sh", component, work, "--series-dir", series_dir, check=True, env=env)
    out = tmp_path / f"{component}-out"
    out.mkdir()
    (out / "series").write_text((series_dir / "series").read_text())  # keeps the comment header
    run_script("export_patches.sh", component, work, "--series-dir", out, check=True, env=env)
    return work, out


def assert_same_dir(a, b):
    names_a = sorted(p.name for p in a.iterdir())
    names_b = sorted(p.name for p in b.iterdir())
    assert names_a == names_b
    for name in names_a:
        assert filecmp.cmp(a / name, b / name, shallow=False), f"{name} differs after the round trip"


@pytest.mark.parametrize("base", base_names())
@pytest.mark.parametrize("component", COMPONENTS)
def test_real_series_round_trips_byte_identical(component, base, tmp_path):
    series_dir = load_pin(component, base).series_dir
    _, out = _roundtrip(component, series_dir, tmp_path, base)
    assert_same_dir(series_dir, out)


def test_fixture_series_round_trips_and_edits_export(pinned_tree, tmp_path):
    src = pinned_tree("lmcache")
    fixture = tmp_path / "fixture"
    fixture.mkdir()
    texts = {
        "0001-first.patch": make_patch(tmp_path, "lmcache/__init__.py", "\n", "\n# kvstack one\n", "first", src),
    }
    # Canonical form: what export writes. Import the hand-made patch once, export, then round trip that.
    (fixture / "0001-first.patch").write_text(texts["0001-first.patch"])
    (fixture / "series").write_text("# fixture series\n0001-first.patch\n")
    work, canonical = _roundtrip("lmcache", fixture, tmp_path / "a")
    _, again = _roundtrip("lmcache", canonical, tmp_path / "b")
    assert_same_dir(canonical, again)

    # A developer commits a second change in the work tree; export adds it to the series in order.
    init = work / "lmcache" / "__init__.py"
    init.write_text(init.read_text() + "# kvstack two\n")
    git = ["git", "-c", "user.name=dev", "-c", "user.email=dev@localhost"]
    subprocess.run([*git, "commit", "-qam", "second change"], cwd=work, check=True)
    run_script("export_patches.sh", "lmcache", work, "--series-dir", canonical, check=True)
    assert [p.name for p in read_series(canonical)] == ["0001-first.patch", "0002-second-change.patch"]
    assert (canonical / "series").read_text().startswith("# fixture series\n")
