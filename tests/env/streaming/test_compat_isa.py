"""compat.align_cpu_attention_isa: a CPU attention impl whose ISA was picked for another block size
gets the one vLLM's own `_get_attn_isa` picks for the block size in effect (the connector calls it
after the KV cache is allocated; vLLM 0.25.1's impl picks its ISA at construction, and the hybrid
manager could lower the block size afterwards: the AMX kernel then failed its block-size check).
No engine: vLLM's impl class without its constructor, AMX reported present, the base's own picker.
Since the 0.25 hooks patch keeps the user's block size for paged layers, no engine test reaches
this guard; these cases pin it (and a block size AMX accepts is the control: nothing changes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvstack.streaming.compat import align_cpu_attention_isa  # noqa: E402

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
pytestmark = [pytest.mark.env,
              pytest.mark.skipif(not hasattr(cpu_attn, "_get_attn_isa"), reason="no ISA picker here")]


def _config(block: int) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=block),
                           model_config=SimpleNamespace(dtype=torch.bfloat16))


def _layer(isa: str) -> SimpleNamespace:
    impl = object.__new__(cpu_attn.CPUAttentionBackendImpl)
    impl.isa, impl.head_size, impl.kv_cache_dtype = isa, 64, "auto"
    return SimpleNamespace(impl=impl)


@pytest.fixture
def amx(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_amx_picked_for_32_token_blocks_is_replaced_when_blocks_are_16(amx):
    layers = {"model.layers.0.self_attn.attn": _layer("amx")}
    changed = align_cpu_attention_isa(_config(16), layers)
    assert changed == ["model.layers.0.self_attn.attn"]
    isa = layers["model.layers.0.self_attn.attn"].impl.isa
    assert isa != "amx" and isa == cpu_attn._get_attn_isa(torch.bfloat16, 16, 64, "auto")


def test_control_a_block_size_amx_accepts_changes_nothing(amx):
    layers = {"a": _layer("amx")}
    assert align_cpu_attention_isa(_config(32), layers) == []
    assert layers["a"].impl.isa == "amx"


def test_layers_of_other_backends_and_impls_without_an_isa_are_left_alone(amx):
    other = SimpleNamespace(impl=SimpleNamespace(isa="amx"))  # not vLLM's CPU attention impl
    bare = SimpleNamespace(impl=object.__new__(cpu_attn.CPUAttentionBackendImpl))  # 0.32: no impl.isa
    assert align_cpu_attention_isa(_config(16), {"other": other, "bare": bare}) == []
    assert other.impl.isa == "amx"
