"""Cases for the [3/N] patch (bind_kv_cache, Mamba pages as one tensor), run by
test_bind_kv_cache.py in a subprocess: `python -m pytest bind_cases.py`.

Not collected by the outer test run (the name does not start with `test_`). When
KVSTACK_BIND_OVERLAY names a folder, every `vllm/...py` file in it replaces the installed
module of the same name (bind_worker's meta-path finder, installed before vLLM is imported),
so the files under test never touch the shared venv. test_bind_kv_cache.py runs them twice: on
the series up to [3/N], and on the files without the layout ladder (0.25.1's: the negative
control, where the [3/N] cases must fail).

Real CPU tensors; the reference for the Mamba views is vLLM 0.25.1's own construction
(bind_worker.reference_0251_views); only the transports are mocks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bind_worker  # noqa: E402

bind_worker.install_overlay()
os.environ.pop("KVSTACK_CONNECTOR_OVERLAY", None)  # connector_cases: helpers only, no 2nd finder

from collections.abc import Iterable  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest.mock import MagicMock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import connector_cases as cc  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

_OVERLAY = os.environ.get("KVSTACK_BIND_OVERLAY")
NUM_BLOCKS = cc.NUM_BLOCKS

# (state shapes, state dtypes, page padding in bytes): GDN-like (bf16 conv, fp32 ssm, page
# padded to an attention page), Mamba2-like with a size-1 dim, one state (short conv).
CONFIGS = {
    "gdn_padded": (((3, 256), (4, 32, 32)), (torch.bfloat16, torch.float32), 32768),
    "mamba2_unit_dim": (((8, 3), (2, 4, 1, 4)), (torch.float16, torch.float32), None),
    "short_conv": (((3, 16),), (torch.float32,), None),
}


def mamba_spec(config: str) -> MambaSpec:
    shapes, dtypes, padded = CONFIGS[config]
    return MambaSpec(block_size=cc.BLOCK_SIZE, shapes=shapes, dtypes=dtypes,
                     page_size_padded=padded)


class TinyMamba(MambaBase):
    """A Mamba layer with the given states (only what bind_kv_cache uses)."""

    def __init__(self, shapes: Iterable[tuple[int, ...]], dtypes: tuple[torch.dtype, ...]):
        self._shapes, self._dtypes = tuple(shapes), tuple(dtypes)

    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return self._dtypes

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.GDN_ATTN


class TinyAttention(AttentionLayerBase):
    def get_attn_backend(self):
        return cc.PackedBackend

    def get_kv_cache_spec(self, vllm_config):
        return cc.SPEC


def runner_reshape(raw: dict[str, torch.Tensor], specs: dict[str, MambaSpec]) -> dict:
    """Call the (patched) GPUModelRunner._reshape_kv_cache_tensors, inherited by the CPU runner,
    on Mamba-only groups: the runner's own code, minus the engine."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    groups = [SimpleNamespace(kv_cache_spec=spec, backend=None, kv_cache_group_id=i,
                              layer_names=[name]) for i, (name, spec) in enumerate(specs.items())]
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[],
                           kv_cache_tensors=[KVCacheTensor(size=raw[n].numel(), shared_by=[n])
                                             for n in specs])
    fake = SimpleNamespace(kv_cache_config=config, runner_only_attn_layers=set(),
                           _kv_cache_spec_attn_group_iterator=lambda: iter(groups))
    return GPUModelRunner._reshape_kv_cache_tensors(fake, raw, [cc.BLOCK_SIZE] * len(groups))


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype) == (
        b.data_ptr(), tuple(b.shape), b.stride(), b.dtype)


def test_overlay_is_in_use():
    import vllm.v1.worker.gpu_model_runner as gmr

    if _OVERLAY:
        assert gmr.__file__.startswith(_OVERLAY), gmr.__file__


