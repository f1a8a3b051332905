"""Cases for the [2/N a] connector patch (K/V packed into the content dim), run by
test_transfer_topology_packed.py in a subprocess: `python -m pytest connector_cases.py`.

Not collected by the outer test run (the name does not start with `test_`). When
KVSTACK_CONNECTOR_OVERLAY names a folder, every `vllm/...py` file in it replaces the
installed module of the same name (a meta-path finder installed before vLLM is imported),
so the patched connector files are tested without touching the shared venv.

Everything runs on CPU with real tensors: the packed cache
(num_blocks, num_kv_heads, block_size, 2 * head_size) in both physical orders (HND: as
is; NHD: allocated (num_blocks, block_size, num_kv_heads, 2 * head_size) and permuted),
and vLLM 0.25.1's 5-D layouts, which must keep their old regions.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_OVERLAY = os.environ.get("KVSTACK_CONNECTOR_OVERLAY")


class _OverlayFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("vllm."):
            return None
        candidate = self.root / (fullname.replace(".", "/") + ".py")
        if candidate.is_file():
            return importlib.util.spec_from_file_location(fullname, candidate)
        return None


if _OVERLAY:
    assert not any(m.startswith("vllm.distributed") for m in sys.modules), "overlay too late"
    sys.meta_path.insert(0, _OverlayFinder(Path(_OVERLAY)))

from collections import defaultdict  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest.mock import MagicMock, patch  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE = 6, 16, 4, 8
DTYPE = torch.float16
ELEM = 2
BLOCK_BYTES = NUM_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * ELEM
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS,
                         head_size=HEAD_SIZE, dtype=DTYPE)


def test_overlay_is_in_use():
    """The patched module is the one under test (installed one if the series is applied)."""
    assert hasattr(kv_utils, "classify_kv_cache_layout"), kv_utils.__file__
    if _OVERLAY:
        assert kv_utils.__file__.startswith(_OVERLAY), kv_utils.__file__


# ---- backends and tensors -----------------------------------------------------------------


class PackedBackend:
    """Declares the standardized layout, like the pending triton_attn patch."""

    @staticmethod
    def get_name():
        return "PACKED_TEST"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


class BlocksFirstBackend(PackedBackend):  # 0.25.1 flash_attn / triton_attn / flashinfer
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class KVFirstBackend(PackedBackend):  # 0.25.1 rocm_attn
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class TokenMajorBackend(PackedBackend):  # unknown: (blocks, tokens, heads, head_size)
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, block_size, num_kv_heads, head_size)


class HeadGroupBackend(PackedBackend):  # unknown here: (blocks, 2*heads, tokens, dim)
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, 2 * num_kv_heads, block_size, head_size)


class ThreeDimBackend(PackedBackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, block_size, head_size)


def packed_cache(order: str, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """Logical (B, H, N, 2D); physical HND (as is) or NHD (tokens before heads)."""
    if order == "HND":
        t = torch.randn(num_blocks, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE).to(DTYPE)
    else:
        t = torch.randn(num_blocks, BLOCK_SIZE, NUM_HEADS, 2 * HEAD_SIZE).to(DTYPE)
        t = t.permute(0, 2, 1, 3)
    assert t.shape == (num_blocks, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return t


def topo(backend, *, is_mla=False, is_mamba=False, tensor_shape=None) -> TransferTopology:
    return TransferTopology(
        tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, engine_id="local", is_mla=is_mla,
        is_mamba=is_mamba, total_num_kv_heads=NUM_HEADS, attn_backends=[backend],
        tensor_shape=tensor_shape)


def real_backend(name: str):
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        return CPUAttentionBackend
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
    return RocmAttentionBackend


# ---- TransferTopology -----------------------------------------------------------------


@pytest.mark.parametrize("backend, kind", [
    (PackedBackend, "packed"), (BlocksFirstBackend, "blocks_first"),
    (KVFirstBackend, "kv_first"),
])
def test_topology_layout_kind(backend, kind):
    t = topo(backend)
    assert t.kv_cache_layout_kind == kind
    assert t.is_kv_packed == (kind == "packed")
    assert t.is_kv_layout_blocks_first == (kind != "kv_first")


def test_topology_packed_properties():
    t = topo(PackedBackend)
    assert t.is_kv_layout_blocks_first
    assert not t.split_k_and_v
    assert not t.virtually_split_kv_in_blocks
    assert not t.split_attn_blocks_into_kv_halves


def test_topology_legacy_properties_unchanged():
    """vLLM 0.25.1 semantics for the 5-D layouts."""
    bf = topo(BlocksFirstBackend)
    assert bf.virtually_split_kv_in_blocks and bf.split_attn_blocks_into_kv_halves
    assert not bf.split_k_and_v
    kf = topo(KVFirstBackend)
    assert kf.split_k_and_v and not kf.virtually_split_kv_in_blocks
    assert not kf.split_attn_blocks_into_kv_halves
    mla = topo(ThreeDimBackend, is_mla=True)
    assert mla.kv_cache_layout_kind == "mla"
    assert not mla.split_k_and_v and not mla.virtually_split_kv_in_blocks


@pytest.mark.parametrize("name, kind", [("CPU_ATTN", "packed"), ("FLASH_ATTN", "blocks_first"),
                                        ("ROCM_ATTN", "kv_first")])
def test_topology_real_backends(name, kind):
    """Installed 0.25.1 backends: FA (B,2,...), ROCm (2,B,...), CPU (B,H,N,2D)."""
    assert topo(real_backend(name)).kv_cache_layout_kind == kind


@pytest.mark.parametrize("backend", [TokenMajorBackend, HeadGroupBackend, ThreeDimBackend])
def test_topology_refuses_unknown_layout(backend):
    with pytest.raises(ValueError, match="Unsupported KV cache layout"):
        topo(backend)


def test_topology_refuses_unknown_4d_layout_with_mamba():
    with pytest.raises(ValueError, match="Unsupported KV cache layout"):
        topo(TokenMajorBackend, is_mamba=True)


def test_topology_hybrid_mamba():
    """Hybrid models: packed attention is not split in halves, Mamba still is; a legacy
    5-D attention backend keeps 0.25.1's blocks-first handling."""
    t = topo(PackedBackend, is_mamba=True)
    assert t.is_kv_packed and t.virtually_split_kv_in_blocks
    assert not t.split_attn_blocks_into_kv_halves
    legacy = topo(BlocksFirstBackend, is_mamba=True)
    assert legacy.kv_cache_layout_kind == "blocks_first"
    assert legacy.virtually_split_kv_in_blocks and legacy.split_attn_blocks_into_kv_halves


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_regions_packed_one_per_layer(order):
    cache = packed_cache(order)
    regions = topo(PackedBackend).get_transfer_cache_regions(cache, SPEC)
    assert isinstance(regions, list) and len(regions) == 1
    (region,) = regions
    assert region.data_ptr() == cache.data_ptr()
    assert region.shape[0] == NUM_BLOCKS
    assert region.stride(0) * region.element_size() == BLOCK_BYTES == SPEC.page_size_bytes
    assert region.untyped_storage().nbytes() == NUM_BLOCKS * BLOCK_BYTES


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_regions_packed_hybrid_never_transposed(num_blocks):
    """0.25.1 transposes a hybrid cache whose dim 0 is 2; a packed cache with 2 blocks
    must stay as is."""
    cache = packed_cache("HND", num_blocks)
    (region,) = topo(PackedBackend, is_mamba=True).get_transfer_cache_regions(cache, SPEC)
    assert region.shape == cache.shape and region.stride() == cache.stride()


