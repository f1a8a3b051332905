"""The windowed path's device scratch (issue 28, point 4; kvstack/streaming/scratch.py and the
gpu_worker patch): the plan counts what transfer.py allocates, the engine's configuration gives
the plan per rank, `device_scratch_mib` replaces it and is refused at start-up below the staging
buffers, and the patched GPU worker takes the configured connector's scratch (MultiConnector: the
sum of its children's) out of the KV cache memory. That the KV cache vLLM reports shrinks by it
on a real GPU, and that the windowed path's peak stays inside it, is ci/gpu/check_streaming.py's
scratch step (the CPU engine neither profiles memory nor has a device scratch)."""

from __future__ import annotations

import logging

import pytest
import torch

from streaming_helpers import env, needs_hooks, streaming_transfer_config, tiny_model

from kvstack.streaming.config import DEFAULT_WINDOW_MIB, StreamingConfig
from kvstack.streaming.scratch import MIB, ScratchPlan, plan, plan_for, problems
from kvstack.streaming.transfer import Medium, Transfer

pytestmark = needs_hooks


class GpuLikeMedium(Medium):
    """Staging buffers in the pool's dtype, as on a GPU, where the plan is reserved (on the CPU
    they are in the window kernel's dtype, float32 or bf16, and nothing is reserved)."""

    def staging_dtype(self, pool_dtype):
        return pool_dtype


@pytest.mark.parametrize("window,page", [(100, 32), (64, 32), (1024, 16)])
def test_the_plan_counts_the_staging_buffers_transfer_allocates(window, page):
    heads, dim = 2, 8
    pool = torch.zeros(4, page, heads, dim, dtype=torch.bfloat16)
    cfg = StreamingConfig(window_tokens=window, page_tokens=page)
    p = plan(cfg, q_heads=4, kv_heads=heads, head_size=dim, dtype_bytes=2, max_tokens=64)
    t = Transfer(GpuLikeMedium(torch.device("cpu")))
    assert t.reserve(pool, window) == p.staging
    held = [b.data_ptr() for pair in t._staging.values() for bufs in pair for b in bufs]
    # the windows of a long history come through the reserved buffers: nothing more allocated
    pages = list(range(4)) * 40
    for _ in t.windows(pool, pool, pages, len(pages) * page - 5, window):
        pass
    assert [b.data_ptr() for pair in t._staging.values() for bufs in pair for b in bufs] == held


def test_the_default_window_is_sized_in_bytes():
    """window_mib (default 256, the floor bench's) of K+V per layer-window, in whole pages, capped
    at max_model_len; a reference-path layer's at 1024 tokens; window_tokens, where set, for every
    layer; the two together, or either not positive, refused."""
    cfg = StreamingConfig.from_extra({})
    assert cfg.window_tokens is None and cfg.window_mib == DEFAULT_WINDOW_MIB == 256
    llama8b = 2 * 8 * 128 * 2  # K+V bytes of a token of one layer: 8 KV heads x 128, bf16
    assert cfg.window(llama8b) == 65536  # 16 windows per layer at 1M tokens
    assert cfg.window(llama8b, max_model_len=10_000) == 10_016  # max_model_len in whole pages
    assert cfg.window(llama8b, reference=True) == 1024
    assert cfg.window(llama8b, max_model_len=300, reference=True) == 320
    assert StreamingConfig.from_extra({"window_mib": 64}).window(llama8b) == 16384
    assert StreamingConfig(window_mib=0.001).window(llama8b) == 32  # at least one page
    explicit = StreamingConfig.from_extra({"window_tokens": 100})
    assert explicit.window(llama8b, max_model_len=50, reference=True) == 100
    with pytest.raises(ValueError, match="set window_tokens or window_mib, not both"):
        StreamingConfig.from_extra({"window_tokens": 64, "window_mib": 64})
    with pytest.raises(ValueError, match="window_mib must be a positive number"):
        StreamingConfig.from_extra({"window_mib": 0})
    with pytest.raises(ValueError, match="window_tokens must be positive"):
        StreamingConfig.from_extra({"window_tokens": -1})


def test_the_plan_grows_with_the_step_and_the_reference_path():
    cfg = StreamingConfig(window_tokens=1024)
    kw = dict(q_heads=8, kv_heads=2, head_size=64, dtype_bytes=2)
    small, big = plan(cfg, max_tokens=256, **kw), plan(cfg, max_tokens=2048, **kw)
    assert small.staging == big.staging and big.attention > 7 * small.attention
    ref = plan(cfg, max_tokens=256, reference=True, **kw)
    assert ref.reference == 3 * 8 * 256 * 1024 * 4 and ref.total == small.total + ref.reference
    fixed = plan(StreamingConfig(window_tokens=1024, device_scratch_mib=64), max_tokens=256, **kw)
    assert fixed.total == 64 * MIB and fixed.estimate == small.total
    assert "device_scratch_mib" in fixed.describe() and "staging" in small.describe()
    # sized in bytes: 256 MiB of 512-byte tokens, capped at max_model_len; the reference path's
    # window (its scores grow with it) at 1024 tokens, staging buffers included
    default = plan(StreamingConfig(), max_tokens=256, max_model_len=100_000, **kw)
    assert default.window == 100_000 and "100000-token windows" in default.describe()
    assert default.staging == 2 * 2 * (100_000 + 32) * 2 * 64 * 2
    ref = plan(StreamingConfig(), max_tokens=256, max_model_len=100_000, reference=True, **kw)
    assert ref.window == 1024 and ref.staging == small.staging


