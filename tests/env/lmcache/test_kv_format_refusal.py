"""LMCache patch 0007 (0008 on base 0.32): the vLLM detector refuses rank-4 KV caches it would mis-detect.

Real CPU tensors go through LMCache's own ``detect_format`` (contiguous-view permute, then
the vLLM detector). Packed K|V caches (NHD/HND, bf16/fp8) and the 0.25.1 5-D layouts are
accepted as before; nvfp4-shaped, wrong-content and wrong-head caches are refused with a
ValueError naming shape and dtype; the int8 Mamba page keeps its old handling.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402
from packaging.version import Version  # noqa: E402

import lmcache  # noqa: E402,F401  (installs the lmcache.c_ops shim)
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.gpu_connector.kv_format import detection  # noqa: E402
from lmcache.v1.gpu_connector.kv_format.detectors import vllm as vllm_detector  # noqa: E402

# Version switch: LMCache 0.5.6 moved the layout enums from ``lmcache.c_ops`` into its compiled
# ``lmcache_native`` module.
if Version(lmcache.__version__) < Version("0.5.6"):
    import lmcache.c_ops as lmc_ops  # noqa: E402

    F = lmc_ops.EngineKVFormat
else:
    from lmcache.lmcache_native import EngineKVFormat as F  # noqa: E402

B, H, N, D = 6, 2, 4, 8  # blocks, KV heads (per TP rank), block size, head size
HINTS = {"num_kv_heads": H, "head_dim": D}


@pytest.fixture
def gpu_device(monkeypatch):
    """Act as a CUDA worker so the NHD/HND hint is honoured (CPU forces HND)."""
    monkeypatch.setattr(vllm_detector, "torch_device_type", "cuda")


def _detect(layers, layout, **hints):
    return detection.detect_format(
        list(layers), EngineType.VLLM, {"kv_layout": layout, **hints}
    )


def _packed(layout, dtype):
    """vLLM's packed cache: logical (B, H, N, 2D), physical NHD (B, N, H, 2D) or HND."""
    phys = (B, N, H, 2 * D) if layout == "NHD" else (B, H, N, 2 * D)
    t = torch.arange(B * N * H * 2 * D, dtype=torch.float32).reshape(phys).to(dtype)
    return t.permute(0, 2, 1, 3) if layout == "NHD" else t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize(
    "layout,fmt,canon",
    [("HND", F.NL_X_NB_NH_BS_CS, (B, H, N, 2 * D)), ("NHD", F.NL_X_NB_BS_NH_CS, (B, N, H, 2 * D))],
)
def test_packed_accepted(gpu_device, layout, fmt, canon, dtype):
    layers = [_packed(layout, dtype) for _ in range(2)]
    got, normalized = _detect(layers, layout, **HINTS)
    assert got == fmt
    assert tuple(normalized[0].shape) == canon
    assert normalized[0].data_ptr() == layers[0].data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_packed_accepted_without_head_hints(gpu_device, dtype):
    """Multiprocess path (no head hints): a non-uint8 packed cache passes as before."""
    assert _detect([_packed("HND", dtype)], "HND")[0] == F.NL_X_NB_NH_BS_CS


def test_cpu_backend_cache_accepted():
    """vLLM CPU backend (B, H, N, 2D) bf16: HND on CPU, heads and content match."""
    t = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    if Version(lmcache.__version__) < Version("0.5.6"):
        # LMCache 0.5.3 forces HND on a CPU worker whatever the hint says.
        assert _detect([t], "NHD", **HINTS)[0] == F.NL_X_NB_NH_BS_CS
    else:
        # LMCache 0.5.6 honours an explicit hint (vLLM >= 0.29 reports its resolved layout:
        # LBHNC -> "HND" for the CPU backend) and defaults to HND on a CPU worker without one.
        assert _detect([t], "HND", **HINTS)[0] == F.NL_X_NB_NH_BS_CS
        assert detection.detect_format([t], EngineType.VLLM, dict(HINTS))[0] == F.NL_X_NB_NH_BS_CS


