"""Helpers around an in-process vLLM engine (`vllm.LLM`) shared by the demo, tests and benches."""

from __future__ import annotations

import contextlib
import gc
import time


def shutdown_llm(llm) -> None:
    """Stop an in-process engine and free what it holds before the next one starts.

    Stops the engine core, collects the garbage (its KV cache: a GiB at VLLM_CPU_KVCACHE_SPACE=1),
    clears the process-wide KV connector an in-process engine leaves behind, and tears down the
    distributed state, so another engine (with another connector) can start in the same process;
    with $KVSTACK_FREEZE_GC_HEAP set, freezes the heap again (kvstack.testbed.gc_heap).
    """
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from kvstack.testbed.gc_heap import refreeze

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()  # unfreezes the heap (vLLM) and collects
    refreeze()


def reset_prefix_cache(llm, tries: int = 50) -> bool:
    """Reset vLLM's own prefix cache of an in-process `LLM`; True when it was reset.

    A connector that saves asynchronously keeps a finished request's blocks until the worker
    reports the store done, which the scheduler takes in only at its next step; generate()
    returns before that, so reset_prefix_cache refuses ("some blocks are not freed yet") and a
    repeat would hit vLLM's own cache, not the connector's. An engine step with no new request
    lets the scheduler free them."""
    for _ in range(tries):
        if llm.reset_prefix_cache():
            return True
        llm.llm_engine.step()
        time.sleep(0.1)
    return False


def failure_reason(output: str) -> str:
    """The line of an engine process's output that says why it failed: its JSON `{"error": ...}`
    line (what the benches' engine processes print), else the last line naming an error."""
    import json

    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("{") and '"error"' in ln:
            return json.loads(ln)["error"]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


@contextlib.contextmanager
def track_peak_device_blocks(llm):
    """Within the block, the peak number of device KV cache blocks in use after each scheduler
    step of the in-process engine `llm` (yields a one-item list, updated as it runs)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1  # the null block is never free
    peak = [0]
    orig = sched.schedule

    def schedule(*args, **kwargs):
        out = orig(*args, **kwargs)
        peak[0] = max(peak[0], usable - pool.get_num_free_blocks())
        return out

    sched.schedule = schedule
    try:
        yield peak
    finally:
        sched.schedule = orig
