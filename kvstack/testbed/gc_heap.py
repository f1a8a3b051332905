"""Engine processes of the test bed freeze their import-time heap (`KVSTACK_FREEZE_GC_HEAP=1`).

A vLLM process holds 0.7 million objects the garbage collector tracks once torch, transformers,
vLLM and LMCache are imported, and an engine start runs a full `gc.collect()` five times or more
(model loading twice, the profiling run's cleanup, `freeze_gc_heap`, LMCache's engine): each
traverses all of them. On the 2-core CI machines one such collection took 2 to 5 s, so a tiny
model's engine spent about 10 s of its start in the collector (measured: 5 collections, 10.2 s;
with the heap frozen, 0.7 s). `make test` starts a few hundred engines.

`freeze_imported_heap` is registered as a vLLM general plugin (pyproject.toml), which vLLM loads
once in every process it runs in (`LLM`, `vllm serve`'s API server, the engine core, the workers)
before it builds the engine: with the variable set it moves every object alive then into the
permanent generation (`gc.freeze()`), which later collections skip. Without the variable it does
nothing, so an installed kvstack leaves users' processes alone. The tests set it
(tests/conftest.py); `KVSTACK_FREEZE_GC_HEAP=0` runs them with stock garbage collection.

The imports before it collect too: Python's automatic full collections (generation 2) traverse the
growing heap while torch, transformers and vLLM import, 1.5-2 s of a 7-9 s `from vllm import LLM`
on one core here (4-5 s when this host is slow). `STARTUP_HOOK`, a `.pth` file `make env` writes
into the test venvs (`install_startup_hook`), turns those full collections off at interpreter start
when the variable is set (young generations still collect); the plugin turns them on again when it
freezes, and tests/conftest.py does in the pytest processes. A process with the variable that never
loads vLLM's plugins (an `lmcache_server` a test starts) runs without automatic full collections
until it exits.

What it changes: when garbage is collected, never what an engine computes. Frozen objects are the
modules and what imports made, which live as long as the process anyway; they are thawed at exit,
so the interpreter's last collection sees them. vLLM's own shutdown (`cleanup_dist_env_and_memory`)
unfreezes the heap; `refreeze` (called by kvstack.testbed.engine.shutdown_llm) freezes it again for
the next engine of the same process.
"""

from __future__ import annotations

import atexit
import gc
import os
import sysconfig
from pathlib import Path

SWITCH = "KVSTACK_FREEZE_GC_HEAP"
# Python's own threshold of generation 2; DEFERRED: never reached (a process's allocations net of
# frees would have to pass a billion young collections' worth first)
FULL_THRESHOLD, DEFERRED = 10, 1 << 30
STARTUP_HOOK = "kvstack-gc-heap.pth"
# site.py runs a .pth line that starts with "import"; one line, no kvstack import (every Python
# process of the venv reads it)
HOOK_LINE = (f'import gc, os; os.environ.get("{SWITCH}", "0") not in ("", "0") and '
             f'gc.set_threshold(*gc.get_threshold()[:2], {DEFERRED})\n')


def enabled() -> bool:
    return os.environ.get(SWITCH, "0") not in ("", "0")


def freeze_imported_heap() -> None:
    """vLLM general plugin: with $KVSTACK_FREEZE_GC_HEAP set, freeze what is alive now (and thaw it
    at exit: the interpreter's last collection skips frozen objects, so extension types were left
    alive and nanobind printed "leaked N instances" after a CLI's own error, as its last line)."""
    if enabled():
        gc.freeze()
        atexit.register(gc.unfreeze)
        resume_full_collections()


def refreeze() -> None:
    """After an engine's shutdown in a process that starts another: freeze again what is left."""
    if enabled():
        gc.freeze()


def resume_full_collections() -> None:
    """Turn generation 2's automatic collections on again where the startup hook deferred them."""
    young, middle, full = gc.get_threshold()
    if full == DEFERRED:
        gc.set_threshold(young, middle, FULL_THRESHOLD)


def install_startup_hook(purelib: str | None = None) -> Path:
    """Write STARTUP_HOOK into this interpreter's site-packages (`make env` runs it in each test
    venv; images and users' installs never get it)."""
    path = Path(purelib or sysconfig.get_paths()["purelib"]) / STARTUP_HOOK
    if not path.exists() or path.read_text() != HOOK_LINE:
        path.write_text(HOOK_LINE)
    return path


if __name__ == "__main__":
    print(f"[env] {install_startup_hook()}")