@pytest.mark.parametrize(
    "shape,layout,fmt",
    [
        ((2, B, N, H, D), "NHD", F.NL_X_TWO_NB_BS_NH_HS),
        ((2, B, H, N, D), "HND", F.NL_X_TWO_NB_NH_BS_HS),
        ((B, 2, N, H, D), "NHD", F.NL_X_NB_TWO_BS_NH_HS),
        ((B, 2, H, N, D), "HND", F.NL_X_NB_TWO_NH_BS_HS),
    ],
)
def test_five_d_formats_unchanged(gpu_device, shape, layout, fmt):
    t = torch.zeros(shape, dtype=torch.bfloat16)
    assert _detect([t, t.clone()], layout, **HINTS)[0] == fmt


def _refused(layers, layout, **hints):
    with pytest.raises(ValueError) as err:
        _detect(layers, layout, **hints)
    msg = str(err.value)
    t = layers[0]
    assert "unsupported rank-4 vLLM KV cache" in msg
    assert str(t.dtype) in msg and "packed K|V" in msg
    return msg


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_nvfp4_refused(gpu_device, layout):
    """FlashInfer nvfp4: uint8 (B, 2H, N, D/2 + D/16), K heads then V heads."""
    f = D // 2 + D // 16
    t = torch.zeros(B, 2 * H, N, f, dtype=torch.uint8)
    if layout == "NHD":
        t = torch.zeros(B, N, 2 * H, f, dtype=torch.uint8).permute(0, 2, 1, 3)
    msg = _refused([t], layout, **HINTS)
    assert "content dim" in msg
    # without head hints a uint8 cache cannot be told apart from fp8: refused too
    assert "nvfp4" in _refused([t], layout)


def test_content_dim_not_two_head_size_refused(gpu_device):
    t = torch.zeros(B, H, N, D, dtype=torch.bfloat16)
    msg = _refused([t], "HND", **HINTS)
    assert f"({B}, {H}, {N}, {D})" in msg
    assert f"content dim {D} != 2 * head_size ({D})" in msg


def test_wrong_head_count_refused(gpu_device):
    t = torch.zeros(B, 2 * H, N, 2 * D, dtype=torch.bfloat16)
    msg = _refused([t], "HND", **HINTS)
    assert f"head dim {2 * H} != num_kv_heads ({H})" in msg


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_non_kv_dtype_refused(gpu_device, dtype):
    assert "not a K/V element type" in _refused([_packed("HND", dtype)], "HND", **HINTS)


def test_odd_content_refused_without_hints(gpu_device):
    t = torch.zeros(B, H, N, 2 * D + 1, dtype=torch.bfloat16)
    assert "is odd" in _refused([t], "HND")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_mamba_page_unchanged(gpu_device, layout):
    """The (B, 1, 1, page) int8 Mamba tensor, raw and re-viewed by _MambaUnifiedViewEdit."""
    page = N * 40  # bytes per block, unrelated to 2 * head_size
    raw = torch.zeros(B, 1, 1, page, dtype=torch.int8)
    fmt = F.NL_X_NB_NH_BS_CS if layout == "HND" else F.NL_X_NB_BS_NH_CS
    got, normalized = _detect([raw], layout, **HINTS)
    assert got == fmt and normalized[0].data_ptr() == raw.data_ptr()

    edits = pytest.importorskip("lmcache.integration.vllm.kv_cache_group_edits")
    view = edits._MambaUnifiedViewEdit().apply(
        # page_size_bytes: LMCache 0.5.6 bounds the re-view by the spec's page size.
        SimpleNamespace(block_size=N, page_size_bytes=page), raw, {"kv_layout": layout}
    )
    got, normalized = _detect([view, view], layout, **HINTS)
    assert got == fmt
    assert normalized[0].data_ptr() == raw.data_ptr()
    assert _detect([view], layout)[0] == fmt  # no head hints (multiprocess path)