def _engine_config(**extra):
    from kvstack.testbed.tiny_models import llm_kwargs
    from vllm.engine.arg_utils import EngineArgs

    kw = llm_kwargs("llama4", tiny_model("llama4"), enable_prefix_caching=False,
                    max_num_batched_tokens=512)
    kw["kv_transfer_config"] = streaming_transfer_config(**extra)
    kw = {k: v for k, v in kw.items() if k in EngineArgs.__dataclass_fields__}
    with env(VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE="1"):
        return EngineArgs(**kw).create_engine_config()


@pytest.fixture(scope="module")
def vllm_config():
    return _engine_config(window_tokens=256, page_tokens=32)


def test_plan_for_an_engine_and_the_connectors_answer(vllm_config):
    from kvstack.streaming import StreamingConnector

    m, par = vllm_config.model_config, vllm_config.parallel_config
    p = plan_for(vllm_config)
    expect = plan(StreamingConfig(window_tokens=256, page_tokens=32),
                  q_heads=m.get_num_attention_heads(par), kv_heads=m.get_num_kv_heads(par),
                  head_size=m.get_head_size(), dtype_bytes=m.dtype.itemsize, max_tokens=512)
    assert p == expect and p.configured is None and p.total > 0
    assert StreamingConnector.get_device_scratch_bytes(vllm_config) == p.total
    # the default window: 256 MiB, capped at this engine's max_model_len
    default = plan_for(_engine_config(page_tokens=32))
    assert default.window == -(-m.max_model_len // 32) * 32 < 256 * MIB // (
        2 * m.get_num_kv_heads(par) * m.get_head_size() * m.dtype.itemsize)


def test_device_scratch_mib_replaces_the_estimate_and_is_refused_below_the_staging():
    from kvstack.streaming.validate import check_engine

    ok = _engine_config(window_tokens=256, device_scratch_mib=8)
    assert plan_for(ok).total == 8 * MIB and problems(ok) == []
    low = _engine_config(window_tokens=256, device_scratch_mib=0.001)
    with pytest.raises(ValueError, match=r"device_scratch_mib=0\.001 is below the windowed path's "
                                         r"two staging buffers .* at windows of 256 tokens"):
        check_engine(low)
    with pytest.raises(ValueError, match="device_scratch_mib must be a positive number"):
        StreamingConfig.from_extra({"device_scratch_mib": 0})


def test_the_patched_gpu_worker_takes_the_connectors_scratch_out(vllm_config, caplog):
    """Worker._kv_connector_device_scratch (the gpu_worker patch), called with this engine's real
    configuration: the connector's scratch, logged with the KV cache memory before and after; 0
    without a connector. determine_available_memory subtracts it (run on a GPU by the check)."""
    import copy
    import inspect

    from vllm.v1.worker.gpu_worker import Worker

    src = inspect.getsource(Worker.determine_available_memory)
    assert "self._kv_connector_device_scratch(" in src
    assert src.index("_kv_connector_device_scratch(") < src.index("Available KV cache memory")

    class Host:  # the Worker's one attribute the method reads
        def __init__(self, cfg):
            self.vllm_config = cfg

    total = plan_for(vllm_config).total
    with caplog.at_level(logging.INFO):
        got = Worker._kv_connector_device_scratch(Host(vllm_config), 10 * total)
    assert got == total
    assert f"{total} bytes" in caplog.text and f"{10 * total} -> {9 * total} bytes" in caplog.text
    bare = copy.copy(vllm_config)
    bare.kv_transfer_config = None
    assert Worker._kv_connector_device_scratch(Host(bare), 1 << 30) == 0


def test_multi_connector_sums_its_childrens_scratch(vllm_config):
    import copy

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    child = streaming_transfer_config(window_tokens=256, page_tokens=32)
    multi = copy.copy(vllm_config)
    multi.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": child.kv_connector, "kv_role": "kv_both",
             "kv_connector_module_path": child.kv_connector_module_path,
             "kv_connector_extra_config": child.kv_connector_extra_config},
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}]})
    assert KVConnectorBase_V1.get_device_scratch_bytes(vllm_config) == 0
    assert MultiConnector.get_device_scratch_bytes(multi) == plan_for(vllm_config).total
    assert isinstance(plan_for(vllm_config), ScratchPlan)
