"""Reservation as requests grow (issue 13), end to end on the tiny Llama-4: two long-output
requests that the host tier cannot hold at full length are both admitted (each reserves its
prompt + decode_reserve_tokens output tokens, 64 here, 256 by default); the one that cannot grow when the tier runs out fails alone with
"host tier full while decoding", keeping the tokens it produced (the native ones); the other
completes with the native tokens. With decode_reserve_tokens="max" the second is refused at
admission instead, as before."""

import pytest

from streaming_helpers import close, greedy, make_llm, needs_hooks, prompt, scheduler_connector, tokens

pytestmark = needs_hooks

PAGE_BYTES = 32 * 2 * 2 * 32 * 2
TIER = dict(window_tokens=256, page_tokens=32, host_tier_gib=32 * PAGE_BYTES / 2**30,  # 1024 tokens
            decode_reserve_tokens=64)
BUDGET = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=1024)
A, B = prompt(400, 3), prompt(460, 4)  # reserve 15 + 17 pages: the whole tier
OUT = 200  # 400 + 200 and 460 + 200 tokens (19 + 21 pages) do not fit together


@pytest.fixture(scope="module")
def native():
    llm = make_llm("llama4", max_model_len=1024)
    try:
        yield tokens(llm, [A, B], OUT)
    finally:
        close(llm)


def test_both_admitted_one_fails_alone_while_decoding(native):
    llm = make_llm("llama4", streaming=TIER, **BUDGET)
    try:
        a, b = (o.outputs[0] for o in llm.generate([A, B], greedy(OUT), use_tqdm=False))
        assert a.finish_reason == "error", a.finish_reason
        assert "host tier full while decoding" in a.stop_reason
        assert 0 < len(a.token_ids) < OUT and list(a.token_ids) == native[0][:len(a.token_ids)]
        assert b.finish_reason == "length" and list(b.token_ids) == native[1]
        st = scheduler_connector(llm).stats()
        assert st["failed_host_tier_full"] == 1 and st["pages_in_use"] == 0
        assert tokens(llm, [A], 16) == [native[0][:16]]  # the engine goes on
    finally:
        close(llm)


def test_reserve_max_refuses_the_second_at_admission(native):
    llm = make_llm("llama4", streaming={**TIER, "decode_reserve_tokens": "max"}, **BUDGET)
    try:
        a, b = (o.outputs[0] for o in llm.generate([A, B], greedy(OUT), use_tqdm=False))
        assert a.finish_reason == "length" and list(a.token_ids) == native[0]
        assert b.finish_reason == "error" and list(b.token_ids) == []
        assert "prompt + max_tokens" in b.stop_reason
    finally:
        close(llm)