def test_regions_legacy_5d_unchanged():
    kf = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    regions = topo(KVFirstBackend).get_transfer_cache_regions(kf, SPEC)
    assert [r.data_ptr() for r in regions] == [kf[0].data_ptr(), kf[1].data_ptr()]
    bf = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    regions = topo(BlocksFirstBackend).get_transfer_cache_regions(bf, SPEC)
    assert len(regions) == 1 and regions[0] is bf


def test_regions_refuse_mixed_layouts():
    with pytest.raises(ValueError, match="mixing KV cache layouts"):
        topo(KVFirstBackend).get_transfer_cache_regions(packed_cache("HND"), SPEC)
    with pytest.raises(ValueError, match="mixing KV cache layouts"):
        topo(BlocksFirstBackend).get_transfer_cache_regions(packed_cache("NHD"), SPEC)
    bf = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    with pytest.raises(ValueError, match="mixing KV cache layouts"):
        topo(PackedBackend).get_transfer_cache_regions(bf, SPEC)


def test_regions_mamba_unchanged():
    conv = torch.zeros(NUM_BLOCKS, 3, 4)
    ssm = torch.zeros(NUM_BLOCKS, 2, 4, 4)
    spec = MambaSpec(block_size=BLOCK_SIZE, shapes=((3, 4), (2, 4, 4)),
                     dtypes=(torch.float32, torch.float32))
    for backend in (PackedBackend, BlocksFirstBackend):
        regions = topo(backend, is_mamba=True).get_transfer_cache_regions([conv, ssm], spec)
        assert len(regions) == 1 and regions[0] is conv


