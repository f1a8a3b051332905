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
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         async_scheduling=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, enable_dbo=False,
                                        ubatch_size=0),
        attention_config=SimpleNamespace(backend=None),
        speculative_config=None, model_config=SimpleNamespace(use_mla=False),
        compilation_config=comp, use_v2_model_runner=False)
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
    "speculative decoding": ({"speculative_config": object()},
                             "speculative decoding is not supported with streaming layers "
                             "(drop --speculative-config)"),
    "dual-batch overlap": ({"parallel_config.enable_dbo": True},
                           "drop --enable-dbo and --ubatch-size"),
    "micro-batching": ({"parallel_config.ubatch_size": 2}, "drop --enable-dbo and --ubatch-size"),
    "async scheduling": ({"scheduler_config.async_scheduling": True},
                         "pass --no-async-scheduling (async_scheduling=False)"),
    "V2 model runner": ({"use_v2_model_runner": True}, "set VLLM_USE_V2_MODEL_RUNNER=0"),
    "FlashInfer requested": ({"attention_config.backend": "FLASHINFER"},
                             "--attention-backend=FLASHINFER (its attention metadata has no "
                             "query_start_loc"),
    "FlexAttention requested": ({"attention_config.backend": "FLEX_ATTENTION"},
                                "choose an allowed one with --attention-backend"),
    "MLA backend requested": ({"attention_config.backend": "TRITON_MLA"},
                              "--attention-backend=TRITON_MLA: not an attention backend"),
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


def test_engine_features_refused_on_vllms_own_configs():
    """The same refusals read from vLLM's own config classes of this base (the field names are
    real): dual-batch overlap and micro-batching, async scheduling, a requested backend."""
    from vllm.config import AttentionConfig, ParallelConfig, SchedulerConfig

    from kvstack.streaming.validate import engine_problems

    assert engine_problems(_config(parallel_config=ParallelConfig(),
                                   attention_config=AttentionConfig())) == []
    for par in (ParallelConfig(enable_dbo=True), ParallelConfig(ubatch_size=2)):
        (p,) = engine_problems(_config(parallel_config=par))
        assert "dual-batch overlap / micro-batching" in p and "--enable-dbo" in p, p
    sched = SchedulerConfig(async_scheduling=True, max_model_len=512, is_encoder_decoder=False)
    (p,) = engine_problems(_config(scheduler_config=sched))
    assert "--no-async-scheduling" in p
    sched = SchedulerConfig(async_scheduling=False, max_model_len=512, is_encoder_decoder=False)
    assert engine_problems(_config(scheduler_config=sched)) == []
    for name in ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"):
        assert engine_problems(_config(attention_config=AttentionConfig(backend=name))) == []
    for name in ("FLASHINFER", "FLEX_ATTENTION", "FLASHMLA", "CUTLASS_MLA"):
        (p,) = engine_problems(_config(attention_config=AttentionConfig(backend=name)))
        assert f"--attention-backend={name}" in p and "allowed on vLLM" in p, p
    if "backend_per_kind" in AttentionConfig.__dataclass_fields__:  # vLLM 0.32
        # streaming layers are full attention to vLLM's backend selector
        per_kind = AttentionConfig(backend_per_kind={"full_attention": "FLASHINFER"})
        (p,) = engine_problems(_config(attention_config=per_kind))
        assert "attention_config.backend_per_kind=FLASHINFER" in p
        other = AttentionConfig(backend_per_kind={"sliding_window": "FLASHINFER"})
        assert engine_problems(_config(attention_config=other)) == []


@pytest.mark.parametrize("env, refused", [("1", True), ("0", False), (None, False)])
def test_the_v2_model_runner_is_refused(monkeypatch, env, refused):
    """VLLM_USE_V2_MODEL_RUNNER through vLLM's own VllmConfig.use_v2_model_runner: refused when
    it picks the V2 runner; unset, the CPU engine has no Triton and keeps V1 (served)."""
    from vllm.config import AttentionConfig, VllmConfig

    from kvstack.streaming.validate import engine_problems

    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)

    class Config(SimpleNamespace):
        use_v2_model_runner = VllmConfig.use_v2_model_runner

    base = vars(_config())
    base.pop("use_v2_model_runner")
    base.update(attention_config=AttentionConfig(), model_config=None)
    problems = engine_problems(Config(**base))
    if refused:
        (p,) = problems
        assert "V2 model runner" in p and "VLLM_USE_V2_MODEL_RUNNER=0" in p
    else:
        assert problems == []


def test_the_attention_backend_allow_list_of_this_base():
    """Each allowed backend of this vLLM base is one of vLLM's names, and its metadata has the
    fields the connector reads (query_start_loc, slot_mapping) and its impl the attributes the
    windowed path applies; FlashInfer's metadata has no query_start_loc (why it is refused).
    Read from the sources, which import CUDA-only modules."""
    import ast
    import importlib.util

    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvstack.streaming.validate import ATTENTION_BACKENDS, allowed_backends

    base = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    assert base in ATTENTION_BACKENDS and allowed_backends() == ATTENTION_BACKENDS[base]

    def fields(name):
        module = AttentionBackendEnum[name].get_path(include_classname=False)
        tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
        meta, impl = set(), set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Metadata"):
                meta |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
                         and isinstance(n.target, ast.Name)}
            if isinstance(node, ast.ClassDef) and node.name.endswith("Impl"):
                impl |= {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign)
                         for t in n.targets if isinstance(t, ast.Attribute)}
        return meta, impl

    for name in allowed_backends():
        meta, impl = fields(name)
        assert {"query_start_loc", "slot_mapping"} <= meta, (name, meta)
        assert {"scale", "logits_soft_cap", "alibi_slopes", "sinks"} <= impl, (name, impl)
    meta, _ = fields("FLASHINFER")
    assert "slot_mapping" in meta and "query_start_loc" not in meta


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


