"""Put on PYTHONPATH of a test's engine process (and so of its engine core process, forked or
spawned): installs $KVSTACK_OVERLAY (kvstack.release.overlay) before vLLM is imported, and, with
$KVSTACK_FAULT_FLAG set, a fault in LMCache's LMCacheEngine.retrieve or in the hybrid state read
from LMCache's storage, armed by that file.

The flag file holds "drop", "raise" or "corrupt"; the next retrieve (drop, raise) or state read
(corrupt) consumes it (one fault per arming):
- drop: removes the last chunk of the retrieve from LMCache's storage (as an eviction between the
  request's lookup and its load would), then retrieves: the load comes back one chunk short;
- raise: raises RuntimeError (a failing backend);
- corrupt: the next hybrid state read from the storage comes back 64 bytes short (a damaged object,
  as a backend could return it; the stored object itself is left intact).
Each fault is appended to $KVSTACK_FAULT_LOG as one line.

With $KVSTACK_ZERO_RESTORED_STATE=1 (a negative control for server tests, where engine_run.py's
--zero-restored-state cannot reach): every hybrid state LMCache's vLLM adapter restores is zeroed
before it is put into the request's state blocks, and a line "zeroed pid=..." goes to stderr. Set
to a file's path instead, states are zeroed only while that file exists (one server, control on
and off).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

if os.environ.get("KVSTACK_OVERLAY") and not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
    try:
        from kvstack.release import overlay

        if not any(type(f).__name__ == "_Finder" for f in sys.meta_path):
            overlay.install()
    except Exception as e:  # the test sees the tokens of an engine without the overlay then
        print(f"sitecustomize: overlay not installed: {e!r}", file=sys.stderr)

FLAG = os.environ.get("KVSTACK_FAULT_FLAG")
LOG = os.environ.get("KVSTACK_FAULT_LOG")
TARGET = "lmcache.v1.cache_engine"
STATE_TARGET = "lmcache.integration.vllm.hybrid_state"
ADAPTER_TARGET = "lmcache.integration.vllm.vllm_v1_adapter"
ZERO = os.environ.get("KVSTACK_ZERO_RESTORED_STATE", "")


def _log(line: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(line + "\n")


def _take_fault(kinds: tuple[str, ...]) -> str | None:
    """The armed fault if it is one of `kinds` (then disarmed), else None."""
    try:
        with open(FLAG) as f:
            fault = f.read().strip()
        if fault not in kinds:
            return None
        os.unlink(FLAG)
    except OSError:
        return None
    return fault or None


def _patch(module) -> None:
    engine_cls = module.LMCacheEngine
    retrieve = engine_cls.retrieve
    if getattr(retrieve, "_kvstack_fault", False):
        return

    def faulty_retrieve(self, tokens, mask=None, **kwargs):
        fault = _take_fault(("drop", "raise"))
        if fault == "raise":
            _log(f"raise pid={os.getpid()} tokens={len(tokens)}")
            raise RuntimeError("kvstack test: injected backend failure")
        if fault == "drop":
            chunks = list(self.token_database.process_tokens(
                tokens, mask=mask, request_configs=kwargs.get("request_configs")))
            start, end, key = chunks[-1][:3]
            removed = self.storage_manager.remove(key)
            _log(f"drop pid={os.getpid()} tokens={len(tokens)} chunk={start}-{end} removed={removed}")
        return retrieve(self, tokens, mask, **kwargs)

    faulty_retrieve._kvstack_fault = True
    engine_cls.retrieve = faulty_retrieve


def _patch_state(module) -> None:
    decode = module.decode_state
    if getattr(decode, "_kvstack_fault", False):
        return

    def damaged_decode(blob, *args, **kwargs):
        if _take_fault(("corrupt",)) == "corrupt":
            _log(f"corrupt pid={os.getpid()} bytes={len(blob)}")
            blob = blob[:-64]
        return decode(blob, *args, **kwargs)

    damaged_decode._kvstack_fault = True
    module.decode_state = damaged_decode


def _patch_adapter(module) -> None:
    scatter = module.scatter_states
    if getattr(scatter, "_kvstack_fault", False):
        return

    def scatter_zeros(caches, layout, blocks, states):
        if ZERO != "1" and not os.path.exists(ZERO):
            return scatter(caches, layout, blocks, states)
        print(f"zeroed pid={os.getpid()}: a restored hybrid state", file=sys.stderr, flush=True)
        return scatter(caches, layout, blocks, {k: [t * 0 for t in v] for k, v in states.items()})

    scatter_zeros._kvstack_fault = True
    module.scatter_states = scatter_zeros


class _Hook(importlib.abc.MetaPathFinder):
    """Patches `target` once it is imported (whoever imports it first)."""

    def __init__(self, target: str, patch):
        self.target, self.patch = target, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if FLAG:
    sys.meta_path.insert(0, _Hook(TARGET, _patch))
    sys.meta_path.insert(0, _Hook(STATE_TARGET, _patch_state))
if ZERO:
    sys.meta_path.insert(0, _Hook(ADAPTER_TARGET, _patch_adapter))