# ---- NIXL: register_kv_caches on a worker without NIXL -----------------------------------


def nixl_worker(backend, kv_caches, *, layout="HND", **overrides):
    """A NIXL worker (no NIXL: the wrapper is a mock) after register_kv_caches(kv_caches);
    `overrides` replace its attributes (e.g. a hybrid model's specs)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    w = object.__new__(bw.NixlBaseConnectorWorker)
    layer_names = list(kv_caches)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names, SPEC)])
    attrs = dict(
        tp_rank=0, world_size=1, block_size=BLOCK_SIZE, engine_id="local", use_mla=False,
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: NUM_HEADS),
        attn_backends=[backend], backend_name=backend.get_name(), _has_mamba=False,
        use_host_buffer=False, vllm_config=None, kv_cache_config=config,
        _layer_specs={n: SPEC for n in layer_names}, _physical_blocks_per_logical_kv_block=1,
        _logical_num_blocks=NUM_BLOCKS, num_blocks=NUM_BLOCKS, block_len_per_layer=[],
        _region_is_mla=[], kv_caches_base_addr=defaultdict(dict), device_id=0,
        nixl_wrapper=MagicMock(), nixl_memory_type="DRAM", nixl_backends=["UCX"],
        _registered_descs=[], dst_num_blocks={}, src_xfer_handles_by_block_size={},
        _mamba_ssm_size=(0, 0), kv_cache_layout=layout, num_regions=0,
        _group_spec_types=[type(SPEC)], compat_hash=None, host_xfer_buffers={},
        kv_buffer_device="cpu",
    )
    attrs.update(overrides)
    for k, v in attrs.items():
        setattr(w, k, v)
    w.nixl_wrapper.get_agent_metadata.return_value = b"agent"
    with patch.object(bw, "compute_nixl_compatibility_hash", return_value="hash") as h:
        w.register_kv_caches(kv_caches)
    (_cfg, w.hashed_backend_name, _cross), _ = h.call_args
    return w


def reg_descs(w):
    (caches_data, _mem), _ = w.nixl_wrapper.get_reg_descs.call_args
    return list(caches_data)


def xfer_descs(w):
    (blocks_data, _mem), _ = w.nixl_wrapper.get_xfer_descs.call_args
    return [tuple(int(x) for x in row) for row in blocks_data]


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_nixl_packed_one_region_per_layer(order):
    a, b = packed_cache(order), packed_cache(order)
    w = nixl_worker(PackedBackend, {"layer0": a, "layer1": b, "layer2": a}, layout=order)
    # one region per distinct layer tensor: base = data_ptr, length = the whole tensor
    assert [(base, length) for base, length, _dev, _ in reg_descs(w)] == [
        (a.data_ptr(), NUM_BLOCKS * BLOCK_BYTES), (b.data_ptr(), NUM_BLOCKS * BLOCK_BYTES)]
    assert w.block_len_per_layer == [a.stride(0) * ELEM] * 2 == [BLOCK_BYTES] * 2
    assert w.num_regions == 2 and w.num_descs == 2 * NUM_BLOCKS
    # one descriptor per block, whole block (no K/V halves)
    expected = [(t.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, 0)
                for t in (a, b) for i in range(NUM_BLOCKS)]
    assert xfer_descs(w) == expected
    assert w.get_backend_aware_kv_block_len(0) == BLOCK_BYTES
    # a packed peer never handshakes with a 5-D peer of the same backend
    assert w.hashed_backend_name == "PACKED_TEST/packed_kv"


def test_nixl_legacy_blocks_first_unchanged():
    """0.25.1 FlashAttention (B, 2, N, H, D): one region per layer, K and V halves."""
    backend = real_backend("FLASH_ATTN")
    a = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE),
                    dtype=DTYPE)
    w = nixl_worker(backend, {"layer0": a})
    assert [(base, length) for base, length, _d, _ in reg_descs(w)] == [
        (a.data_ptr(), NUM_BLOCKS * BLOCK_BYTES)]
    assert w.num_regions == 2
    half = BLOCK_BYTES // 2
    expected = ([(a.data_ptr() + i * BLOCK_BYTES, half, 0) for i in range(NUM_BLOCKS)]
                + [(a.data_ptr() + i * BLOCK_BYTES + half, half, 0) for i in range(NUM_BLOCKS)])
    assert xfer_descs(w) == expected
    assert w.hashed_backend_name == backend.get_name()


def test_nixl_legacy_kv_first_unchanged():
    """0.25.1 ROCm attention (2, B, N, H, D): K and V registered as two regions."""
    backend = real_backend("ROCM_ATTN")
    a = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE),
                    dtype=DTYPE)
    w = nixl_worker(backend, {"layer0": a})
    half_tensor = NUM_BLOCKS * BLOCK_BYTES // 2
    assert [(base, length) for base, length, _d, _ in reg_descs(w)] == [
        (a[0].data_ptr(), half_tensor), (a[1].data_ptr(), half_tensor)]
    assert w.num_regions == 2


def test_nixl_refuses_unknown_layout():
    a = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    with pytest.raises(ValueError, match="Unsupported KV cache layout"):
        nixl_worker(TokenMajorBackend, {"layer0": a})


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_nixl_packed_host_buffer(order):
    """Host transfer buffer (accelerators NIXL cannot register) keeps the logical
    packed shape and the physical order of the device layout."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    w = object.__new__(bw.NixlBaseConnectorWorker)
    w.use_mla = False
    w.kv_cache_layout = order
    w.host_buffer_kv_cache_layout = order
    w.vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        enable_permute_local_kv=False))
    cache = packed_cache(order)
    w.initialize_host_xfer_buffer({"layer0": cache})
    buf = w.host_xfer_buffers["layer0"]
    assert buf.device.type == "cpu" and buf.shape == cache.shape
    assert buf.stride() == cache.stride()