def _layer(name, cls="Attention", **kw):
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    attrs = dict(layer_name=name, kv_sharing_target_layer_name=None, attn_type=AttentionType.DECODER,
                 sliding_window=None, kv_cache_dtype="auto", impl=SimpleNamespace(scale=0.1),
                 attn_backend=CPUAttentionBackend)
    attrs.update(kw)
    return type(cls, (), attrs)()


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
    # a native sliding-window layer whose window equals device_window_tokens lands in a
    # streaming group: the connector would attend its whole history
    sliding = {**ok, names[1]: _layer(names[1], sliding_window=1)}
    (p,) = layer_problems(vc(sliding), layout, cfg)
    assert f"{names[1]} is a sliding-window layer (sliding_window=1)" in p
    assert "choose another device_window_tokens" in p
    # a native sliding-window layer the regexes select but vLLM keeps native: served (exact)
    native = {**ok, names[2]: _layer(names[2], sliding_window=512)}
    assert layer_problems(vc(native), layout, StreamingConfig(streaming_layers=("layers",))) == []
    # a layer class other than vLLM's Attention
    (p,) = layer_problems(vc({**ok, names[1]: _layer(names[1], cls="MyAttention")}), layout, cfg)
    assert "layer class MyAttention" in p and "'streaming_layers'" in p


def _backend(name, base=object):
    return type(f"{name.title()}Backend", (base,), {"get_name": staticmethod(lambda: name)})


@pytest.mark.parametrize("case", ["FLASHINFER", "FLEX_ATTENTION", "TRITON_MLA", "NOT_A_BACKEND",
                                  "no backend", "wrapped CPU_ATTN"])
def test_a_streaming_layer_on_a_backend_outside_the_allow_list_is_refused(case):
    """The backend vLLM actually chose for a streaming layer (auto or requested), checked when
    the KV caches are registered: allowed by name and vLLM's registered class of that name."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.layout import _Layout
    from kvstack.streaming.validate import layer_problems

    name = "model.layers.0.self_attn.attn"
    layout = _Layout(group=0, block_size=32, layers=(name,), num_kv_heads=2, head_size=32,
                     dtype=torch.bfloat16, num_pages=8, reuse_ok=True)
    model = SimpleNamespace(hf_text_config=SimpleNamespace(no_rope_layers=None))

    def problems(backend):
        layers = {name: _layer(name, attn_backend=backend)}
        return layer_problems(SimpleNamespace(
            model_config=model, compilation_config=SimpleNamespace(static_forward_context=layers)),
            layout, StreamingConfig())

    assert problems(CPUAttentionBackend) == []
    if case == "no backend":
        backend = None
    elif case == "wrapped CPU_ATTN":  # a subclass calling itself CPU_ATTN (as chunked-local's)
        backend = _backend("CPU_ATTN", CPUAttentionBackend)
    else:
        backend = _backend(case)
    (p,) = problems(backend)
    assert p.startswith(name) and "--attention-backend" in p and "'streaming_layers'" in p, p
    if case == "wrapped CPU_ATTN":
        assert "is not vLLM's registered CPU_ATTN class" in p
    else:
        assert "is not one streaming layers are known exact with (allowed on vLLM" in p
    if case == "FLASHINFER":
        assert "no query_start_loc" in p


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


def test_a_streaming_layer_being_captured_in_a_cuda_graph_is_refused(monkeypatch):
    # the capture itself needs a GPU: the query stands in for a CUDA tensor and torch says a
    # capture is under way; control: the same call without a capture reaches the worker side
    import torch

    from kvstack.streaming.connector import StreamingConnector

    calls = []
    conn = SimpleNamespace(_worker=SimpleNamespace(attention=lambda *a: calls.append(a) or "out"))
    layer, query = SimpleNamespace(layer_name="model.layers.3.attn"), SimpleNamespace(is_cuda=True)
    args = (conn, layer, query, "key", "value", "output", "meta")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="model.layers.3.attn is being captured in a CUDA graph"
                                           ".*PIECEWISE"):
        StreamingConnector.compute_streaming_attention(*args)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert StreamingConnector.compute_streaming_attention(*args) == "out" and len(calls) == 1
    # a CPU query never asks CUDA (vLLM's CPU engine)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: 1 / 0)
    cpu = (conn, layer, SimpleNamespace(is_cuda=False), "key", "value", "output", "meta")
    assert StreamingConnector.compute_streaming_attention(*cpu) == "out"


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
    # the CPU engine's own choices are not refused: no async scheduling (vLLM turns it off on
    # CPU), the V1 model runner (no Triton), no micro-batching, no backend requested
    lines = out.split("REFUSED", 1)[1].splitlines()
    refusal = "\n".join([lines[0]] + [x for x in lines[1:] if x.startswith("  - ")])
    assert "kv_cache_dtype='auto'" in refusal
    for served in ("async scheduling", "V2 model runner", "micro-batching", "attention backend"):
        assert served not in refusal, refusal


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
