"""Host tier under pressure (issue 13): cached prefix pages are hits, not free pages.

A request finishes and leaves its full prompt pages cached; a long request runs; a new request
whose prompt extends the cached prefix arrives. Admission used to count the cached pages both as
free space and as the new request's prefix hit, so with a tier of 10-12 pages the engine raised
HostTierFull out of the scheduler and died. At every tier size each request must either complete
with the tokens it gets alone, or fail alone with "host tier full"; the engine keeps serving.
"""

import pytest

from streaming_helpers import close, greedy, make_llm, needs_hooks, prompt, scheduler_connector, tokens

pytestmark = needs_hooks

PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # page_tokens x (K,V) x kv_heads x head_dim x bf16, 1 layer
# One scheduler step takes both prompts, so both are admitted before either holds its pages.
BUDGET = dict(num_gpu_blocks_override=48, max_num_batched_tokens=256, max_num_seqs=4,
              max_model_len=256)
CACHED = prompt(100, 7)  # leaves 3 full pages cached
LONG = prompt(130, 8)  # 130 + 8 tokens: 5 pages
EXTENDS = {"prompt_token_ids": CACHED["prompt_token_ids"] + prompt(120, 9)["prompt_token_ids"]}  # 8 pages, 3 hit


def tier(pages: int) -> dict:
    return dict(window_tokens=48, page_tokens=32, host_tier_gib=pages * PAGE_BYTES / 2**30)


@pytest.fixture(scope="module")
def reference():
    llm = make_llm("llama4", **BUDGET)  # native vLLM, no connector
    try:
        yield {"long": tokens(llm, [LONG])[0], "extends": tokens(llm, [EXTENDS])[0]}
    finally:
        close(llm)


@pytest.mark.parametrize("pages", [9, 10, 12, 13])
def test_cached_prefix_hit_under_pressure_never_kills_the_engine(reference, pages):
    llm = make_llm("llama4", streaming=tier(pages), **BUDGET)
    try:
        tokens(llm, [CACHED])
        assert scheduler_connector(llm).stats()["cached_pages"] == 3
        outs = llm.generate([LONG, EXTENDS], greedy(8), use_tqdm=False)  # raised here before the fix
        long, ext = (o.outputs[0] for o in outs)
        assert long.finish_reason == "length" and list(long.token_ids) == reference["long"]
        if ext.finish_reason == "error":
            assert "host tier full" in ext.stop_reason and list(ext.token_ids) == []
        else:
            assert list(ext.token_ids) == reference["extends"]
        # 13 pages hold both (5 + 8 - 3 shared); 9 and 10 cannot
        assert ext.finish_reason == ("length" if pages >= 13 else "error")
        st = scheduler_connector(llm).stats()
        assert st["live_requests"] == 0 and st["pages_in_use"] == 0
        # the engine goes on: alone, the extending request is served from the cached prefix
        assert tokens(llm, [EXTENDS]) == [reference["extends"]]
    finally:
        close(llm)