# ---- Mooncake -------------------------------------------------------------------------


def mooncake_worker(backend, kv_caches):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    w = object.__new__(mc.MooncakeConnectorWorker)
    names = list(kv_caches)
    attrs = dict(
        use_mla=False, transfer_topo=topo(backend), _layer_specs={n: SPEC for n in names},
        _layer_group_indices={n: 0 for n in names}, engine=MagicMock(), is_kv_consumer=True,
        is_kv_producer=True, async_zmq_ctx=MagicMock(),  # what shutdown() touches
    )
    for k, v in attrs.items():
        setattr(w, k, v)
    w.engine.batch_register_memory.return_value = 0
    w.register_kv_caches(kv_caches)
    return w


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_mooncake_packed_one_region_per_layer(order):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    caches = {"model.layers.0.attn": packed_cache(order),
              "model.layers.1.attn": packed_cache(order)}
    w = mooncake_worker(PackedBackend, caches)
    assert w.kv_caches_base_addr == [c.data_ptr() for c in caches.values()]
    assert w.block_len_per_layer == [BLOCK_BYTES] * 2
    assert w.kv_block_len_per_layer == [BLOCK_BYTES] * 2  # whole block, no K/V halves
    (ptrs, lens), _ = w.engine.batch_register_memory.call_args
    assert lens == [NUM_BLOCKS * BLOCK_BYTES] * 2
    regions = w._get_transfer_regions(
        w.kv_caches_base_addr, w.block_len_per_layer, w.kv_block_len_per_layer,
        w.registered_layer_names, w.registered_layer_indices)
    assert [(r.base_addr, r.block_len, r.kv_block_len) for r in regions] == [
        (c.data_ptr(), BLOCK_BYTES, BLOCK_BYTES) for c in caches.values()]
    # same TP: a run of contiguous blocks is one copy
    assert mc._can_coalesce_block_transfers(BLOCK_BYTES, BLOCK_BYTES, 0, 0, BLOCK_BYTES)


