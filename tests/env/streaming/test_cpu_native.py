"""The CPU fast path (kvstack/streaming/cpu_native.py): a history that fits in one window is
attended by vLLM's own CPU kernel through the layer's backend, on a scratch cache.

Pinned here: the kernel call equals softmax attention over [history; new] (random data, the real
layer of a running engine), and an engine whose every history fits in one window produces the
greedy tokens of native vLLM."""

import pytest
import torch

from streaming_helpers import close, make_llm, needs_hooks, prompt, tokens

pytestmark = needs_hooks

NOPE = "model.layers.3.self_attn.attn"  # the tiny Llama-4's streaming (NoPE) layer
PROMPTS = [700, 45, 300]
SHAPE = dict(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference():
    llm = make_llm("llama4", **SHAPE)
    try:
        return tokens(llm, [prompt(n, i) for i, n in enumerate(PROMPTS)])
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(reference):
    llm = make_llm("llama4", streaming=dict(window_tokens=1024, prefix_reuse=False), **SHAPE)
    yield llm
    close(llm)


def _layer(llm):
    from vllm.config import get_layers_from_vllm_config  # noqa: F401 (vLLM is importable)

    core = llm.llm_engine.engine_core.engine_core
    ctx = core.vllm_config.compilation_config.static_forward_context
    return ctx[NOPE]


@pytest.mark.parametrize("ctx,new", [(0, 37), (50, 37), (64, 1), (300, 5)])
def test_kernel_equals_softmax_over_history_and_new(streaming, ctx, new):
    from kvstack.streaming import cpu_native
    from kvstack.streaming.windowed import attend_reference

    layer = _layer(streaming)
    assert cpu_native.usable(layer)
    torch.manual_seed(ctx + new)
    hq, hkv, d = 4, 2, 32
    q = torch.randn(new, hq, d).bfloat16()
    k = torch.randn(ctx + new, hkv, d).bfloat16()
    v = torch.randn(ctx + new, hkv, d).bfloat16()
    out = torch.full((new, hq, d), float("nan"), dtype=torch.bfloat16)
    hk, hv = (k[:ctx], v[:ctx]) if ctx else (None, None)
    assert cpu_native.attend_one_window(layer, q, hk, hv, k[ctx:], v[ctx:], out, block_size=32)
    ref, _ = attend_reference(q, k, v, float(layer.impl.scale), causal_offset=ctx)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_not_used_off_the_cpu_backend():
    from types import SimpleNamespace

    from kvstack.streaming import cpu_native

    assert not cpu_native.usable(SimpleNamespace(impl=object()))
    out = torch.zeros(1, 4, 32)
    assert not cpu_native.attend_one_window(SimpleNamespace(impl=object()), out, None, None,
                                            torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), out, 32)


def test_one_window_engine_matches_native(streaming, reference):
    assert tokens(streaming, [prompt(n, i) for i, n in enumerate(PROMPTS)]) == reference