# ---- the runner and bind_kv_cache --------------------------------------------------------


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_runner_keeps_one_page_tensor(config):
    spec = mamba_spec(config)
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = runner_reshape({"mamba": raw}, {"mamba": spec})["mamba"]
    assert isinstance(page, torch.Tensor), type(page).__name__
    assert tuple(page.shape) == (NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    assert page.dtype == torch.int8 and page.data_ptr() == raw.data_ptr()
    assert page.stride() == (spec.page_size_bytes,) * 3 + (1,)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_bound_views_identical_to_0251(config):
    """bind_kv_cache on the runner's page tensor gives 0.25.1's views: same data_ptr, shape,
    stride and dtype, state by state (page padding and a size-1 dim included)."""
    spec = mamba_spec(config)
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = runner_reshape({"mamba": raw}, {"mamba": spec})["mamba"]
    layer = TinyMamba(spec.shapes, spec.dtypes)
    layer.bind_kv_cache(page)
    ref = bind_worker.reference_0251_views(raw, spec)
    assert isinstance(layer.kv_cache, tuple) and len(layer.kv_cache) == len(ref)
    for got, want in zip(layer.kv_cache, ref):
        assert same_view(got, want), (got.data_ptr() - raw.data_ptr(), got.shape, got.stride(),
                                      want.data_ptr() - raw.data_ptr(), want.shape, want.stride())
    # the views alias the pages: a write through a state lands in its block's page
    layer.kv_cache[-1][2].fill_(1)
    assert page[2].count_nonzero() > 0 and page[1].count_nonzero() == 0


def test_mrv2_reshape_keeps_one_page_tensor():
    """Model runner V2 (`vllm/v1/worker/gpu/attn_utils.py`) builds the same page tensor."""
    from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache

    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    group = SimpleNamespace(kv_cache_spec=spec, backend=None, kv_cache_group_id=0,
                            layer_names=["mamba"])
    out = _reshape_kv_cache(attn_groups=[group], kv_cache_raw_tensors={"mamba": raw},
                            cache_dtype="auto", kernel_block_sizes=[cc.BLOCK_SIZE],
                            shared_kv_cache_layers={})
    page = out["mamba"]
    assert isinstance(page, torch.Tensor), type(page).__name__
    assert tuple(page.shape) == (NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    assert page.data_ptr() == raw.data_ptr()


def test_worker_bind_kv_cache_goes_through_the_layers():
    from vllm.v1.worker.utils import bind_kv_cache

    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    attn_cache = cc.packed_cache("HND")
    mamba, attn = TinyMamba(spec.shapes, spec.dtypes), TinyAttention()
    runner_list: list = []
    bind_kv_cache({"model.layers.0.linear_attn": page, "model.layers.1.self_attn.attn": attn_cache},
                  {"model.layers.0.linear_attn": mamba, "model.layers.1.self_attn.attn": attn},
                  runner_list)
    assert attn.kv_cache is attn_cache  # attention: the view as is
    assert runner_list[0] is page and runner_list[1] is attn_cache  # one tensor per layer
    for got, want in zip(mamba.kv_cache, bind_worker.reference_0251_views(raw, spec)):
        assert same_view(got, want)


def test_mamba_bind_refuses_other_caches():
    spec = mamba_spec("gdn_padded")
    layer = TinyMamba(spec.shapes, spec.dtypes)
    views = bind_worker.reference_0251_views(
        torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8), spec)
    with pytest.raises(TypeError):
        layer.bind_kv_cache(views)  # the 0.25.1 [conv, ssm] list
    with pytest.raises(TypeError):
        layer.bind_kv_cache(torch.zeros(NUM_BLOCKS, 1, 1, spec.page_size_bytes // 2,
                                        dtype=torch.float16))
    with pytest.raises(ValueError):  # page smaller than the states
        layer.bind_kv_cache(torch.zeros(NUM_BLOCKS, 1, 1, 1024, dtype=torch.int8))


# ---- transfer regions and connectors ----------------------------------------------------


def test_get_transfer_cache_regions_is_gone():
    assert not hasattr(kv_utils.TransferTopology, "get_transfer_cache_regions")


@pytest.mark.parametrize("backend", ["packed", "blocks_first", "CPU_ATTN"])
def test_mamba_layer_one_region(backend):
    """A Mamba layer is one region: base = page 0 (the conv view's data_ptr, what 0.25.1
    registered), block stride = the page, length = num_blocks pages."""
    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = runner_reshape({"mamba": raw}, {"mamba": spec})["mamba"]
    conv_0251 = bind_worker.reference_0251_views(raw, spec)[0]
    be = {"packed": cc.PackedBackend, "blocks_first": cc.BlocksFirstBackend}.get(backend)
    topo = cc.topo(be or cc.real_backend(backend), is_mamba=True)
    region = kv_utils.mamba_transfer_region(page, spec)
    assert region is page
    assert region.data_ptr() == conv_0251.data_ptr() == raw.data_ptr()
    assert region.stride(0) * region.element_size() == spec.page_size_bytes
    assert region.shape[0] * region.stride(0) == NUM_BLOCKS * spec.page_size_bytes
    # NIXL still splits a Mamba block into conv/ssm sub-regions from the spec
    assert topo.virtually_split_kv_in_blocks
    # the [conv, ssm] views are the same region (what vLLM 0.27's Mooncake registers)
    assert kv_utils.mamba_transfer_region(
        list(bind_worker.reference_0251_views(raw, spec)), spec).data_ptr() == raw.data_ptr()


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_attention_layer_one_region_in_hybrid(order):
    topo = cc.topo(cc.PackedBackend, is_mamba=True)
    cache = cc.packed_cache(order)
    regions = topo.attention_transfer_regions(cache)
    assert len(regions) == 1 and regions[0] is cache
    assert cache.stride(0) * cache.element_size() == cc.BLOCK_BYTES
    assert cache.untyped_storage().nbytes() == NUM_BLOCKS * cc.BLOCK_BYTES
    # the 0.25.1 5-D layouts keep their regions (here: K and V for (2, B, ...))
    kv_first = torch.zeros(2, NUM_BLOCKS, cc.BLOCK_SIZE, cc.NUM_HEADS, cc.HEAD_SIZE)
    assert len(cc.topo(cc.KVFirstBackend).attention_transfer_regions(kv_first)) == 2


def test_mooncake_hybrid_one_region_per_layer():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    attn = cc.packed_cache("HND")
    caches = {"model.layers.0.linear_attn": page, "model.layers.1.self_attn.attn": attn}
    specs = {"model.layers.0.linear_attn": spec, "model.layers.1.self_attn.attn": cc.SPEC}
    w = object.__new__(mc.MooncakeConnectorWorker)
    for k, v in dict(use_mla=False, transfer_topo=cc.topo(cc.PackedBackend, is_mamba=True),
                     _layer_specs=specs, _layer_group_indices={"model.layers.0.linear_attn": 0,
                                                               "model.layers.1.self_attn.attn": 1},
                     engine=MagicMock(), is_kv_consumer=True, is_kv_producer=True,
                     async_zmq_ctx=MagicMock()).items():
        setattr(w, k, v)
    w.engine.batch_register_memory.return_value = 0
    w.register_kv_caches(caches)
    assert w.kv_caches_base_addr == [raw.data_ptr(), attn.data_ptr()]
    assert w.block_len_per_layer == [spec.page_size_bytes, cc.BLOCK_BYTES]
    assert w.kv_block_len_per_layer == [spec.page_size_bytes, cc.BLOCK_BYTES]
    (_ptrs, lens), _ = w.engine.batch_register_memory.call_args
    assert lens == [NUM_BLOCKS * spec.page_size_bytes, NUM_BLOCKS * cc.BLOCK_BYTES]


def test_nixl_hybrid_one_region_per_layer():
    """NIXL on a hybrid model whose attention and Mamba layers share one KV cache tensor (the
    hybrid allocator's pooling): the tensor is one region (base, num_blocks pages), the packed
    attention view is one whole-block descriptor per block, and the Mamba view is split into
    conv and ssm descriptors at their offsets in the page, read off the spec."""
    from collections import defaultdict

    page_bytes = cc.BLOCK_BYTES  # hybrid pages are unified: the Mamba page padded to it
    spec = MambaSpec(block_size=cc.BLOCK_SIZE, shapes=((3, 16), (2, 8)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=page_bytes)
    conv_bytes, ssm_bytes = 3 * 16 * 2, 2 * 8 * 4
    raw = torch.zeros(NUM_BLOCKS * page_bytes, dtype=torch.int8)
    page = runner_reshape({"mamba": raw}, {"mamba": spec})["mamba"]
    attn = raw.view(torch.bfloat16).view(NUM_BLOCKS, cc.NUM_HEADS, cc.BLOCK_SIZE, 2 * cc.HEAD_SIZE)
    caches = {"model.layers.0.linear_attn": page, "model.layers.1.self_attn.attn": attn}
    specs = {"model.layers.0.linear_attn": spec, "model.layers.1.self_attn.attn": cc.SPEC}
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=raw.numel(), shared_by=list(caches))],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.linear_attn"], spec),
                         KVCacheGroupSpec(["model.layers.1.self_attn.attn"], cc.SPEC)])
    w = cc.nixl_worker(
        cc.PackedBackend, caches, _has_mamba=True, kv_cache_config=config, _layer_specs=specs,
        _group_spec_types=[MambaSpec, type(cc.SPEC)], _mamba_ssm_size=(conv_bytes, ssm_bytes),
        _conv_decomp=SimpleNamespace(local_conv_offsets=[(0, conv_bytes)]),
        kv_caches_base_addr=defaultdict(dict))
    assert [(base, length) for base, length, _dev, _ in cc.reg_descs(w)] == [
        (raw.data_ptr(), NUM_BLOCKS * page_bytes)]  # the shared tensor, once
    assert w.block_len_per_layer == [page_bytes] and w.num_regions == 1
    assert w.num_descs == NUM_BLOCKS
    base = raw.data_ptr()
    whole_blocks = [(base + b * page_bytes, page_bytes, 0) for b in range(NUM_BLOCKS)]
    conv = [(base + b * page_bytes, conv_bytes, 0) for b in range(NUM_BLOCKS)]
    ssm = [(base + b * page_bytes + conv_bytes, ssm_bytes, 0) for b in range(NUM_BLOCKS)]
    assert cc.xfer_descs(w) == whole_blocks + conv + ssm
    # the conv/ssm descriptors are where the layer's own bound views are
    layer = TinyMamba(spec.shapes, spec.dtypes)
    layer.bind_kv_cache(page)
    conv_view, ssm_view = layer.kv_cache
    assert conv_view.data_ptr() == base and ssm_view.data_ptr() == base + conv_bytes
    assert conv_view.stride(0) * conv_view.element_size() == page_bytes


