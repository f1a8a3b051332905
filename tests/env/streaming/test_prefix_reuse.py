"""Prefix reuse from the host tier (tiny Llama: every attention layer streams, so a reused prefix
needs nothing restored on the device)."""

import time

import pytest

from streaming_helpers import close, make_llm, needs_hooks, prompt, scheduler_connector, tokens

pytestmark = needs_hooks

PREFIX = 448  # 14 pages of 32
SUFFIXES = ([5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])


def with_suffix(suffix):
    return {"prompt_token_ids": prompt(PREFIX, 9)["prompt_token_ids"] + list(suffix)}


@pytest.fixture(scope="module")
def reference():
    llm = make_llm("llama", max_model_len=512)
    try:
        yield tokens(llm, [with_suffix(s) for s in SUFFIXES])
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(reference):
    llm = make_llm("llama", streaming=dict(window_tokens=64, page_tokens=32, host_tier_gib=0.05),
                   max_model_len=512)
    yield llm
    close(llm)


def test_connector_without_hooks_unchanged_on_patched_vllm(reference, tmp_path):
    """vLLM's ExampleConnector (no streaming hooks) on the patched vLLM: same tokens as native,
    and every layer keeps its full-attention KV spec. (First in this module: in-process engines
    share one process-wide connector, so it must run before the streaming engine starts.)"""
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    llm = make_llm("llama", max_model_len=512, kv_transfer_config=ktc)
    try:
        cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        assert all(type(g.kv_cache_spec) is FullAttentionSpec for g in cfg.kv_cache_groups)
        assert tokens(llm, [with_suffix(s) for s in SUFFIXES]) == reference
    finally:
        close(llm)

def test_second_request_hits_host_tier(streaming, reference):
    conn = scheduler_connector(streaming)
    assert conn.stats()["prefix_hit_tokens"] == 0
    t0 = time.perf_counter()
    cold = tokens(streaming, [with_suffix(SUFFIXES[0])])
    t_cold = time.perf_counter() - t0
    assert cold == [reference[0]]
    assert conn.stats()["prefix_hit_tokens"] == 0
    t0 = time.perf_counter()
    warm = tokens(streaming, [with_suffix(SUFFIXES[1])])
    t_warm = time.perf_counter() - t0
    st = conn.stats()
    assert warm == [reference[1]]
    assert st["prefix_hit_requests"] == 1 and st["prefix_hit_tokens"] == PREFIX
    print(f"cold {t_cold * 1e3:.0f} ms, prefix hit {t_warm * 1e3:.0f} ms")
    # the same prompt again hits all its full pages but the last token is always recomputed
    again = tokens(streaming, [with_suffix(SUFFIXES[1])])
    assert again == [reference[1]]
    assert conn.stats()["prefix_hit_tokens"] == 2 * PREFIX
    assert conn.stats()["pages_in_use"] == 0  # kept pages are cached, not held

