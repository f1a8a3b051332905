"""vLLM side of issue 5: LMCacheConnectorV1 supports the hybrid memory allocator (HMA).

The LMCache adapter is replaced by a recording fake, so these tests need no LMCache engine.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_connector as lmc  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)


class FakeAdapter:
    """Stands in for lmcache's LMCacheConnectorV1Impl and records what it receives."""

    instances: list["FakeAdapter"] = []
    group_index = None

    def __init__(self, vllm_config, role, parent):
        self.parent = parent
        self.seen_kv_cache_config = getattr(parent, "kv_cache_config", "MISSING")
        self.finished: list[tuple[str, list[int]]] = []
        if type(self).group_index is not None:
            self.kv_cache_group_index = type(self).group_index
        FakeAdapter.instances.append(self)

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return False, None


@pytest.fixture
def fake_adapter(monkeypatch):
    mod = types.ModuleType("lmcache.integration.vllm.vllm_v1_adapter")
    mod.LMCacheConnectorV1Impl = FakeAdapter
    monkeypatch.setitem(sys.modules, "lmcache.integration.vllm.vllm_v1_adapter", mod)
    FakeAdapter.instances.clear()
    FakeAdapter.group_index = None
    yield FakeAdapter


def _attn():
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def _mamba():
    return MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))


def _config(*specs):
    groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config():
    kv = SimpleNamespace(get_from_extra_config=lambda key, default=None: default)
    return SimpleNamespace(kv_transfer_config=kv)


def _connector(kv_cache_config):
    return lmc.LMCacheConnectorV1(_vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config)


def test_supports_hma_class_and_instance(fake_adapter):
    assert issubclass(lmc.LMCacheConnectorV1, SupportsHMA)
    assert supports_hma(lmc.LMCacheConnectorV1)
    assert supports_hma(_connector(_config(_attn())))


def test_factory_accepts_lmcache_with_hma():
    # The factory is what raised "does not support HMA"; it consults supports_hma on the class.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory._registry["LMCacheConnectorV1"]()
    assert supports_hma(cls)


def test_kv_cache_config_exposed_before_adapter(fake_adapter):
    cfg = _config(_mamba(), _attn())
    conn = _connector(cfg)
    assert conn.kv_cache_config is cfg
    # The adapter is built inside __init__ and already sees the attribute.
    assert fake_adapter.instances[-1].seen_kv_cache_config is cfg


def test_single_group_forwards_group_zero(fake_adapter):
    conn = _connector(_config(_attn()))
    req = SimpleNamespace(request_id="r1")
    assert conn.request_finished_all_groups(req, ([4, 5, 6],)) == (False, None)
    assert fake_adapter.instances[-1].finished == [("r1", [4, 5, 6])]


def test_hybrid_forwards_full_attention_group(fake_adapter):
    # Groups 0-2 are linear-attention (Mamba-like) state, group 3 is full attention.
    conn = _connector(_config(_mamba(), _mamba(), _mamba(), _attn()))
    assert conn.get_lmcache_kv_cache_group_index() == 3
    req = SimpleNamespace(request_id="r2")
    conn.request_finished_all_groups(req, ([1], [2], [3], [10, 11]))
    assert fake_adapter.instances[-1].finished == [("r2", [10, 11])]


def test_adapter_selected_group_wins(fake_adapter):
    fake_adapter.group_index = 1
    conn = _connector(_config(_attn(), _attn(), _mamba()))
    req = SimpleNamespace(request_id="r3")
    conn.request_finished_all_groups(req, ([1, 2], [7, 8, 9], [3]))
    assert fake_adapter.instances[-1].finished == [("r3", [7, 8, 9])]


@pytest.mark.parametrize("bad", [5, -1, "0", 1.0, True])
def test_invalid_selected_group_rejected(fake_adapter, bad):
    fake_adapter.group_index = bad
    conn = _connector(_config(_mamba(), _attn()))
    req = SimpleNamespace(request_id="r4")
    with pytest.raises(ValueError, match=r"LMCache selected KV cache group .* 2 KV cache group"):
        conn.request_finished_all_groups(req, ([1], [2]))
    assert fake_adapter.instances[-1].finished == []


def test_request_finished_single_group_unchanged(fake_adapter):
    conn = _connector(_config(_attn()))
    req = SimpleNamespace(request_id="r5")
    conn.request_finished(req, [9])
    assert fake_adapter.instances[-1].finished == [("r5", [9])]
