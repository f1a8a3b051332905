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

What it changes: when garbage is collected, never what an engine computes. Objects frozen are never
collected; they are the modules and what imports made, which live as long as the process anyway.
vLLM's own shutdown (`cleanup_dist_env_and_memory`) unfreezes the heap; `refreeze` (called by
kvstack.testbed.engine.shutdown_llm) freezes it again for the next engine of the same process.
"""

from __future__ import annotations

import atexit
import gc
import os

SWITCH = "KVSTACK_FREEZE_GC_HEAP"


def enabled() -> bool:
    return os.environ.get(SWITCH, "0") not in ("", "0")


def freeze_imported_heap() -> None:
    """vLLM general plugin: with $KVSTACK_FREEZE_GC_HEAP set, freeze what is alive now (and thaw it
    at exit: the interpreter's last collection skips frozen objects, so extension types were left
    alive and nanobind printed "leaked N instances" after a CLI's own error, as its last line)."""
    if enabled():
        gc.freeze()
        atexit.register(gc.unfreeze)


def refreeze() -> None:
    """After an engine's shutdown in a process that starts another: freeze again what is left."""
    if enabled():
        gc.freeze()
