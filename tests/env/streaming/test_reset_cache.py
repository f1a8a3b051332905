"""The StreamingConnector's `reset_cache` (issue 28): after vLLM's reset_prefix_cache with the
connector (a weight update in an RL loop, sleep/wake, an operator's reset), no prefix computed
before it is reused.

Tiny Llama, every layer streamed, prefix reuse on. Prompt P is served; then the model's weights
change (its token embeddings perturbed in place, so every K/V of P's pages is stale). The control:
an extension of P sent now, without a reset, hits P's stale pages and its tokens differ from a
recompute with the new weights. After `reset_prefix_cache(reset_connector=True)` the same extension
hits nothing (the host tier dropped its cached pages, the hashes are reseeded) and gives the tokens
of a recompute; a repeat after that hits the pages computed after the reset, with the same tokens.
"""

import pytest

from streaming_helpers import close, make_llm, needs_hooks, prompt, scheduler_connector, tokens

pytestmark = needs_hooks

PREFIX = 448  # 14 pages of 32
P = prompt(PREFIX, 21)
EXT = {"prompt_token_ids": P["prompt_token_ids"] + [5, 6, 7, 8, 9, 10, 11, 12, 13]}


def _mutate(llm):
    def perturb(model):
        # the embeddings (the CPU engine repacks linear weights at load, so those are not
        # mutable in place): every layer's K/V of a prompt changes
        import torch

        w = model.model.embed_tokens.weight
        gen = torch.Generator().manual_seed(7)
        w.data.add_(torch.randn(w.shape, generator=gen).to(w.dtype) * w.float().std().item())
        return True

    assert llm.apply_model(perturb) == [True]


@pytest.fixture(scope="module")
def mutated_reference():
    """EXT recomputed by a plain engine (no connector) with the mutated weights."""
    llm = make_llm("llama", max_model_len=512)
    try:
        before = tokens(llm, [EXT])
        _mutate(llm)
        after = tokens(llm, [EXT])
        assert after != before, "the mutation does not change the output: no power"
        yield after
    finally:
        close(llm)


def test_reset_cache_drops_every_cached_prefix(mutated_reference):
    llm = make_llm("llama", streaming=dict(window_tokens=64, page_tokens=32, host_tier_gib=0.05),
                   max_model_len=512)
    try:
        conn = scheduler_connector(llm)
        tokens(llm, [P])  # P's pages cached, computed with the old weights
        _mutate(llm)
        hits = conn.stats()["prefix_hit_tokens"]
        stale = tokens(llm, [EXT])  # the control: no reset, the stale pages are hit
        assert conn.stats()["prefix_hit_tokens"] - hits == PREFIX
        assert stale != mutated_reference, "stale K/V gave the recompute's tokens: no power"

        cached = conn.stats()["cached_pages"]
        assert cached > 0
        assert llm.reset_prefix_cache(reset_connector=True) is not False
        st = conn.stats()
        assert st["cache_resets"] == 1 and st["reset_dropped_pages"] == cached
        assert st["cached_pages"] == 0 and st["pages_in_use"] == 0

        hits = st["prefix_hit_tokens"]
        fresh = tokens(llm, [EXT])
        assert conn.stats()["prefix_hit_tokens"] == hits  # nothing from before the reset
        assert fresh == mutated_reference
        again = tokens(llm, [EXT])  # pages computed after the reset are reused as usual
        assert conn.stats()["prefix_hit_tokens"] > hits
        assert again == mutated_reference
    finally:
        close(llm)


def test_pool_reset_keeps_running_requests_pages():
    from kvstack.streaming.host_tier import PagePool, page_hashes

    pool = PagePool(8, 4)
    h = page_hashes(list(range(16)), 4)
    pool.start("done", h, 0)
    pool.ensure("done", 16)
    pool.register_full_pages("done", h, 16)
    pool.finish("done")  # 4 cached pages
    pool.start("live", h, 2)  # shares 2 of them
    pool.ensure("live", 12)
    assert pool.num_cached() == 2 and pool.match_prefix(h) == 4
    assert pool.reset_cache() == 2
    assert pool.num_cached() == 0 and pool.match_prefix(h) == 0
    assert len(pool.pages("live")) == 3 and pool.num_available() == 5
    pool.register_full_pages("live", h, 12)  # its third page was computed before the reset ...
    assert pool.match_prefix(h) == 0  # ... and is not published
    pool.finish("live")
    assert pool.num_available() == 8 and pool.stats.cache_resets == 1
