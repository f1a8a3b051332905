"""Torch-fallback KV transfer (LMCache patch: CPU path) for every vLLM layout LMCache knows.

For each layout the element of (block b, K/V index i, in-block offset o, head h, dim d) is located
by an explicit, independent index function; the test then checks byte-exact copies at the target
slots and that no other element of the engine's tensor changes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402
from packaging.version import Version  # noqa: E402

import lmcache  # noqa: E402,F401  (installs the lmcache.c_ops shim)
from lmcache.v1.platform import torch_ops  # noqa: E402

# Version switch: LMCache 0.5.6 moved the layout enums into its compiled ``lmcache_native``
# module (0.5.3: ``lmcache.v1.platform.ops_types``).
if Version(lmcache.__version__) < Version("0.5.6"):
    from lmcache.v1.platform.ops_types import EngineKVFormat as F, TransferDirection  # noqa: E402
else:
    from lmcache.lmcache_native import EngineKVFormat as F, TransferDirection  # noqa: E402

NB, BS, NH, HS, NL = 5, 4, 2, 4, 2

# name -> (raw per-layer shape, kv size, locate(b, i, o, h, d, layer) -> index into raw tensor)
LAYOUTS = {
    "NL_X_TWO_NB_BS_NH_HS": ((2, NB, BS, NH, HS), 2, lambda b, i, o, h, d, l: (i, b, o, h, d)),
    "NL_X_TWO_NB_NH_BS_HS": ((2, NB, NH, BS, HS), 2, lambda b, i, o, h, d, l: (i, b, h, o, d)),
    "NL_X_NB_TWO_BS_NH_HS": ((NB, 2, BS, NH, HS), 2, lambda b, i, o, h, d, l: (b, i, o, h, d)),
    "NL_X_NB_TWO_NH_BS_HS": ((NB, 2, NH, BS, HS), 2, lambda b, i, o, h, d, l: (b, i, h, o, d)),
    "NL_X_NB_BS_NH_TWO_HS": ((NB, BS, NH, 2, HS), 2, lambda b, i, o, h, d, l: (b, o, h, i, d)),
    "NL_X_NB_NH_BS_TWO_HS": ((NB, NH, BS, 2, HS), 2, lambda b, i, o, h, d, l: (b, h, o, i, d)),
    # packed NHD: each head row is [K | V]
    "NL_X_NB_BS_NH_CS": ((NB, BS, NH, 2 * HS), 2, lambda b, i, o, h, d, l: (b, o, h, i * HS + d)),
    # vLLM CPU backend (vec/vec16/NEON kernels): per (block, head) a K tile stored
    # column-major [HS, BS], then a row-major [BS, HS] V tile, in a tensor shaped
    # [NB, NH, BS, 2*HS]; flat offset inside the (b, h) page:
    "NL_X_NB_NH_BS_CS": (
        (NB, NH, BS, 2 * HS), 2,
        lambda b, i, o, h, d, l: (
            b, h, *divmod(d * BS + o if i == 0 else BS * HS + o * HS + d, 2 * HS)),
    ),
    "NL_X_NB_BS_HS": ((NB, BS, HS), 1, lambda b, i, o, h, d, l: (b, o, d)),
    "NL_X_NBBS_ONE_HS": ((NB * BS, 1, HS), 1, lambda b, i, o, h, d, l: (b * BS + o, 0, d)),
    "NB_NL_TWO_BS_NH_HS": ((NB, NL, 2, BS, NH, HS), 2, lambda b, i, o, h, d, l: (b, l, i, o, h, d)),
    "NB_NL_TWO_NH_BS_HS": ((NB, NL, 2, NH, BS, HS), 2, lambda b, i, o, h, d, l: (b, l, i, h, o, d)),
}


def _heads(kv):
    return 1 if kv == 1 else NH


def _make(name, dtype, seed):
    shape, kv, _ = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    if name.startswith("NB_NL"):
        layers = [torch.randn(shape, generator=g).to(dtype)]
    else:
        layers = [torch.randn(shape, generator=g).to(dtype) for _ in range(NL)]
    return layers, kv


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _slots():
    # 7 tokens: slots spread over blocks, one invalid (-1), out of order.
    return torch.tensor([17, 2, -1, 9, 10, 0, 19], dtype=torch.long)


def _touched(name, layers, slots, kv, skip=0):
    """Boolean masks (one per tensor in `layers`) of the elements the tokens occupy."""
    _, _, loc = LAYOUTS[name]
    masks = [torch.zeros(t.shape, dtype=torch.bool) for t in layers]
    for layer in range(NL):
        t_idx = 0 if name.startswith("NB_NL") else layer
        for t, s in enumerate(slots.tolist()):
            if s < 0 or t < skip:
                continue
            b, o = divmod(s, BS)
            for i in range(kv):
                for h in range(_heads(kv)):
                    for d in range(HS):
                        masks[t_idx][loc(b, i, o, h, d, layer)] = True
    return masks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_h2d_writes_exactly_the_target_slots(name, dtype):
    layers, kv = _make(name, dtype, seed=1)
    before = [t.clone() for t in layers]
    slots = _slots()
    hidden = _heads(kv) * HS
    mem = torch.randn(kv, NL, len(slots), hidden, generator=torch.Generator().manual_seed(2)).to(dtype)

    torch_ops.multi_layer_kv_transfer(
        mem, layers, slots, torch.device("cpu"), NB * BS, TransferDirection.H2D,
        getattr(F, name), block_size=BS, head_size=HS,
    )

    _, _, loc = LAYOUTS[name]
    for layer in range(NL):
        t_idx = 0 if name.startswith("NB_NL") else layer
        for t, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            b, o = divmod(s, BS)
            for i in range(kv):
                for h in range(_heads(kv)):
                    for d in range(HS):
                        got = layers[t_idx][loc(b, i, o, h, d, layer)]
                        want = mem[i, layer, t, h * HS + d]
                        assert _bits(got.reshape(1)).item() == _bits(want.reshape(1)).item(), (
                            name, layer, t, i, h, d)
    for t, b4, m in zip(layers, before, _touched(name, layers, slots, kv)):
        assert torch.equal(_bits(t)[~m], _bits(b4)[~m]), f"{name}: an untargeted element changed"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_d2h_reads_the_target_slots(name):
    layers, kv = _make(name, torch.bfloat16, seed=3)
    before = [t.clone() for t in layers]
    slots = _slots()
    hidden = _heads(kv) * HS
    sentinel = torch.full((kv, NL, len(slots), hidden), 7.0, dtype=torch.bfloat16)
    mem = sentinel.clone()

    torch_ops.multi_layer_kv_transfer(
        mem, layers, slots, torch.device("cpu"), NB * BS, TransferDirection.D2H,
        getattr(F, name), block_size=BS, head_size=HS,
    )

    _, _, loc = LAYOUTS[name]
    for layer in range(NL):
        t_idx = 0 if name.startswith("NB_NL") else layer
        for t, s in enumerate(slots.tolist()):
            for i in range(kv):
                for h in range(_heads(kv)):
                    for d in range(HS):
                        got = mem[i, layer, t, h * HS + d]
                        if s < 0:
                            assert got.item() == 7.0
                            continue
                        b, o = divmod(s, BS)
                        want = layers[t_idx][loc(b, i, o, h, d, layer)]
                        assert _bits(got.reshape(1)).item() == _bits(want.reshape(1)).item()
    for t, b4 in zip(layers, before):
        assert torch.equal(_bits(t), _bits(b4)), "D2H must not write the engine's cache"


@pytest.mark.parametrize("name", ["NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS", "NL_X_TWO_NB_NH_BS_HS"])
def test_round_trip_and_skip_prefix(name):
    layers, kv = _make(name, torch.bfloat16, seed=4)
    slots = _slots()
    mem = torch.zeros(kv, NL, len(slots), _heads(kv) * HS, dtype=torch.bfloat16)
    fmt = getattr(F, name)
    torch_ops.multi_layer_kv_transfer(mem, layers, slots, torch.device("cpu"), NB * BS,
                                      TransferDirection.D2H, fmt, block_size=BS, head_size=HS)
    target, _ = _make(name, torch.bfloat16, seed=5)
    before = [t.clone() for t in target]
    torch_ops.multi_layer_kv_transfer(mem, target, slots, torch.device("cpu"), NB * BS,
                                      TransferDirection.H2D, fmt, block_size=BS, head_size=HS,
                                      skip_prefix_n_tokens=2)
    # Tokens 0 and 1 skipped: their slots keep the old bytes; the others now hold the source's.
    skipped = _touched(name, target, slots[:2], kv)
    moved = _touched(name, target, slots, kv, skip=2)
    for t, b4, src, ms, mm in zip(target, before, layers, skipped, moved):
        assert torch.equal(_bits(t)[ms & ~mm], _bits(b4)[ms & ~mm])
        assert torch.equal(_bits(t)[mm], _bits(src)[mm])
        assert torch.equal(_bits(t)[~mm], _bits(b4)[~mm])


def test_cpu_backend_layout_matches_vllm_cpu_attention_view():
    """vLLM's CPU kernel (csrc/cpu/cpu_attn_vec.hpp) writes K column-major, V row-major."""
    layers, _ = _make("NL_X_NB_NH_BS_CS", torch.bfloat16, seed=6)
    slots = torch.tensor([5, 6], dtype=torch.long)
    mem = torch.randn(2, NL, 2, NH * HS).to(torch.bfloat16)
    torch_ops.multi_layer_kv_transfer(mem, layers, slots, torch.device("cpu"), NB * BS,
                                      TransferDirection.H2D, F.NL_X_NB_NH_BS_CS, block_size=BS,
                                      head_size=HS)
    tiles = layers[0].view(NB, NH, 2, BS * HS)
    k_tiles = tiles[:, :, 0].view(NB, NH, HS, BS)  # [head_dim, block_size]
    v_tiles = tiles[:, :, 1].view(NB, NH, BS, HS)  # [block_size, head_dim]
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, BS)
        assert torch.equal(k_tiles[b, :, :, o], mem[0, 0, t].view(NH, HS))
        assert torch.equal(v_tiles[b, :, o], mem[1, 0, t].view(NH, HS))