def test_mooncake_legacy_blocks_first_unchanged():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    a = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    w = mooncake_worker(BlocksFirstBackend, {"model.layers.0.attn": a})
    assert w.block_len_per_layer == [BLOCK_BYTES]
    assert w.kv_block_len_per_layer == [BLOCK_BYTES // 2]
    regions = w._get_transfer_regions(
        w.kv_caches_base_addr, w.block_len_per_layer, w.kv_block_len_per_layer,
        w.registered_layer_names, w.registered_layer_indices)
    assert [r.base_addr for r in regions] == [a.data_ptr(), a.data_ptr() + BLOCK_BYTES // 2]
    assert not mc._can_coalesce_block_transfers(BLOCK_BYTES, BLOCK_BYTES, 0, 0,
                                                BLOCK_BYTES // 2)


def test_mooncake_legacy_kv_first_unchanged():
    a = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    w = mooncake_worker(KVFirstBackend, {"model.layers.0.attn": a})
    assert w.kv_caches_base_addr == [a[0].data_ptr(), a[1].data_ptr()]
    assert w.block_len_per_layer == [BLOCK_BYTES // 2] * 2


# ---- MoRI-IO layout -------------------------------------------------------------------


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_moriio_packed_geometry(order):
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_layout as ml

    cache = packed_cache(order)
    specs = {"layer0": SPEC}
    g = ml.get_layer_transfer_geometry("layer0", cache, specs)
    assert (g.num_blocks, g.block_size, g.block_len, g.transfers_per_block,
            g.regions_per_block, g.split_kv_regions) == (
        NUM_BLOCKS, BLOCK_SIZE, BLOCK_BYTES, 1, 1, False)
    assert g.block_stride * ELEM == BLOCK_BYTES
    ((region, length),) = ml.iter_layer_registration_regions("layer0", cache, specs)
    assert region.data_ptr() == cache.data_ptr() and length == NUM_BLOCKS * BLOCK_BYTES
    # contiguous blocks coalesce, a gap starts a new transfer
    local, remote, sizes = ml.compute_block_transfer_offsets(
        "layer0", cache, specs, [0, 1, 2, 4], [1, 2, 3, 5], NUM_BLOCKS)
    assert local == [0, 4 * BLOCK_BYTES]
    assert remote == [BLOCK_BYTES, 5 * BLOCK_BYTES]
    assert sizes == [3 * BLOCK_BYTES, BLOCK_BYTES]


def test_moriio_legacy_unchanged_and_unknown_refused():
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_layout as ml

    specs = {"layer0": SPEC}
    kf = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    g = ml.get_layer_transfer_geometry("layer0", kf, specs)
    assert g.split_kv_regions and g.transfers_per_block == 2
    assert len(ml.iter_layer_registration_regions("layer0", kf, specs)) == 2
    bad = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    with pytest.raises(ValueError, match="Unsupported MoRIIO"):
        ml.get_layer_transfer_geometry("layer0", bad, specs)


# ---- Offloading worker registration (no patch needed: whole blocks as byte pages) ----------


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_offloading_packed_registration(order):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    caches = {"layer0": packed_cache(order), "layer1": packed_cache(order)}
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=NUM_BLOCKS * BLOCK_BYTES, shared_by=[n])
                          for n in caches],
        kv_cache_groups=[KVCacheGroupSpec(list(caches), SPEC)])
    got = {}
    spec = SimpleNamespace(kv_cache_config=config,
                           get_worker=lambda kv: got.setdefault("kv", kv) and MagicMock())
    OffloadingConnectorWorker(spec).register_kv_caches(caches)
    tensors = got["kv"].tensors
    assert len(tensors) == 2
    for canon, cache in zip(tensors, caches.values()):
        assert canon.tensor.data_ptr() == cache.data_ptr()
        assert tuple(canon.tensor.shape) == (NUM_BLOCKS, BLOCK_BYTES)
        assert canon.tensor.stride() == (BLOCK_BYTES, 1)
        assert canon.page_size_bytes == BLOCK_BYTES


# ---- Hybrid models: the backend list vLLM really builds (Mamba/GDN backend first) --------
#
# get_current_attn_backends() lists the distinct backends of every AttentionLayerBase in
# layer order. In Qwen3-Next (GDN), Nemotron-H (Mamba2) and Jamba (Mamba1) the first layer is
# a Mamba-like one, so the list starts with a backend that has no get_kv_cache_shape
# (NotImplementedError); the attention backend comes after it. test_bind_kv_cache's end-to-end
# run checks that order on the tiny Qwen3-Next engine.

HYBRID_MAMBA = {  # model family -> its Mamba-like backend (vLLM 0.25.1's own classes)
    "qwen3next": ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionBackend"),
    "nemotron_h": ("vllm.v1.attention.backends.mamba2_attn", "Mamba2AttentionBackend"),
    "jamba": ("vllm.v1.attention.backends.mamba1_attn", "Mamba1AttentionBackend"),
}


def mamba_backend(family: str):
    import importlib

    module, name = HYBRID_MAMBA[family]
    return getattr(importlib.import_module(module), name)


def hybrid_topo(backends) -> TransferTopology:
    return TransferTopology(
        tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, engine_id="local", is_mla=False,
        is_mamba=True, total_num_kv_heads=NUM_HEADS, attn_backends=list(backends),
        tensor_shape=None)


def hybrid_spec(page_bytes: int = BLOCK_BYTES) -> MambaSpec:
    """A GDN-like state pair padded to the attention page, as the hybrid allocator does."""
    return MambaSpec(block_size=BLOCK_SIZE, shapes=((3, 16), (2, 8)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=page_bytes)


HYBRID_CONV_BYTES, HYBRID_SSM_BYTES = 3 * 16 * 2, 2 * 8 * 4


def hybrid_mamba_views(raw: torch.Tensor, spec: MambaSpec) -> list[torch.Tensor]:
    """The [conv, ssm] views vLLM 0.25.1's runner builds over a layer's raw int8 pages."""
    views, offset = [], 0
    page = spec.page_size_bytes
    num_blocks = raw.numel() // page
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        size = torch.empty((), dtype=dtype).element_size()
        inner = torch.empty(shape).stride()
        views.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape),
                                      (page // size, *inner), offset // size))
        offset += torch.Size(shape).numel() * size
    return views


@pytest.mark.parametrize("family", sorted(HYBRID_MAMBA))
def test_topology_hybrid_real_backends_mamba_first(family):
    """The layout comes from the attention backends, not from the Mamba backend listed first
    (which cannot answer get_kv_cache_shape)."""
    mamba = mamba_backend(family)
    with pytest.raises(NotImplementedError):
        mamba.get_kv_cache_shape(1, 16, 1, 1)
    packed = hybrid_topo([mamba, real_backend("CPU_ATTN")])
    assert packed.kv_cache_layout_kind == "packed" and packed.is_kv_packed
    assert packed.virtually_split_kv_in_blocks and not packed.split_attn_blocks_into_kv_halves
    # a 0.25.1 5-D attention backend after it keeps 0.25.1's hybrid handling
    legacy = hybrid_topo([mamba, real_backend("FLASH_ATTN")])
    assert legacy.kv_cache_layout_kind == "blocks_first"
    assert legacy.split_attn_blocks_into_kv_halves
    # a Mamba-only model (no attention backend at all) is accepted, as before
    assert hybrid_topo([mamba]).kv_cache_layout_kind == "blocks_first"


@pytest.mark.parametrize("family", sorted(HYBRID_MAMBA))
def test_regions_hybrid_real_backends(family):
    t = hybrid_topo([mamba_backend(family), real_backend("CPU_ATTN")])
    cache = packed_cache("HND")
    assert t.get_transfer_cache_regions(cache, SPEC) == [cache]


def test_topology_refuses_attention_backends_that_disagree():
    """Two attention backends with different layouts cannot share one transfer plan: refused
    when the topology is built, whichever comes first (and whatever Mamba backend leads)."""
    for backends in ([PackedBackend, BlocksFirstBackend], [BlocksFirstBackend, PackedBackend]):
        with pytest.raises(ValueError, match="mixing KV cache layouts"):
            TransferTopology(
                tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, engine_id="local", is_mla=False,
                is_mamba=False, total_num_kv_heads=NUM_HEADS, attn_backends=backends)
    with pytest.raises(ValueError, match="mixing KV cache layouts"):
        hybrid_topo([mamba_backend("qwen3next"), real_backend("CPU_ATTN"),
                     real_backend("FLASH_ATTN")])
    # the same backend twice (e.g. two layer types on one backend) is one layout
    assert hybrid_topo([mamba_backend("qwen3next"), PackedBackend, real_backend("CPU_ATTN")]
                       ).kv_cache_layout_kind == "packed"


@pytest.mark.parametrize("family", sorted(HYBRID_MAMBA))
def test_nixl_hybrid_real_backends(family):
    """NIXL registration of a hybrid model with the backend list vLLM builds for it: attention
    and Mamba layers share one pooled tensor (one region), the packed attention view is one
    whole-block descriptor per block, the Mamba view ([conv, ssm] at this patch) conv and ssm
    descriptors at their offsets in the page."""
    spec = hybrid_spec()
    raw = torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int8)
    attn = raw.view(DTYPE).view(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    mamba_name, attn_name = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
    caches = {mamba_name: hybrid_mamba_views(raw, spec), attn_name: attn}
    specs = {mamba_name: spec, attn_name: SPEC}
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=raw.numel(), shared_by=list(caches))],
        kv_cache_groups=[KVCacheGroupSpec([mamba_name], spec),
                         KVCacheGroupSpec([attn_name], SPEC)])
    backend = real_backend("CPU_ATTN")
    w = nixl_worker(
        mamba_backend(family), caches, attn_backends=[mamba_backend(family), backend],
        _has_mamba=True, kv_cache_config=config, _layer_specs=specs,
        _group_spec_types=[MambaSpec, type(SPEC)],
        _mamba_ssm_size=(HYBRID_CONV_BYTES, HYBRID_SSM_BYTES),
        _conv_decomp=SimpleNamespace(local_conv_offsets=[(0, HYBRID_CONV_BYTES)]))
    assert w.transfer_topo.is_kv_packed
    assert [(base, length) for base, length, _dev, _ in reg_descs(w)] == [
        (raw.data_ptr(), NUM_BLOCKS * BLOCK_BYTES)]
    assert w.block_len_per_layer == [BLOCK_BYTES] and w.num_regions == 1
    base = raw.data_ptr()
    whole = [(base + b * BLOCK_BYTES, BLOCK_BYTES, 0) for b in range(NUM_BLOCKS)]
    conv = [(base + b * BLOCK_BYTES, HYBRID_CONV_BYTES, 0) for b in range(NUM_BLOCKS)]
    ssm = [(base + b * BLOCK_BYTES + HYBRID_CONV_BYTES, HYBRID_SSM_BYTES, 0)
           for b in range(NUM_BLOCKS)]
    assert xfer_descs(w) == whole + conv + ssm


