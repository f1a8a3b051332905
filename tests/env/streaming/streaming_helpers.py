"""Helpers for the streaming tests: engines with/without the kvstack connector, prompts."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from kvstack.engine import shutdown_llm

ROOT = Path(__file__).resolve().parents[3]
SITE = ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"


def hooks_applied() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except Exception:  # noqa: BLE001
        return False
    return hasattr(KVConnectorBase_V1, "get_kv_paging_window")


# The hooks patch is in the series, so the venv always has it: tests that use the hooks are only
# marked (test_hooks.py::test_hooks_are_applied fails loudly when the patch is missing).
needs_hooks = pytest.mark.streaming_hooks


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tiny_model(name: str) -> Path:
    from kvstack.tiny_models import make_model

    return Path(make_model(name, ROOT / "build" / "tiny-models" / name))


def streaming_transfer_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="StreamingConnector", kv_role="kv_both",
                            kv_connector_module_path="kvstack.streaming",
                            kv_connector_extra_config=extra)


def make_llm(name: str, *, streaming: dict | None = None, **overrides):
    """An LLM for tiny model `name`; with `streaming` (extra config) the kvstack connector."""
    from kvstack.tiny_models import llm_kwargs
    from vllm import LLM

    kw = llm_kwargs(name, tiny_model(name), enable_prefix_caching=False, **overrides)
    if streaming is not None:
        kw["kv_transfer_config"] = streaming_transfer_config(**streaming)
        with env(**{HMA_ENV: "1"}):
            return LLM(**kw)
    with env(**{HMA_ENV: None}):
        return LLM(**kw)


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


close = shutdown_llm


def prompt(n: int, salt: int = 0) -> dict:
    return {"prompt_token_ids": [3 + (i * 7 + salt * 13 + 3) % 1000 for i in range(n)]}


def greedy(max_tokens: int = 8):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def tokens(llm, prompts, max_tokens: int = 8):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(max_tokens),
                                                              use_tqdm=False)]