def test_offloading_mamba_page():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS,
                           kv_cache_tensors=[KVCacheTensor(size=raw.numel(), shared_by=["m"])],
                           kv_cache_groups=[KVCacheGroupSpec(["m"], spec)])
    got = {}
    worker_spec = SimpleNamespace(kv_cache_config=config,
                                  get_worker=lambda kv: got.setdefault("kv", kv) and MagicMock())
    OffloadingConnectorWorker(worker_spec).register_kv_caches({"m": page})
    (canon,) = got["kv"].tensors
    assert canon.tensor.data_ptr() == raw.data_ptr()
    assert tuple(canon.tensor.shape) == (NUM_BLOCKS, spec.page_size_bytes)
    assert canon.tensor.stride() == (spec.page_size_bytes, 1)


# ---- hybrid models with the backend list vLLM builds (Mamba/GDN backend first) ------------


def real_packed_backend(name: str):
    """0.25.1's attention backends as the ladder leaves them (packed (B, H, N, 2D))."""
    if name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        return TritonAttentionBackend
    return cc.real_backend(name)  # CPU_ATTN, FLASH_ATTN


@pytest.mark.parametrize("family", sorted(cc.HYBRID_MAMBA))
@pytest.mark.parametrize("attn_backend", ["TRITON_ATTN", "FLASH_ATTN", "CPU_ATTN"])
def test_nixl_hybrid_real_backends(family, attn_backend):
    """NIXL registration of a hybrid model whose backend list starts with its Mamba-like
    backend (as get_current_attn_backends builds it for Qwen3-Next, Nemotron-H, Jamba): the
    layout comes from the attention backend, so the pooled tensor is one region, the packed
    attention view one whole-block descriptor per block, the Mamba page conv + ssm."""
    mamba_be, attn_be = cc.mamba_backend(family), real_packed_backend(attn_backend)
    assert len(attn_be.get_kv_cache_shape(1, 16, 1, 1)) == 4
    spec = cc.hybrid_spec()
    raw = torch.zeros(NUM_BLOCKS * cc.BLOCK_BYTES, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, cc.BLOCK_BYTES)
    attn = raw.view(cc.DTYPE).view(NUM_BLOCKS, cc.NUM_HEADS, cc.BLOCK_SIZE, 2 * cc.HEAD_SIZE)
    mamba_name, attn_name = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
    caches = {mamba_name: page, attn_name: attn}
    specs = {mamba_name: spec, attn_name: cc.SPEC}
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=raw.numel(), shared_by=list(caches))],
        kv_cache_groups=[KVCacheGroupSpec([mamba_name], spec),
                         KVCacheGroupSpec([attn_name], cc.SPEC)])
    w = cc.nixl_worker(
        mamba_be, caches, attn_backends=[mamba_be, attn_be], _has_mamba=True,
        kv_cache_config=config, _layer_specs=specs, _group_spec_types=[MambaSpec, type(cc.SPEC)],
        _mamba_ssm_size=(cc.HYBRID_CONV_BYTES, cc.HYBRID_SSM_BYTES),
        _conv_decomp=SimpleNamespace(local_conv_offsets=[(0, cc.HYBRID_CONV_BYTES)]))
    assert w.transfer_topo.is_kv_packed
    assert [(base, length) for base, length, _dev, _ in cc.reg_descs(w)] == [
        (raw.data_ptr(), NUM_BLOCKS * cc.BLOCK_BYTES)]
    assert w.block_len_per_layer == [cc.BLOCK_BYTES] and w.num_regions == 1
    base = raw.data_ptr()
    whole = [(base + b * cc.BLOCK_BYTES, cc.BLOCK_BYTES, 0) for b in range(NUM_BLOCKS)]
    conv = [(base + b * cc.BLOCK_BYTES, cc.HYBRID_CONV_BYTES, 0) for b in range(NUM_BLOCKS)]
    ssm = [(base + b * cc.BLOCK_BYTES + cc.HYBRID_CONV_BYTES, cc.HYBRID_SSM_BYTES, 0)
           for b in range(NUM_BLOCKS)]
    assert cc.xfer_descs(w) == whole + conv + ssm