@pytest.mark.parametrize("family", sorted(HYBRID_MAMBA))
def test_mooncake_hybrid_real_backends(family):
    """Mooncake registration of a hybrid model with the backend list vLLM builds for it: one
    region per layer, the packed attention block whole (never split into K/V halves)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    spec = hybrid_spec()
    raw = torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int8)
    attn = packed_cache("NHD")
    mamba_name, attn_name = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
    w = object.__new__(mc.MooncakeConnectorWorker)
    for k, v in dict(
            use_mla=False,
            transfer_topo=hybrid_topo([mamba_backend(family), real_backend("CPU_ATTN")]),
            _layer_specs={mamba_name: spec, attn_name: SPEC},
            _layer_group_indices={mamba_name: 0, attn_name: 1}, engine=MagicMock(),
            is_kv_consumer=True, is_kv_producer=True, async_zmq_ctx=MagicMock()).items():
        setattr(w, k, v)
    w.engine.batch_register_memory.return_value = 0
    w.register_kv_caches({mamba_name: hybrid_mamba_views(raw, spec), attn_name: attn})
    assert w.kv_caches_base_addr == [raw.data_ptr(), attn.data_ptr()]
    assert w.block_len_per_layer == [BLOCK_BYTES, BLOCK_BYTES]
    assert w.kv_block_len_per_layer == [BLOCK_BYTES, BLOCK_BYTES]  # whole blocks
