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


@pytest.mark.parametrize("line", ["fifo", "control"])
def test_wait_lets_no_small_request_overtake_a_large_one(line, monkeypatch):
    """on_host_tier_full="wait" is first come, first served: request B holds 24 of the 32 pages
    (700 + 64 tokens); L (300 + 8 tokens: 10 pages) arrives next and waits; three small requests
    (100 + 8 tokens: 4 pages each) arrive after it and would fit in the 8 free pages, but wait
    behind L (its 10 pages are kept for it) and go in with it once B is done. Every request gets
    the tokens it gets alone. Control: the line removed (a mutation of _needed_ahead_of), the
    small ones overtake L while B runs."""
    from vllm import SamplingParams

    llm = make_llm("llama4", streaming=dict(TIER, on_host_tier_full="wait"),
                   **dict(BUDGET, num_gpu_blocks_override=40))
    try:
        conn = scheduler_connector(llm)
        if line == "control":
            monkeypatch.setattr(conn._sched, "_needed_ahead_of", lambda rid: 0)
        eng = llm.llm_engine
        sched = eng.engine_core.engine_core.scheduler
        reqs = {"B": (prompt(700), 64), "L": (prompt(300, 5), 8),
                **{f"S{i}": (prompt(100, 10 + i), 8) for i in range(3)}}
        for rid, (p, n) in reqs.items():
            eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        admitted, outs, step = {}, {}, 0
        while eng.has_unfinished_requests() and step < 2000:
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
            for r in sched.running:
                admitted.setdefault(r.request_id.rsplit("-", 1)[0], step)
        print(line, "admitted at step:", admitted, "stats:", conn.stats())
        small = [admitted[f"S{i}"] for i in range(3)]
        if line == "fifo":
            assert admitted["L"] <= min(small) and admitted["L"] > admitted["B"]
            assert conn.stats()["waiting_requests"] == 0
            alone = {rid: tokens(llm, [p], n)[0] for rid, (p, n) in reqs.items()}
            assert outs == alone
        else:
            assert max(small) < admitted["L"]  # overtaken by every small one
    finally:
        close(llm)