def mooncake_hybrid(backends, mamba_cache, spec, attn) -> object:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    mamba_name, attn_name = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
    w = object.__new__(mc.MooncakeConnectorWorker)
    for k, v in dict(use_mla=False, transfer_topo=cc.hybrid_topo(backends),
                     _layer_specs={mamba_name: spec, attn_name: cc.SPEC},
                     _layer_group_indices={mamba_name: 0, attn_name: 1}, engine=MagicMock(),
                     is_kv_consumer=True, is_kv_producer=True,
                     async_zmq_ctx=MagicMock()).items():
        setattr(w, k, v)
    w.engine.batch_register_memory.return_value = 0
    w.register_kv_caches({mamba_name: mamba_cache, attn_name: attn})
    return w


@pytest.mark.parametrize("family", sorted(cc.HYBRID_MAMBA))
@pytest.mark.parametrize("attn_backend", ["TRITON_ATTN", "FLASH_ATTN", "CPU_ATTN"])
def test_mooncake_hybrid_real_backends(family, attn_backend):
    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    attn = cc.packed_cache("NHD")
    w = mooncake_hybrid([cc.mamba_backend(family), real_packed_backend(attn_backend)],
                        page, spec, attn)
    assert w.kv_caches_base_addr == [raw.data_ptr(), attn.data_ptr()]
    assert w.block_len_per_layer == [spec.page_size_bytes, cc.BLOCK_BYTES]
    assert w.kv_block_len_per_layer == [spec.page_size_bytes, cc.BLOCK_BYTES]


