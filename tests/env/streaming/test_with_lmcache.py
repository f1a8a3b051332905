"""StreamingConnector and LMCacheConnectorV1 in one engine, through vLLM's MultiConnector (issue 17,
point 3): layer 1 of the tiny llama streams from the host tier, layer 0 keeps its device KV cache and
LMCache stores it. A prefix hit is joint: every connector loads the same prefix (the least of their
hits, in whole pages and whole LMCache chunks), since each restores only its own layers.

End to end (engine_run.py, one engine per process, the device KV cache zeroed before each prompt so
that only what the connectors load can serve a hit): the tokens equal a run without connectors; the
negative control zeroes what LMCache restores, and the tokens must change. Without engines: the
pieces that keep a hit joint and refuse what they cannot serve.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from streaming_helpers import needs_hooks

pytestmark = needs_hooks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "lmcache"))

CHUNK = 64  # LMCache's chunk; the StreamingConnector's page is 32 (joint granule 64) or 128
A = [3 + (i * 7 + 3) % 1000 for i in range(200)]
B = [11 + (i * 5 + 1) % 997 for i in range(200)]
EXT = A + [5 + (i * 11) % 900 for i in range(60)]
PROMPTS = [A, B, A, EXT, EXT]  # A, B, A: B's pages and blocks are reused before A comes back
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "KVSTACK_LMCACHE_FLUSH_S": "0"}
STREAM_LAYER_1 = r"layers\.1\."


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("lmcache")
    from kvstack.testbed.tiny_models import make_model

    return make_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _run(model, tmp_path, *args):
    from test_e2e_cpu import run_engine

    return run_engine(model, "llama", PROMPTS, tmp_path, wipe="--with-streaming" in args,
                      env=LMCACHE_ENV, extra_args=args)


@pytest.fixture(scope="module")
def native(llama, tmp_path_factory):
    return _run(llama, tmp_path_factory.mktemp("native"))["tokens"]


def test_joint_hits_give_the_native_tokens_and_lmcache_restores_layer_0(llama, native, tmp_path):
    out = _run(llama, tmp_path, "--with-streaming", STREAM_LAYER_1, "--zero-restored-kv-from", "4")
    assert out["groups"] == [["FullAttentionSpec", ["model.layers.0.self_attn.attn"]],
                             ["SlidingWindowSpec", ["model.layers.1.self_attn.attn"]]]
    # A, B: nothing stored yet; A again: 199 -> 192 (three chunks); EXT: 192 of A; EXT again: 256
    assert out["cached"] == [0, 0, 192, 192, 256]
    assert out["streaming"]["prefix_hit_tokens"] == 192 + 192 + 256  # the host tier's share
    assert out["tokens"][:4] == native[:4]
    # negative control: the last EXT's layer-0 K/V as LMCache restored it, zeroed
    assert out["tokens"][4] != native[4], "zeroing LMCache's restored K/V changed nothing"


def test_a_shorter_page_granule_cuts_lmcache_s_load(llama, native, tmp_path):
    """128-token pages: the joint granule is 128, LMCache's 192-token hit loads 128 (its third chunk
    is recomputed with the rest)."""
    out = _run(llama, tmp_path, "--with-streaming", STREAM_LAYER_1, "--page-tokens", "128")
    assert out["cached"] == [0, 0, 128, 128, 256]
    assert out["tokens"] == native


# ---- without an engine -------------------------------------------------------------------------

def _groups(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names)
                                            for s, names in specs])


def _spec(kind, **kw):
    from vllm.v1 import kv_cache_interface as k

    common = dict(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    if kind == "full":
        return k.FullAttentionSpec(**common)
    if kind == "window":
        return k.SlidingWindowSpec(**common, sliding_window=kw.get("window", 1))
    return k.ChunkedLocalAttentionSpec(**common, attention_chunk_size=128)


def test_lmcache_caches_the_one_full_attention_group_next_to_paged_layers():
    pytest.importorskip("lmcache")
    from lmcache.integration.vllm.hybrid_state import HybridLayout

    cfg = _groups((_spec("full"), ["l0"]), (_spec("window"), ["l1"]))
    layout = HybridLayout.from_kv_cache_config(cfg, ["l1"])
    assert (layout.kv_group_index, layout.attention_layers, layout.is_hybrid) == (0, ["l0"], False)
    # Llama-4: chunked-local groups next to the paged NoPE layers are not LMCache's to restore
    llama4 = _groups((_spec("chunked"), ["l0"]), (_spec("chunked"), ["l1"]), (_spec("window"), ["l3"]))
    with pytest.raises(ValueError, match="run the paging connector alone"):
        HybridLayout.from_kv_cache_config(llama4, ["l3"])
    # a real sliding-window layer is not paged: refused, never cached as if it were
    real = _groups((_spec("full"), ["l0"]), (_spec("window", window=64), ["l1"]))
    with pytest.raises(ValueError, match="exactly one full-attention"):
        HybridLayout.from_kv_cache_config(real, ["l9"])


def test_multiconnector_refuses_a_child_that_cannot_load_a_shorter_prefix():
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    class Aligned:
        def get_hit_alignment(self):
            return 64

    class Unaligned:
        def get_hit_alignment(self):
            return None

    mc = object.__new__(MultiConnector)
    cfg = _groups((_spec("full"), ["l0"]), (_spec("window"), ["l1"]))
    mc._connectors = [Aligned(), Aligned()]
    assert mc._joint_hit_granule(["l1"], cfg) == 64
    mc._connectors = [Aligned(), Unaligned()]
    with pytest.raises(ValueError, match="Unaligned cannot load a prefix shorter"):
        mc._joint_hit_granule(["l1"], cfg)


def test_joint_hit_is_the_least_hit_in_whole_granules():
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    class Child:
        def __init__(self, hit):
            self.hit = hit

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.hit, False

    mc = object.__new__(MultiConnector)
    mc._joint_granule = 128
    for hits, joint in (([128, 192], 128), ([192, 192], 128), ([256, 320], 256), ([0, 192], 0)):
        mc._connectors = [Child(h) for h in hits]
        assert mc.get_num_new_matched_tokens(None, 0) == (joint, False)
    mc._connectors = [Child(192), Child(None)]  # a lookup still running: ask again later
    assert mc.get_num_new_matched_tokens(None, 0) == (None, False)


def test_a_request_started_past_its_host_tier_prefix_fails_alone():
    """The guard for routing that is not joint (e.g. vLLM's MultiConnector unpatched): another
    connector loaded a prefix this one does not hold; its layers would attend unwritten pages."""
    from test_scheduler_side import _out, _req, _side

    s = _side()
    s.update_state_after_alloc(_req("a", 12), 0)
    s.build_meta(_out(new=[("a", [1, 2, 3], 8)], sched={"a": 4}))
    assert "holds only its first 0" in s.take_failed()["a"]
    s.update_state_after_alloc(_req("b", 12, salt=3), 0)
    s.build_meta(_out(new=[("b", [4, 5, 6], 0)], sched={"b": 12}))
    assert s.take_failed() == {}


def test_next_to_other_connectors_refused_with_several_ranks_or_the_shared_tier():
    from test_validate import _config

    from kvstack.streaming.validate import engine_problems

    joint = SimpleNamespace(kv_connector_extra_config={"kv_joint_hits": True})
    assert engine_problems(_config(kv_transfer_config=joint)) == []
    (problem,) = engine_problems(_config(**{"kv_transfer_config": joint,
                                            "parallel_config.tensor_parallel_size": 2}))
    assert "next to other connectors (MultiConnector) with 2 ranks" in problem
    shared = SimpleNamespace(kv_connector_extra_config={"kv_joint_hits": True,
                                                        "lmcache": {"remote_url": "redis://x:1"}})
    (problem,) = engine_problems(_config(kv_transfer_config=shared))
    assert "the shared tier" in problem
