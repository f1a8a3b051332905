"""Host tier full (default policy "fail"): the request the tier cannot hold now finishes at once
with finish reason "error" and the reason as its stop reason; the engine keeps serving the others
(tiny Llama-4 on the CPU engine; same budget and tier as test_engine_llama4.py)."""

import pytest

from streaming_helpers import close, greedy, make_llm, needs_hooks, prompt, scheduler_connector, tokens

pytestmark = needs_hooks

PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # page_tokens x (K,V) x kv_heads x head_dim x bf16, 1 layer
TIER = dict(window_tokens=48, page_tokens=32, host_tier_gib=32 * PAGE_BYTES / 2**30)  # 32 pages
BUDGET = dict(num_gpu_blocks_override=16, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=1024)


@pytest.fixture(scope="module")
def llm():
    engine = make_llm("llama4", streaming=TIER, **BUDGET)
    yield engine
    close(engine)


def test_host_tier_full_fails_that_request_engine_keeps_serving(llm):
    # 700 tokens + 8 new hold 23 of the 32 pages; the 300-token request needs 10 more.
    outs = llm.generate([prompt(700), prompt(300, 5)], greedy(8), use_tqdm=False)
    first, second = (o.outputs[0] for o in outs)
    assert first.finish_reason == "length" and len(first.token_ids) == 8
    assert second.finish_reason == "error" and list(second.token_ids) == []
    assert "host tier full" in second.stop_reason
    assert "raise host_tier_gib" in second.stop_reason
    st = scheduler_connector(llm).stats()
    assert st["failed_host_tier_full"] == 1
    assert st["live_requests"] == 0 and st["pages_in_use"] == 0
    # the engine goes on: served alone, both get the tokens the first one got in company
    assert tokens(llm, [prompt(700)]) == [list(first.token_ids)]
    assert len(tokens(llm, [prompt(300, 5)])[0]) == 8
    assert scheduler_connector(llm).stats()["failed_host_tier_full"] == 1


@pytest.mark.parametrize("policy", ["wait", "fail"])
def test_prompt_logprobs_request_under_a_nearly_full_tier(policy):
    """A prompt_logprobs request (vLLM reads no prefix hit for it) whose prompt shares 20 pages
    with a running request that holds most of the tier: admitted as the request it will be, with
    no hit. It waits ("wait") or fails alone ("fail"); before, it was admitted on the shared pages
    and the engine died (HostTierFull in the scheduler's step). The server test
    (tests/env/server/test_streaming_admission_server.py) runs the same through `vllm serve`."""
    from vllm import SamplingParams

    # 40 device blocks: both requests fit the device at once, only the host tier is short
    llm = make_llm("llama4", streaming=dict(TIER, on_host_tier_full=policy),
                   **dict(BUDGET, num_gpu_blocks_override=40))
    try:
        a = prompt(640)
        c = {"prompt_token_ids": list(a["prompt_token_ids"]) + list(prompt(40, 9)["prompt_token_ids"])}
        with_plp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)
        outs = llm.generate([a, c], [greedy(64), with_plp], use_tqdm=False)
        first, second = (o.outputs[0] for o in outs)
        assert first.finish_reason == "length" and len(first.token_ids) == 64
        st = scheduler_connector(llm).stats()
        if policy == "wait":
            assert second.finish_reason == "length" and len(second.token_ids) == 8
            assert len(outs[1].prompt_logprobs) == len(c["prompt_token_ids"])
            assert st["waited_for_space"] >= 1 and st["failed_host_tier_full"] == 0
            assert tokens(llm, [c]) == [list(second.token_ids)]  # alone: the same tokens
        else:
            assert second.finish_reason == "error" and "host tier full" in second.stop_reason
            assert st["failed_host_tier_full"] == 1
        assert st["prefix_hit_requests"] == 0
    finally:
        close(llm)
