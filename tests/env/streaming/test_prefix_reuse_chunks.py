"""Prefix reuse when the local-attention chunk does not divide the page (issue 17, point 4).

Llama-4-Scout's chunked-local layers attend within chunks of 8,192 tokens; kvstack's pages are 32
tokens. A prefix reused from the host tier restores nothing on the device, so the local layers
may only resume where a chunk ends: the hit is rounded down to a multiple of lcm(page, chunk)
(layout.reuse_granule; before, reuse was switched off for such models). Here the sharp tiny
Llama-4 (streaming_helpers.sharp_llama4) with its chunk raised from 32 to 128 tokens, pages of 32:
EXT extends a finished 700-token PREFIX (21 full pages), so the hit is 640 tokens (5 chunks), not
672. Compared with native vLLM on the same model: greedy tokens equal, top-5 logprobs within TOL.
Negative control: the same hit without the rounding (672 tokens: the local layers then miss the
K/V of tokens 640-671 of their current chunk) must differ beyond TOL.
"""

from __future__ import annotations

import json
import shutil

import pytest

from streaming_helpers import (ROOT, close, greedy_logprobs, logprob_gap, make_llm_from,
                               needs_hooks, prompt, scheduler_connector, sharp_llama4)

pytestmark = needs_hooks

TOL = 0.03  # as test_exactness_sharp.py
N_NEW = 8
PAGE, CHUNK = 32, 128
PAGE_BYTES = PAGE * 2 * 2 * 32 * 2
STREAMING = dict(window_tokens=64, page_tokens=PAGE, host_tier_gib=96 * PAGE_BYTES / 2**30,
                 on_host_tier_full="wait")
BUDGET = dict(num_gpu_blocks_override=40, max_num_batched_tokens=64, max_num_seqs=2,
              max_model_len=1536)

PREFIX = list(prompt(700, 3)["prompt_token_ids"])
EXT = PREFIX + list(prompt(200, 4)["prompt_token_ids"])


@pytest.fixture(scope="module")
def model():
    """The sharp tiny Llama-4 with local chunks of 128 tokens (config only; same weights)."""
    src = sharp_llama4()
    dest = ROOT / "build" / "tiny-models" / f"llama4-sharp-chunk{CHUNK}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg)
    assert text["attention_chunk_size"] == 32
    text["attention_chunk_size"] = CHUNK
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


@pytest.fixture(scope="module")
def native(model):
    llm = make_llm_from(model, max_model_len=1536)
    try:
        return greedy_logprobs(llm, [{"prompt_token_ids": EXT}], N_NEW)[0]
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(model, native):
    llm = make_llm_from(model, streaming=STREAMING, **BUDGET)
    yield llm
    close(llm)


def _ext_after_prefix(llm):
    greedy_logprobs(llm, [{"prompt_token_ids": PREFIX}], N_NEW)
    conn = scheduler_connector(llm)
    before = conn.stats()["prefix_hit_tokens"]
    (got,) = greedy_logprobs(llm, [{"prompt_token_ids": EXT}], N_NEW)
    return got, conn.stats()["prefix_hit_tokens"] - before


def test_reuse_ends_where_a_chunk_ends_and_matches_native(streaming, native):
    sched = scheduler_connector(streaming)._sched
    assert sched.prefix_reuse and sched.layout.reuse_granule == CHUNK
    got, hit = _ext_after_prefix(streaming)
    gap = logprob_gap(got, native)
    print(f"hit {hit} tokens; streaming vs native {gap:.4f}")
    assert hit == len(PREFIX) // CHUNK * CHUNK == 640
    assert got[0] == native[0]
    assert gap <= TOL


def test_control_a_hit_inside_a_chunk_differs(streaming, native, monkeypatch):
    sched = scheduler_connector(streaming)._sched
    monkeypatch.setattr(sched, "_granule_pages", 1)  # the mutation: page-granular hits
    sched.pool.__init__(sched.pool.num_pages, PAGE)  # forget the earlier test's pages
    got, hit = _ext_after_prefix(streaming)
    gap = logprob_gap(got, native)
    print(f"control: hit {hit} tokens; vs native {gap:.4f}")
    assert hit == len(PREFIX) // PAGE * PAGE == 672
    assert gap > TOL