# ---- the Mamba cache forms a connector accepts (those upstream 0.27 accepts) ---------------


def test_mamba_region_accepts_the_forms_upstream_accepts():
    """vLLM 0.27.1's connectors take a Mamba layer's cache as any tensor whose blocks are the
    pages (NIXL reads its data_ptr, the lengths come from the spec) or as a (conv, ssm) pair of
    state views (Mooncake registers the first one): both are accepted, and both give the same
    region base and block stride (page 0, the page)."""
    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, spec.page_size_bytes)
    views = bind_worker.reference_0251_views(raw, spec)
    forms = {
        "page int8": page,
        "page uint8": raw.view(torch.uint8).view(NUM_BLOCKS, 1, 1, spec.page_size_bytes),
        "pages 2-D": raw.view(NUM_BLOCKS, spec.page_size_bytes),
        "[conv, ssm] list (0.25.1)": list(views),
        "(conv, ssm) tuple (bound views)": tuple(views),
    }
    for label, form in forms.items():
        region = kv_utils.mamba_transfer_region(form, spec)
        assert isinstance(region, torch.Tensor), label
        assert region.data_ptr() == raw.data_ptr(), label
        assert region.stride(0) * region.element_size() == spec.page_size_bytes, label


def test_mamba_region_refuses_what_it_cannot_address():
    spec = mamba_spec("gdn_padded")
    raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    half = spec.page_size_bytes // 2
    for bad in (raw.view(2 * NUM_BLOCKS, 1, 1, half),  # blocks are not the pages
                [raw.view(2 * NUM_BLOCKS, half)],  # a state whose block stride is not the page
                [], (), None, {"conv": raw}, ["conv", "ssm"], torch.zeros(())):
        with pytest.raises(ValueError, match="Mamba layer"):
            kv_utils.mamba_transfer_region(bad, spec)


