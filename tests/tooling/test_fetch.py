"""scripts/fetch_sources.sh: verified, idempotent, and a tampered sdist is refused with nothing unpacked."""

from __future__ import annotations

import shutil

import pytest

from kvtest import run_script, tree_digest
from kvstack.release.fetch import cached_sdist
from kvstack.release.pins import load_pin

# serial: it unpacks the fetched trees under <component>/src/ afresh (unpatched), which other tests
# read patched (`make test` runs it alone)
pytestmark = pytest.mark.serial


def test_fetch_is_idempotent(pinned_tree):
    tree = pinned_tree("lmcache")
    res = run_script("fetch_sources.sh", "lmcache", check=True)
    assert "nothing to do" in res.stderr
    assert (tree / ".kvstack-fetched").read_text().strip() == load_pin("lmcache").sdist_sha256


def _tampered_copy(tmp_path, component):
    good = cached_sdist(load_pin(component))
    bad = tmp_path / good.name
    shutil.copy(good, bad)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one byte changed
    bad.write_bytes(bytes(data))
    return bad


def test_tampered_local_sdist_is_refused(pinned_tree, tmp_path):
    tree = pinned_tree("lmcache")
    before = tree_digest(tree)
    bad = _tampered_copy(tmp_path, "lmcache")
    res = run_script("fetch_sources.sh", "lmcache", "--sdist", bad, "--force")
    assert res.returncode == 3, res.stderr
    assert "sha256 mismatch" in res.stderr and "nothing was unpacked" in res.stderr
    assert tree_digest(tree) == before


def test_tampered_cached_download_is_refused(pinned_tree, tmp_path):
    tree = pinned_tree("lmcache")
    before = tree_digest(tree)
    cache = tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    bad = _tampered_copy(tmp_path, "lmcache")
    shutil.move(bad, cache / "sdists" / bad.name)
    res = run_script("fetch_sources.sh", "lmcache", "--force", env={"KVSTACK_CACHE": str(cache)})
    assert res.returncode == 3, res.stderr
    assert str(cache / "sdists" / bad.name) in res.stderr
    assert tree_digest(tree) == before


def test_help_documents_exit_codes():
    res = run_script("fetch_sources.sh", "--help", check=True)
    assert "sha256 mismatch" in res.stdout and "Exit codes" in res.stdout