def test_detector_on_cpu_picks_cpu_backend_layout():
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format

    layers, _ = _make("NL_X_NB_NH_BS_CS", torch.bfloat16, seed=7)
    fmt, _ = normalize_kv_and_discover_format(layers, EngineType.VLLM, layout_hints={})
    assert int(fmt) == int(F.NL_X_NB_NH_BS_CS)


@pytest.mark.parametrize("name", ["NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS", "NL_X_TWO_NB_NH_BS_HS",
                                  "NL_X_NB_TWO_NH_BS_HS", "NB_NL_TWO_BS_NH_HS"])
def test_pointer_path_refuses_layouts_it_cannot_address(name):
    layers, kv = _make(name, torch.bfloat16, seed=8)
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    mem = torch.zeros(kv, NL, 3, NH * HS, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        torch_ops.multi_layer_kv_transfer(mem, ptrs, torch.tensor([0, 1, 2]), torch.device("cpu"),
                                          NB * BS, TransferDirection.H2D, getattr(F, name),
                                          block_size=BS, head_size=HS)


def test_mismatched_memory_object_is_rejected():
    layers, _ = _make("NL_X_NB_NH_BS_CS", torch.bfloat16, seed=9)
    mem = torch.zeros(2, NL, 3, NH * HS * 2, dtype=torch.bfloat16)  # wrong hidden size
    with pytest.raises(ValueError, match="does not match"):
        torch_ops.multi_layer_kv_transfer(mem, layers, torch.tensor([0, 1, 2]), torch.device("cpu"),
                                          NB * BS, TransferDirection.H2D, F.NL_X_NB_NH_BS_CS,
                                          block_size=BS, head_size=HS)


def test_create_gpu_connector_has_a_cpu_branch():
    from lmcache.utils import EngineType
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.gpu_connector.cpu_connectors import VLLMPagedMemCPUConnector
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    assert lmcache.torch_device_type == "cpu"
    config = LMCacheEngineConfig.from_defaults(chunk_size=8, local_cpu=True, max_local_cpu_size=0.1)
    meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(NL, 2, 8, NH, HS))
    conn = CreateGPUConnector(config, meta, EngineType.VLLM)
    assert isinstance(conn, VLLMPagedMemCPUConnector)
    assert conn.get_shape(8) == torch.Size([2, NL, 8, NH * HS])

    layers, _ = _make("NL_X_NB_NH_BS_CS", torch.bfloat16, seed=10)
    slots = torch.arange(4, 12)

    class Obj:  # the two attributes the connector uses of a MemoryObj
        def __init__(self, t):
            self.tensor = t
            self.metadata = type("M", (), {"fmt": MemoryFormat.KV_2LTD})()

    out = Obj(torch.zeros(conn.get_shape(8), dtype=torch.bfloat16))
    conn.from_gpu(out, 0, 8, kvcaches=layers, slot_mapping=slots)
    target, _ = _make("NL_X_NB_NH_BS_CS", torch.bfloat16, seed=11)
    conn2 = CreateGPUConnector(config, meta, EngineType.VLLM)
    conn2.to_gpu(out, 0, 8, kvcaches=target, slot_mapping=slots)
    for a, b in zip(layers, target):
        pages = slice(1, 3)  # slots 4..11 = blocks 1 and 2
        assert torch.equal(_bits(a[pages]), _bits(b[pages]))


