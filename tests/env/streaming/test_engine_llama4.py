"""End to end on the CPU engine with the tiny Llama-4 (3 chunked-local layers + 1 NoPE layer).

With a device KV budget too small for the prompt under upstream vLLM, kvstack streams the NoPE
layer from its host tier and produces the greedy tokens of a native run given enough memory."""

import subprocess
import sys
import textwrap

import pytest

from streaming_helpers import (ROOT, close, make_llm, needs_hooks, prompt, request_refused_errors,
                               scheduler_connector, tokens)

pytestmark = needs_hooks

MAX_LEN = 1024
LONG = 700  # 22 blocks of 32 for a full-attention layer
MIXED = [300, 45, 700, 130]
# Device budget: 16 blocks of 32 tokens in all (kvstack shares them between its four one-layer
# groups: 16 x 8 KiB). Upstream needs 32 blocks per layer for one request of MAX_LEN.
BUDGET = dict(num_gpu_blocks_override=16, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=MAX_LEN)
PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # page_tokens x (K,V) x kv_heads x head_dim x bf16, 1 layer
TIER_PAGES = 32  # 1024 tokens = MAX_LEN: 300- and 700-token requests cannot be in it together
STREAMING = dict(window_tokens=48, page_tokens=32, host_tier_gib=TIER_PAGES * PAGE_BYTES / 2**30,
                 on_host_tier_full="wait")  # concurrent requests queue for the tier (default: fail)


@pytest.fixture(scope="module")
def reference():
    """Native vLLM (no connector, upstream defaults) with enough device memory."""
    llm = make_llm("llama4", max_model_len=MAX_LEN)
    try:
        yield {"long": tokens(llm, [prompt(LONG)]),
               "mixed": tokens(llm, [prompt(n, i) for i, n in enumerate(MIXED)])}
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(reference):
    llm = make_llm("llama4", streaming=STREAMING, **BUDGET)
    yield llm
    close(llm)


def test_upstream_refuses_the_budget():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests' / 'env' / 'streaming')!r})
        from kvstack.testbed import tiny_models
        tiny_models.apply_engine_env()
        from streaming_helpers import make_llm
        try:
            make_llm("llama4", **{BUDGET!r})
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
        else:
            print("STARTED")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert "REFUSED" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "KV cache is needed" in r.stdout


def test_device_kv_is_bounded(streaming):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    cfg = streaming.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    assert cfg.num_blocks == 16
    specs = {n: g.kv_cache_spec for g in cfg.kv_cache_groups for n in g.layer_names}
    assert isinstance(specs["model.layers.3.self_attn.attn"], SlidingWindowSpec)
    assert specs["model.layers.3.self_attn.attn"].sliding_window == 1
    assert all(isinstance(specs[f"model.layers.{i}.self_attn.attn"], ChunkedLocalAttentionSpec)
               for i in range(3))


def test_long_prompt_matches_native(streaming, reference):
    assert -(-(LONG + 8) // 32) > 16  # more blocks than the whole device budget
    assert tokens(streaming, [prompt(LONG)]) == reference["long"]
    st = scheduler_connector(streaming).stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0


def test_concurrent_requests_match_native(streaming, reference):
    before = scheduler_connector(streaming).stats()
    got = tokens(streaming, [prompt(n, i) for i, n in enumerate(MIXED)])
    assert got == reference["mixed"]
    st = scheduler_connector(streaming).stats()
    # the tier could not hold all four at once: one waited for space, none failed
    assert st["waited_for_space"] > before["waited_for_space"]
    assert st["max_pages_in_use"] <= st["pages_total"] == TIER_PAGES
    assert st["pages_in_use"] == 0


def test_request_larger_than_tier_refused_up_front_engine_keeps_serving(streaming, reference):
    st = scheduler_connector(streaming).stats()
    assert st["capacity_tokens"] >= MAX_LEN  # checked at startup: any admissible request fits
    with pytest.raises(request_refused_errors(),
                       match="longer than the maximum model length|max_model_len|maximum"):
        tokens(streaming, [prompt(st["capacity_tokens"] + 64)])
    assert tokens(streaming, [prompt(LONG)]) == reference["long"]


def test_finished_requests_free_host_memory(streaming):
    conn = scheduler_connector(streaming)
    for i in range(6):
        tokens(streaming, [prompt(200 + 50 * i, 100 + i), prompt(90, 200 + i)], max_tokens=4)
    st = conn.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0
    # pages of full prompt pages stay cached for reuse (evictable), all others are freed
    assert st["cached_pages"] + st["pages_in_use"] <= st["pages_total"]
    assert st["allocated_pages"] == st["freed_pages"] + st["cached_pages"] + st["evicted_pages"]


def test_prefix_reuse_at_chunk_boundaries(streaming, reference):
    """Llama-4: a reused prefix (whole pages of 32 = the local chunk) needs only the NoPE
    layer's history, which is in the host tier; the chunked-local layers start a new chunk."""
    conn = scheduler_connector(streaming)
    tokens(streaming, [prompt(LONG)])  # make sure the prompt's pages are cached
    before = conn.stats()["prefix_hit_tokens"]
    assert tokens(streaming, [prompt(LONG)]) == reference["long"]
    assert conn.stats()["prefix_hit_tokens"] - before == (LONG - 1) // 32 * 32
