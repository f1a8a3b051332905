"""Streaming layers that vLLM splits over several KV cache groups (issue 13).

The hybrid KV cache manager groups layers of one spec in groups of the smallest layer type's
size. A tiny Llama-4 with one chunked-local layer and three NoPE (streaming) layers gets three
streaming groups of one layer each, each with its own block table. Every one of them must be
streamed: a streaming layer left to the backend would attend over its one-token device window,
silently (the first version handled only the first group: this test failed there)."""

import json
import shutil

import pytest

from streaming_helpers import ROOT, close, greedy, needs_hooks, prompt, scheduler_connector

pytestmark = needs_hooks

BUDGET = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=512)
PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # one layer's page
STREAMING = dict(window_tokens=48, page_tokens=32, host_tier_gib=3 * 48 * PAGE_BYTES / 2**30)
PROMPTS = [prompt(400), prompt(90, 1), prompt(250, 2)]


@pytest.fixture(scope="module")
def model_dir():
    from streaming_helpers import tiny_model

    src = tiny_model("llama4")
    dest = ROOT / "build" / "tiny-models" / "llama4-three-nope"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["no_rope_layers"] = [1, 0, 0, 0]  # layer 0 chunked-local, layers 1-3 NoPE global
    cfg["layer_types"] = ["chunked_attention", "full_attention", "full_attention", "full_attention"]
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def _llm(model_dir, streaming):
    from streaming_helpers import make_llm_from

    if streaming:
        return make_llm_from(model_dir, streaming=STREAMING, **BUDGET)
    return make_llm_from(model_dir, max_model_len=512)


def test_every_streaming_group_is_streamed(model_dir):
    native = _llm(model_dir, streaming=False)
    try:
        want = [list(o.outputs[0].token_ids) for o in native.generate(PROMPTS, greedy(8), use_tqdm=False)]
    finally:
        close(native)
    llm = _llm(model_dir, streaming=True)
    try:
        conn = scheduler_connector(llm)
        assert len(conn.layout.all_groups()) == 3, conn.layout
        assert sorted(conn.layout.layers) == [f"model.layers.{i}.self_attn.attn" for i in (1, 2, 3)]
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy(8), use_tqdm=False)]
        assert got == want
        assert conn.stats()["pages_in_use"] == 0
    finally:
        close(llm)