def _vllm_cpu_write(cache, k, v, slots, isa):
    """vLLM's own CPU attention write (as its backend's forward calls it)."""
    ops = pytest.importorskip("vllm._custom_ops")
    nb, nh, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, nh, bs * 2, -1).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(k, value=v, key_cache=key_cache, value_cache=value_cache,
                                       slot_mapping=slots, isa=isa)
    except (RuntimeError, NotImplementedError) as e:  # an ISA this build lacks
        pytest.skip(f"vLLM's CPU reshape_and_cache has no {isa!r} path here: {e}")


@pytest.mark.parametrize("head_size", [32, 64])
def test_amx_packed_cpu_layout_matches_vllm_amx_kernel(head_size):
    """vLLM's AMX kernel (bf16, block size a multiple of 32, AMX CPU: Sapphire Rapids and later)
    packs K in 16-token groups of 32-bit words and V in token pairs (csrc/cpu/cpu_attn_amx.hpp).
    Ground truth is vLLM's own reshape_and_cache with isa="amx": LMCache's CPU path must read what
    it wrote and write byte-identical tiles; the vec layout's reading (cpu_amx=False) is the
    negative control and must differ."""
    nb, nh, bs, n = 4, 2, 32, 40
    g = torch.Generator().manual_seed(12)
    k = torch.randn(n, nh, head_size, generator=g).to(torch.bfloat16)
    v = torch.randn(n, nh, head_size, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:n].to(torch.long)
    by_vllm = torch.zeros(nb, nh, bs, 2 * head_size, dtype=torch.bfloat16)
    _vllm_cpu_write(by_vllm, k, v, slots, "amx")
    assert by_vllm.count_nonzero() > 0

    def transfer(mem, cache, direction, amx):
        torch_ops.multi_layer_kv_transfer(mem, [cache], slots, torch.device("cpu"), nb * bs,
                                          direction, F.NL_X_NB_NH_BS_CS, block_size=bs,
                                          head_size=head_size, cpu_amx=amx)

    want = torch.stack([k.reshape(n, -1), v.reshape(n, -1)]).unsqueeze(1)  # [2, 1, n, NH*HS]
    got = torch.zeros_like(want)
    transfer(got, by_vllm, TransferDirection.D2H, True)
    assert torch.equal(_bits(got), _bits(want))
    as_vec = torch.zeros_like(want)
    transfer(as_vec, by_vllm, TransferDirection.D2H, False)
    assert not torch.equal(_bits(as_vec), _bits(want))  # negative control

    by_lmcache = torch.zeros_like(by_vllm)
    transfer(want, by_lmcache, TransferDirection.H2D, True)
    assert torch.equal(_bits(by_lmcache), _bits(by_vllm))
