"""Acceptance: on a tree of another vLLM release the stack is refused, naming the failing patch,
and the tree stays byte-identical. Uses the real vLLM 0.26.0 sdist (downloaded once, cached)."""

from __future__ import annotations

import difflib
import shutil

import pytest

from kvtest import make_patch, run_script, tree_digest
from kvstack.release.fetch import download_sdist, extract_sdist
from kvstack.release.patchstack import read_series
from kvstack.release.pins import cache_dir, load_pin

OTHER = "0.26.0"


@pytest.fixture(scope="module")
def other_tree(tmp_path_factory):
    sdist = download_sdist("vllm", OTHER, cache_dir() / "sdists")
    tree = tmp_path_factory.mktemp("other") / f"vllm-{OTHER}"
    extract_sdist(sdist, tree)
    return tree


def _conflicting_fixture(tmp_path, pinned, other):
    """A patch against 0.25.1 whose context changed in the other release."""
    for path in sorted((pinned / "vllm/v1/core").glob("*.py")):
        rel = str(path.relative_to(pinned))
        new_lines = set((other / rel).read_text().splitlines()) if (other / rel).exists() else set()
        for line in path.read_text().splitlines():
            if len(line.strip()) > 30 and line not in new_lines:
                return make_patch(tmp_path, rel, line + "\n", line + "  # kvstack fixture\n",
                                  f"fixture: touch {rel}", pinned)
    pytest.fail("no line of vllm/v1/core differs between the releases")


def test_stack_on_another_release_fails_and_leaves_tree_identical(other_tree, pinned_tree, tmp_path):
    pinned = pinned_tree("vllm")
    series = tmp_path / "series-dir"
    series.mkdir()
    names = []
    for patch in read_series(load_pin("vllm").series_dir):
        shutil.copy(patch, series / patch.name)
        names.append(patch.name)
    (series / "9999-fixture.patch").write_text(_conflicting_fixture(tmp_path, pinned, other_tree))
    names.append("9999-fixture.patch")
    (series / "series").write_text("\n".join(names) + "\n")

    before = tree_digest(other_tree)
    for extra in (["--check"], []):
        # --any-version: try the series on a release no base covers (without it: exit 3, below)
        res = run_script("apply_patches.sh", *extra, "--target", other_tree, "--component", "vllm",
                         "--series-dir", series, "--base", load_pin("vllm").base, "--any-version")
        assert res.returncode == 1, res.stdout + res.stderr
        failing = [ln for ln in res.stdout.splitlines() if ": fails" in ln]
        assert failing, res.stdout
        assert "does not apply; nothing was changed" in res.stderr
        assert len(res.stdout.splitlines()) == 1 + len(names), "one line per patch"
    after = tree_digest(other_tree)
    assert after == before, "\n".join(difflib.unified_diff(sorted(before), sorted(after)))


def test_version_mismatch_alone_is_refused(other_tree):
    # A release no base covers: exit 3 before any patch is tried, naming the bases; untouched.
    before = tree_digest(other_tree)
    res = run_script("apply_patches.sh", "--target", other_tree, "--component", "vllm")
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"vllm {OTHER}: no base covers it" in res.stderr
    assert "0.25 (vLLM 0.25.1 + LMCache 0.5.3)" in res.stderr and "0.32 (vLLM 0.32.0" in res.stderr
    assert ": applies" not in res.stdout and ": fails" not in res.stdout, "nothing is tried"
    assert tree_digest(other_tree) == before


def test_named_base_of_other_versions_is_refused(other_tree):
    before = tree_digest(other_tree)
    res = run_script("apply_patches.sh", "--target", other_tree, "--component", "vllm", "--base", "0.25")
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"the target holds vllm {OTHER}; base 0.25" in res.stderr and "pins vllm 0.25.1" in res.stderr
    assert tree_digest(other_tree) == before