@pytest.mark.parametrize("form", ["list", "tuple"])
def test_nixl_and_mooncake_register_a_mamba_state_pair_like_the_page(form):
    """Registration of the (conv, ssm) form is the registration of the page tensor."""
    spec = cc.hybrid_spec()
    raw = torch.zeros(NUM_BLOCKS * cc.BLOCK_BYTES, dtype=torch.int8)
    page = raw.view(NUM_BLOCKS, 1, 1, cc.BLOCK_BYTES)
    pair = (list if form == "list" else tuple)(cc.hybrid_mamba_views(raw, spec))
    attn = raw.view(cc.DTYPE).view(NUM_BLOCKS, cc.NUM_HEADS, cc.BLOCK_SIZE, 2 * cc.HEAD_SIZE)
    backends = [cc.mamba_backend("qwen3next"), cc.real_backend("CPU_ATTN")]
    got = {}
    for label, mamba_cache in (("page", page), ("pair", pair)):
        m = mooncake_hybrid(backends, mamba_cache, spec, attn)
        got[label] = (m.kv_caches_base_addr, m.block_len_per_layer, m.kv_block_len_per_layer,
                      m.engine.batch_register_memory.call_args)
        caches = {"model.layers.0.linear_attn": mamba_cache, "model.layers.3.self_attn.attn": attn}
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=raw.numel(), shared_by=list(caches))],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.linear_attn"], spec),
                             KVCacheGroupSpec(["model.layers.3.self_attn.attn"], cc.SPEC)])
        w = cc.nixl_worker(
            backends[0], caches, attn_backends=backends, _has_mamba=True,
            kv_cache_config=config,
            _layer_specs={"model.layers.0.linear_attn": spec,
                          "model.layers.3.self_attn.attn": cc.SPEC},
            _group_spec_types=[MambaSpec, type(cc.SPEC)],
            _mamba_ssm_size=(cc.HYBRID_CONV_BYTES, cc.HYBRID_SSM_BYTES),
            _conv_decomp=SimpleNamespace(local_conv_offsets=[(0, cc.HYBRID_CONV_BYTES)]))
        got[label] += (cc.reg_descs(w), cc.xfer_descs(w), w.block_len_per_layer)
    assert got["pair"] == got["page"]


# ---- the packed (per-block, cross-layer) branch of _reshape_attention_kv_cache -----------


def packed_block_config(layer_names, page_bytes):
    """Layers packed per block into one tensor (KVCacheTensor offset / block_stride > 0): block b
    of layer i is bytes [b * block_stride + i * page, ... + page) of the shared allocation."""
    stride = page_bytes * len(layer_names)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=NUM_BLOCKS * stride, shared_by=[name],
                                        offset=i * page_bytes, block_stride=stride)
                          for i, name in enumerate(layer_names)],
        kv_cache_groups=[KVCacheGroupSpec([name], cc.SPEC) for name in layer_names])


