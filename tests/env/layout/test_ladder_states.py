"""The series states the layout tests run on (ladder.state_root, kvstack/release/overlay.py), checked
against the kvstack venv: taking the ladder out and putting it back gives the installed files
byte for byte, both directions of kvstack.release.overlay.build_overlay agree, and the ladder is one
run of patches/vllm/series (every patch of issue 3, nothing else) whose files no later patch
touches."""

from __future__ import annotations

import pytest

import ladder
from ladder import installed_root, overlay, state_root, touched

pytestmark = pytest.mark.env


def ladder_files() -> list[str]:
    return sorted({f for p in ladder.ladder() for f in touched(p) if f.startswith("vllm/")})


def test_the_ladder_is_one_run_of_the_series_and_later_patches_leave_its_files_alone():
    series, steps = ladder.series_patches(), ladder.ladder()
    assert len(steps) == 12  # 2/N: connectors + 9 backends; 3/N; upstream's test they change
    assert touched(steps[-1]) == ["tests/v1/worker/test_gpu_model_runner.py"]
    start = series.index(steps[0])
    assert series[start:start + len(steps)] == steps
    # state_root takes ladder patches out of the installed files: that is only right when no
    # later patch (e.g. 0016, the CLI) changes a file the ladder touches
    files = set(ladder_files())
    for later in series[start + len(steps):]:
        assert not files & set(touched(later)), later.name


def test_the_venv_has_the_whole_ladder():
    assert ladder.ladder_in_venv(), "run `make env`: the kvstack venv carries the whole series"


def test_out_and_back_in_gives_the_installed_files(tmp_path):
    before = state_root(tmp_path / "before", None)
    again = tmp_path / "again"
    overlay.build_overlay(ladder.ladder(), before, again)
    site = installed_root()
    for rel in ladder_files():
        assert (again / rel).read_bytes() == (site / rel).read_bytes(), rel


def test_states_at_the_ends(tmp_path):
    steps = ladder.ladder()
    first_before = state_root(tmp_path / "a", steps[0], include=False)
    nothing = state_root(tmp_path / "b", None)
    last = state_root(tmp_path / "c", steps[-1])  # the tests patch: nothing installed
    site = installed_root()
    for rel in ladder_files():
        assert (first_before / rel).read_bytes() == (nothing / rel).read_bytes(), rel
        assert (last / rel).read_bytes() == (site / rel).read_bytes(), rel
    changed = [rel for rel in ladder_files()
               if (nothing / rel).read_bytes() != (site / rel).read_bytes()]
    assert changed == ladder_files(), "every file the ladder touches differs without it"


def test_a_patch_that_is_not_there_cannot_be_taken_out(tmp_path):
    bad = tmp_path / "0001-bad.patch"
    bad.write_text("--- a/vllm/envs.py\n+++ b/vllm/envs.py\n@@ -1,1 +1,1 @@\n"
                   "-this line is not there\n+x\n")
    with pytest.raises(RuntimeError, match="0001-bad.patch cannot be reversed"):
        overlay.build_overlay([bad], installed_root(), tmp_path / "o", reverse=True)
