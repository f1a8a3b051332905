"""What tests/conftest.py sets for every engine process the tests start (docs/testing.md, caches):

- kvstack's vLLM plugin freezes an engine process's import-time heap when the test bed asks for it
  (kvstack.testbed.gc_heap, KVSTACK_FREEZE_GC_HEAP) and does nothing otherwise: vLLM loads its
  general plugins in each process before building the engine, as it does in `vllm serve`;
- the test venv's startup hook defers full collections while such a process imports, until the
  plugin freezes (the pytest processes collect as usual);
- vLLM's cache folder is the base's own, so the two bases' model-class caches do not overwrite
  each other."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kvtest import default_base_only

pytest.importorskip("vllm")

pytestmark = [pytest.mark.env, default_base_only(
    "the test bed's plugin, startup hook and cache folders are the same code for every base's venv "
    "(scripts/build_env.sh installs the hook in each)")]

PROBE = """
import gc, sys
from vllm import LLM  # torch, triton (nanobind), transformers: what an engine process imports
from vllm.plugins import load_general_plugins, load_plugins_by_group
names = sorted(load_plugins_by_group("vllm.general_plugins"))
before = gc.get_freeze_count()
load_general_plugins()
if sys.argv[1:] == ["--no-thaw"]:  # the control: frozen until the end, as without the atexit
    import atexit
    atexit.unregister(gc.unfreeze)
print(names, before, gc.get_freeze_count())
"""


def _probe(switch: str, *args: str) -> tuple[list[str], int, int, str]:
    env = {**os.environ, "KVSTACK_FREEZE_GC_HEAP": switch}
    env.pop("VLLM_PLUGINS", None)  # every installed plugin loads, as for a user
    res = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    names, before, after = res.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    return eval(names), int(before), int(after), res.stderr  # noqa: S307 (our probe's list literal)


def test_the_plugin_freezes_the_heap_only_when_asked_and_thaws_it_at_exit():
    names, before, after, err = _probe("1")
    assert "kvstack_freeze_gc_heap" in names  # registered by kvstack's installed entry points
    assert before == 0 and after > 100_000, (before, after)  # torch + vLLM: hundreds of thousands
    # thawed at exit: the interpreter's last collection frees what it would free without the plugin
    # (frozen, triton's nanobind objects outlived it and a CLI's error was followed by "leaked")
    assert "leaked" not in err, err[-2000:]
    names, before, after, err = _probe("0")  # the control: an installed kvstack left alone
    assert "kvstack_freeze_gc_heap" in names and before == after == 0
    # the control of the thaw (default base: base 0.25's triton has no nanobind bindings, so nothing
    # reports objects left alive there and the "leaked" check could not fail)
    assert "leaked" in _probe("1", "--no-thaw")[3]


def test_shutdown_refreezes_what_vllm_unfroze(monkeypatch):
    import gc

    from kvstack.testbed import gc_heap

    monkeypatch.setenv(gc_heap.SWITCH, "1")
    gc.unfreeze()
    try:
        gc_heap.refreeze()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    monkeypatch.setenv(gc_heap.SWITCH, "0")
    gc_heap.refreeze()
    assert gc.get_freeze_count() == 0


def test_each_base_has_its_own_vllm_cache_folder():
    from kvstack.release.pins import BASE_ENV, cache_dir

    base = os.environ[BASE_ENV]
    probe = "import vllm.envs as e; print(e.VLLM_CACHE_ROOT)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip().splitlines()[-1]
    if "VLLM_CACHE_ROOT" in os.environ and os.environ["VLLM_CACHE_ROOT"] != str(
            cache_dir() / "vllm-cache" / base):
        pytest.skip("VLLM_CACHE_ROOT was set before the tests started: theirs is kept")
    assert out == str(cache_dir() / "vllm-cache" / base)


IMPORT_PROBE = """
import gc
from vllm import LLM
full = gc.get_stats()[2]["collections"]  # generation 2's collections during the imports
from vllm.plugins import load_general_plugins
load_general_plugins()
print(full, gc.get_threshold()[2])
"""


def test_the_startup_hook_defers_full_collections_until_the_freeze():
    from kvstack.testbed.gc_heap import FULL_THRESHOLD, HOOK_LINE, STARTUP_HOOK, SWITCH

    hook = Path(sysconfig.get_paths()["purelib"]) / STARTUP_HOOK
    assert hook.read_text() == HOOK_LINE, f"{hook}: written by `make env`"

    def full_collections(switch: str) -> tuple[int, int]:
        env = {**os.environ, SWITCH: switch}
        env.pop("VLLM_PLUGINS", None)
        out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                             env=env, timeout=300, check=True).stdout.strip().splitlines()[-1]
        return tuple(int(x) for x in out.split())

    # deferred while vLLM imports; Python's own threshold again once the plugin froze the heap
    assert full_collections("1") == (0, FULL_THRESHOLD)
    # the control: without the variable the imports ran full collections over the growing heap
    full, threshold = full_collections("0")
    assert full > 0 and threshold == FULL_THRESHOLD
    # this pytest process (xdist's workers inherit the variable) collects as usual
    assert gc.get_threshold()[2] == FULL_THRESHOLD