def check_packed_views(caches, names, raw, order):
    """Each layer's cache is the logical (B, H, N, 2D) at its offset in each block, laid out in
    the backend's physical order (NHD: tokens before heads)."""
    es = cc.ELEM
    stride = cc.BLOCK_BYTES * len(names)
    for i, name in enumerate(names):
        c = caches[name]
        assert tuple(c.shape) == (NUM_BLOCKS, cc.NUM_HEADS, cc.BLOCK_SIZE, 2 * cc.HEAD_SIZE), (
            name, tuple(c.shape))
        assert c.data_ptr() == raw.data_ptr() + i * cc.BLOCK_BYTES
        assert c.stride(0) * es == stride
        content = 2 * cc.HEAD_SIZE
        want = ((content, cc.NUM_HEADS * content) if order == "NHD"
                else (cc.BLOCK_SIZE * content, content))
        assert (c.stride(1), c.stride(2), c.stride(3)) == (*want, 1), (order, c.stride())
    # layers never overlap: write every element of every layer, each byte written once
    raw.zero_()
    for name in names:
        caches[name].view(torch.int16).add_(1)
    assert int(raw.view(torch.int16).max()) == 1 and int(raw.view(torch.int16).min()) == 1


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_reshape_packed_cross_layer_blocks(order, monkeypatch):
    """vLLM 0.26.0 views the per-block packed slice with the *permuted* shape, then permutes
    back; viewing it with the logical shape gave a (B, N, H, 2D) tensor under NHD. Both runners
    (V2's _reshape_kv_cache, V1's _reshape_kv_cache_tensors) with a real packed backend and two
    layers in two groups packed per block."""
    import vllm.v1.attention.backends.triton_attn as ta
    from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(ta, "get_kv_cache_layout", lambda: order)
    backend = ta.TritonAttentionBackend
    assert backend.get_kv_cache_stride_order() == ((0, 2, 1, 3) if order == "NHD" else (0, 1, 2, 3))
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    config = packed_block_config(names, cc.BLOCK_BYTES)
    raw = torch.zeros(NUM_BLOCKS * cc.BLOCK_BYTES * len(names), dtype=torch.int8)
    groups = [SimpleNamespace(kv_cache_spec=cc.SPEC, backend=backend, kv_cache_group_id=i,
                              layer_names=[name]) for i, name in enumerate(names)]
    v2 = _reshape_kv_cache(attn_groups=groups, kv_cache_raw_tensors={n: raw for n in names},
                           cache_dtype="auto", kernel_block_sizes=[cc.BLOCK_SIZE] * 2,
                           shared_kv_cache_layers={}, kv_cache_config=config)
    check_packed_views(v2, names, raw, order)
    fake = SimpleNamespace(kv_cache_config=config, runner_only_attn_layers=set(),
                           cache_config=SimpleNamespace(cache_dtype="auto"),
                           _kv_cache_spec_attn_group_iterator=lambda: iter(groups),
                           _has_mixed_attention_kv_layout=lambda _sizes: False)
    v1 = GPUModelRunner._reshape_kv_cache_tensors(fake, {n: raw for n in names},
                                                  [cc.BLOCK_SIZE] * 2)
    check_packed_views(v1, names, raw, order)


def test_minimax_m3_sparse_backend_is_refused_by_connectors():
    """MiniMax-M3's sparse backend keeps 0.25.1's 5-D layout on this base (upstream 0.26.0 packed
    it; not ported): next to a packed backend, a P/D connector's topology refuses the model with a
    clear error instead of registering half of it wrong."""
    import importlib
    import types

    import vllm.models

    # the package's __init__ imports the CUDA model (compiled ops the CPU wheel lacks): load the
    # backend's module under a bare package instead
    pkg = types.ModuleType("vllm.models.minimax_m3")
    pkg.__path__ = [str(Path(vllm.models.__path__[0]) / "minimax_m3")]
    sys.modules.setdefault("vllm.models.minimax_m3", pkg)
    sparse = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
    MiniMaxM3SparseBackend = sparse.MiniMaxM3SparseBackend

    assert len(MiniMaxM3SparseBackend.get_kv_cache_shape(1, 16, 1, 1)) == 5
    for backends in ([real_packed_backend("FLASH_ATTN"), MiniMaxM3SparseBackend],
                     [MiniMaxM3SparseBackend, real_packed_backend("TRITON_ATTN")]):
        with pytest.raises(ValueError, match="mixing KV cache layouts"):
            kv_utils.TransferTopology(
                tp_rank=0, tp_size=1, block_size=cc.BLOCK_SIZE, engine_id="local",
                is_mla=False, is_mamba=False, total_num_kv_heads=cc.NUM_HEADS,
                attn_backends=backends)
