"""Start-up refusals of the streaming connector (issue 13, kvstack/streaming/validate.py): every
configuration the windowed path cannot compute exactly is refused before the engine serves,
with a message naming what to change; and the per-step check that no streaming layer was left
to the backend (what a captured CUDA graph would do)."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from streaming_helpers import ROOT, needs_hooks, vllm_check_reserves_null_block

pytestmark = needs_hooks


def _config(**over):
    from vllm.config.compilation import CUDAGraphMode

    comp = SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, splitting_ops=[],
                           pass_config=SimpleNamespace(fuse_attn_quant=False),
                           is_attention_compiled_piecewise=lambda: True)
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(use_mla=False),
        compilation_config=comp)
    for path, value in over.items():
        obj = cfg
        *parents, last = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg


def _mode(name):
    from vllm.config.compilation import CUDAGraphMode

    return getattr(CUDAGraphMode, name)


REFUSED = {
    "prefix caching": ({"cache_config.enable_prefix_caching": True}, "--no-enable-prefix-caching"),
    "no hybrid manager": ({"scheduler_config.disable_hybrid_kv_cache_manager": True},
                          "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"),
    "context parallel": ({"parallel_config.decode_context_parallel_size": 2}, "decode context"),
    "speculative decoding": ({"speculative_config": object()}, "speculative decoding"),
    "MLA": ({"model_config.use_mla": True}, "MLA"),
    "fp8 KV cache": ({"cache_config.cache_dtype": "fp8"}, "kv_cache_dtype='auto'"),
    "quantized attention output": ({"compilation_config.pass_config.fuse_attn_quant": True},
                                   "fuse_attn_quant"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_engine_configuration_refused(case):
    from kvstack.streaming.validate import UnsupportedConfiguration, check_engine, engine_problems

    assert engine_problems(_config()) == []
    over, needle = REFUSED[case]
    problems = engine_problems(_config(**over))
    assert len(problems) == 1 and needle in problems[0], problems
    with pytest.raises(UnsupportedConfiguration, match="kvstack StreamingConnector"):
        check_engine(_config(**over))


def test_tensor_parallelism_is_served():
    """Each rank keeps and streams the K/V of its own KV heads (its own worker side and host
    tier); the scheduler side stays one per engine (check_streaming.py --tensor-parallel-size 2
    runs it end to end)."""
    from kvstack.streaming.validate import engine_problems

    assert engine_problems(_config(**{"parallel_config.tensor_parallel_size": 2})) == []


def test_pipeline_parallelism_is_served():
    """Each stage streams its own layers into its own host tier; the scheduler side (whose KV
    cache config names only the first stage's layers) stays one per engine, and every side sizes
    the page table alike, for the stage with the most streaming layers (check_streaming.py
    --pipeline-parallel-size 2 runs it end to end)."""
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import _max_stage_layers
    from kvstack.streaming.validate import engine_problems

    assert engine_problems(_config(**{"parallel_config.pipeline_parallel_size": 2})) == []
    assert engine_problems(_config(**{"parallel_config.pipeline_parallel_size": 2,
                                      "parallel_config.tensor_parallel_size": 2})) == []

    def vllm_config(total, **hf):
        model = SimpleNamespace(get_total_num_hidden_layers=lambda: total,
                                hf_text_config=SimpleNamespace(**hf))
        return SimpleNamespace(model_config=model)

    auto = StreamingConfig()
    # the tiny Llama-4 (NoPE layer 3): stages [0, 1] and [2, 3], the second holds the one
    no_rope = vllm_config(4, no_rope_layers=[1, 1, 1, 0])
    assert _max_stage_layers(auto, no_rope, 2) == 1
    # Llama-4 style, a NoPE layer every 4th: 48 layers in 2 stages of 24, 6 NoPE layers each
    scout = vllm_config(48, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)])
    assert _max_stage_layers(auto, scout, 2) == 6 and _max_stage_layers(auto, scout, 4) == 3
    # layer_types: only the full-attention layers stream; 5 layers in 2 stages of 3 and 2
    typed = vllm_config(5, layer_types=["sliding_attention", "full_attention", "full_attention",
                                        "sliding_attention", "full_attention"])
    assert _max_stage_layers(auto, typed, 2) == 2
    # no per-layer information, or explicit regexes: every layer of the largest stage (a bound)
    assert _max_stage_layers(auto, vllm_config(5), 2) == 3
    assert _max_stage_layers(StreamingConfig(streaming_layers=(r"\.3\.",)), no_rope, 2) == 2


def test_a_file_backed_host_tier_is_refused_with_several_ranks():
    """Every rank would map the same host_tier_path for its own host tier."""
    from kvstack.streaming.validate import engine_problems

    tier = SimpleNamespace(kv_connector_extra_config={"host_tier_path": "/tmp/tier.bin"})
    assert engine_problems(_config(kv_transfer_config=tier)) == []
    for size in ("tensor_parallel_size", "pipeline_parallel_size"):
        (problem,) = engine_problems(_config(**{"kv_transfer_config": tier,
                                                f"parallel_config.{size}": 2}))
        assert "host_tier_path with 2 ranks" in problem


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_cuda_graphs_refused(mode):
    from kvstack.streaming.validate import engine_problems

    (problem,) = engine_problems(_config(**{"compilation_config.cudagraph_mode": _mode(mode)}))
    assert "full CUDA graphs" in problem and "PIECEWISE" in problem


def test_piecewise_graphs_need_attention_among_the_splitting_ops():
    from kvstack.streaming.validate import engine_problems

    ok = _config(**{"compilation_config.cudagraph_mode": _mode("PIECEWISE")})
    assert engine_problems(ok) == []
    bad = _config(**{"compilation_config.cudagraph_mode": _mode("PIECEWISE"),
                     "compilation_config.is_attention_compiled_piecewise": lambda: False})
    (problem,) = engine_problems(bad)
    assert "splitting ops" in problem


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs():
    from kvstack.streaming import StreamingConnector

    assert StreamingConnector.requires_piecewise_for_cudagraph({}) is True


def _layer(name, **kw):
    from vllm.v1.attention.backend import AttentionType

    attrs = dict(layer_name=name, kv_sharing_target_layer_name=None, attn_type=AttentionType.DECODER,
                 sliding_window=None, kv_cache_dtype="auto", impl=SimpleNamespace(scale=0.1))
    attrs.update(kw)
    return type("Attention", (), attrs)()


def test_layer_refusals():
    import torch

    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import _Layout
    from kvstack.streaming.validate import layer_problems

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    layout = _Layout(group=0, block_size=32, layers=tuple(names[:2]), num_kv_heads=2,
                     head_size=32, dtype=torch.bfloat16, num_pages=8, reuse_ok=True)
    cfg = StreamingConfig()  # "auto": every full-attention layer of a non-iRoPE model
    model = SimpleNamespace(hf_text_config=SimpleNamespace(no_rope_layers=None))

    def vc(layers):
        return SimpleNamespace(model_config=model,
                               compilation_config=SimpleNamespace(static_forward_context=layers))

    ok = {n: _layer(n) for n in names[:2]}
    assert layer_problems(vc(ok), layout, cfg) == []
    shared = {**ok, names[1]: _layer(names[1], kv_sharing_target_layer_name=names[0])}
    (p,) = layer_problems(vc(shared), layout, cfg)
    assert "KV sharing" in p and names[1] in p
    # a third full-attention layer the config selects, but vLLM gave no streaming spec (e.g. a
    # TurboQuant cache): the backend would attend it over a one-token window
    left = {**ok, names[2]: _layer(names[2], kv_cache_dtype="turboquant_4bit")}
    (p,) = layer_problems(vc(left), layout, cfg)
    assert names[2] in p and "no streaming KV cache spec" in p


def test_a_streaming_layer_left_to_the_backend_fails_the_step():
    import torch

    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import ReqStep, StreamingMetadata, _Layout
    from kvstack.streaming.worker_side import _WorkerSide

    layout = _Layout(group=0, block_size=4, layers=("L0", "L1"), num_kv_heads=1, head_size=8,
                     dtype=torch.float32, num_pages=4, reuse_ok=True)
    w = _WorkerSide(StreamingConfig(page_tokens=4), layout)
    meta = StreamingMetadata(reqs=[ReqStep("r", 0, 1, 0, [0])])
    w.begin_step(meta)
    w._pending.discard("L0")  # as attention() does for a layer the connector computed
    with pytest.raises(RuntimeError, match="L1 were not computed by the connector"):
        w.end_step()
    w.begin_step(StreamingMetadata())  # a step without tokens (dummy run): nothing to check
    w.end_step()


def test_fp8_kv_cache_refused_at_start_up_on_the_engine():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests' / 'env' / 'streaming')!r})
        from kvstack.testbed import tiny_models
        tiny_models.apply_engine_env()
        from streaming_helpers import make_llm
        try:
            make_llm("llama4", streaming=dict(window_tokens=48), num_gpu_blocks_override=16,
                     max_num_batched_tokens=64, max_model_len=512, kv_cache_dtype="fp8")
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
        else:
            print("STARTED")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    out = res.stdout
    assert "REFUSED" in out, out[-2000:] + res.stderr[-2000:]
    assert "kvstack StreamingConnector: unsupported configuration" in out
    assert "kv_cache_dtype='auto'" in out


def test_a_device_budget_too_small_names_the_minimum_and_the_minimum_starts():
    """vLLM 0017: vLLM's "estimated maximum model length" error gains the minimum in blocks and,
    with the streaming connector, why streaming layers still need blocks (one step per group);
    the connector refuses the budget vLLM accepts but cannot serve (no room for the null block)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests' / 'env' / 'streaming')!r})
        from kvstack.testbed import tiny_models
        tiny_models.apply_engine_env()
        from streaming_helpers import close, make_llm
        for blocks in (8, 36, 37):
            try:
                llm = make_llm("llama4", streaming=dict(window_tokens=48),
                               num_gpu_blocks_override=blocks, max_num_batched_tokens=256,
                               max_model_len=1024)
            except Exception as e:
                print("REFUSED", blocks, e)
            else:
                print("STARTED", blocks)
                close(llm)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    out = res.stdout
    assert "REFUSED 8 " in out, out[-2000:] + res.stderr[-2000:]
    assert "needs at least 37 KV cache blocks (one of them vLLM's null block), 8 fit" in out
    assert "(num_gpu_blocks_override=8)" in out
    assert "StreamingConnector bounds its layers' device KV to a window" in out
    assert "each of the 4 KV cache groups" in out
    if vllm_check_reserves_null_block():
        # vLLM's check refuses 36 itself (the null block is not a request's), naming 37
        assert "REFUSED 36 " in out, out[-2000:]
        assert "needs at least 37 KV cache blocks (one of them vLLM's null block), 36 fit" in out
    else:
        # vLLM's check accepts 36, which then leaves a long request waiting forever (the null
        # block); the connector refuses it at start-up
        assert "REFUSED 36 " in out and "plus vLLM's null block" in out, out[-2000:]
    assert "STARTED 37" in out, out[-2000:]
