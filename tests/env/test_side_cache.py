"""kvstack.testbed.side_cache, the family table's stock side reused while nothing it read changed:
a cached run comes back only for the same inputs and while every repository file it imported is
unchanged; an edit of one of them, or of a tree it was keyed on, runs the side again."""

from __future__ import annotations

import pytest

from kvstack.testbed import side_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTACK_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _inputs(tree, **extra):
    return side_cache.fixed_inputs(what="test", cells=[("llama", "none")], trees={"t": tree},
                                   extra=extra)


def test_a_run_comes_back_while_its_inputs_and_sources_are_unchanged(cache, monkeypatch):
    tree = cache / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("x = 1\n")
    src = cache / "repo" / "kvstack" / "mod.py"
    src.parent.mkdir(parents=True)
    src.write_text("y = 1\n")
    monkeypatch.setattr(side_cache, "REPO", cache / "repo")
    inputs = _inputs(tree)
    key = side_cache.key_of(inputs)
    assert side_cache.load(key) is None
    side_cache.store(key, inputs, [{"model": "llama", "tokens": [1, 2]}], ["kvstack/mod.py"])
    results, entry = side_cache.load(key)
    assert results == [{"model": "llama", "tokens": [1, 2]}]
    assert list(entry["sources"]) == ["kvstack/mod.py"]
    # bytecode next to a tree's files is not an input
    (tree / "__pycache__").mkdir()
    (tree / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert side_cache.key_of(_inputs(tree)) == key

    # the control: an imported file edited -> run again
    src.write_text("y = 2\n")
    assert side_cache.load(key) is None
    src.write_text("y = 1\n")
    assert side_cache.load(key) is not None
    src.unlink()  # gone
    assert side_cache.load(key) is None


@pytest.mark.parametrize("change", ["tree file", "new file", "cells", "env", "extra"])
def test_any_fixed_input_changes_the_key(cache, monkeypatch, change):
    tree = cache / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("x = 1\n")
    key = side_cache.key_of(_inputs(tree))
    if change == "tree file":
        (tree / "a.py").write_text("x = 2\n")
    elif change == "new file":
        (tree / "b.json").write_text("{}")
    elif change == "cells":
        changed = side_cache.fixed_inputs(what="test", cells=[("llama", "lmcache")],
                                          trees={"t": tree})
        assert side_cache.key_of(changed) != key
        return
    elif change == "env":
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert side_cache.key_of(_inputs(tree, **({"base": "x"} if change == "extra" else {}))) != key


def test_per_run_values_are_not_inputs(cache, monkeypatch):
    tree = cache / "tree"
    tree.mkdir()
    key = side_cache.key_of(_inputs(tree))
    monkeypatch.setenv("KVSTACK_FAMILY_MP_PORTS", '{"32": 41234}')
    monkeypatch.setenv("KVSTACK_OVERLAY", "/tmp/somewhere")
    monkeypatch.setenv("KVSTACK_STOCK_CACHE", "0")
    assert side_cache.key_of(_inputs(tree)) == key
    assert not side_cache.enabled()


def test_the_host_cpu_and_the_installed_distributions_are_inputs(cache):
    inputs = _inputs(cache)
    assert "flags" not in inputs["cpu"] and "|" in inputs["cpu"]  # model name | flags
    assert any(d.startswith("pytest==") for d in inputs["distributions"])
    assert inputs["cores"] >= 1


def test_only_the_newest_entries_stay(cache):
    for i in range(4):
        side_cache.store(str(i) * 64, {}, [], [], keep=2)
    left = sorted(p.name for p in side_cache.cache_dir().glob("*.json"))
    assert len(left) == 2


def test_an_entry_without_sources_is_never_reused(cache):
    key = "f" * 64
    side_cache.store(key, {}, [{"model": "m"}], [])
    assert side_cache.load(key) is None


def test_imported_sources_are_the_repositorys_own_modules():
    import kvstack.testbed.side_cache  # noqa: F401 (imported: listed)

    found = side_cache.imported_sources()
    assert "kvstack/testbed/side_cache.py" in found
    # not the venv inside the checkout, nor a module whose __file__ is relative
    assert not [f for f in found if f.startswith((".", "build/", "vllm/", "lmcache/"))], found
    assert all("/" in f for f in found), found


def test_distributions_do_not_follow_sys_path(monkeypatch):
    """An import that puts more on sys.path (setuptools' vendored packages) changes no key: the
    key of a CI worker must not depend on which tests ran before in it."""
    from pathlib import Path

    import setuptools

    before = side_cache.distributions()
    vendored = list(Path(setuptools.__file__).parent.glob("_vendor"))
    for p in vendored:
        monkeypatch.syspath_prepend(str(p))
    assert side_cache.distributions() == before
