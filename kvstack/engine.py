"""Helpers around an in-process vLLM engine (`vllm.LLM`) shared by the demo, tests and benches."""

from __future__ import annotations

import contextlib
import gc


def shutdown_llm(llm) -> None:
    """Stop an in-process engine and free what it holds before the next one starts.

    Stops the engine core, collects the garbage (its KV cache: a GiB at VLLM_CPU_KVCACHE_SPACE=1),
    clears the process-wide KV connector an in-process engine leaves behind, and tears down the
    distributed state, so another engine (with another connector) can start in the same process.
    """
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
