"""End-to-end worker for test_bind_kv_cache.py: one CPU engine per process.

    python bind_worker.py MODEL_NAME MODEL_DIR OUT.json

Runs the tiny model greedily on the CPU engine and writes the generated token ids and what the
engine bound as KV caches: per Mamba layer its state views (offset in the allocation, shape,
stride, dtype) next to the views vLLM 0.25.1's `_reshape_kv_cache_tensors` builds from the same
allocation (the reference, recomputed here), and per attention layer its cache view.

When KVSTACK_BIND_OVERLAY names a folder, every `vllm/...py` file in it replaces the installed
module of the same name (a meta-path finder installed before vLLM is imported), so the patched
files are run without touching the shared venv. Without it the installed vLLM runs as is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

_OVERLAY = os.environ.get("KVSTACK_BIND_OVERLAY")


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


def install_overlay() -> None:
    if _OVERLAY:
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "overlay too late"
        sys.meta_path.insert(0, _OverlayFinder(Path(_OVERLAY)))


def reference_0251_views(raw, spec) -> list:
    """The Mamba state views exactly as vLLM 0.25.1's `_reshape_kv_cache_tensors` builds them
    from a layer's raw int8 allocation (the reference for the patched `bind_kv_cache`)."""
    import torch
    from vllm.utils.torch_utils import get_dtype_size

    num_blocks = raw.numel() // spec.page_size_bytes
    views, offset_bytes = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        dsize = get_dtype_size(dtype)
        target_shape = (num_blocks, *shape)
        stride = torch.empty(target_shape).stride()
        views.append(torch.as_strided(raw.view(dtype), size=target_shape,
                                      stride=(spec.page_size_bytes // dsize, *stride[1:]),
                                      storage_offset=offset_bytes // dsize))
        offset_bytes += stride[0] * dsize
    return views


def describe(t, base_ptr: int) -> dict:
    return {"offset": t.data_ptr() - base_ptr, "data_ptr": t.data_ptr(), "shape": list(t.shape),
            "stride": list(t.stride()), "dtype": str(t.dtype)}


def transfer_regions(runner, ctx) -> dict | None:
    """What a P/D connector (NIXL, Mooncake) would register for this engine's caches, with the
    backend list vLLM builds for it (get_current_attn_backends: every layer's backend in layer
    order, so a hybrid model's Mamba/GDN backend comes first). None where the ladder's transfer
    functions are absent (0.25.1)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils
    from vllm.v1.kv_cache_interface import MambaSpec

    if not hasattr(kv_utils, "mamba_transfer_region"):
        return None
    config = runner.kv_cache_config
    out: dict = {}
    try:
        topo = kv_utils.TransferTopology(
            tp_rank=0, tp_size=1, block_size=runner.cache_config.block_size, engine_id="e2e",
            is_mla=False, is_mamba=config.has_mamba_layers,
            total_num_kv_heads=runner.model_config.get_total_num_kv_heads(),
            attn_backends=kv_utils.get_current_attn_backends(runner.vllm_config))
        out["layout"] = topo.kv_cache_layout_kind
        for group in config.kv_cache_groups:
            for name in group.layer_names:
                cache = ctx[name].kv_cache
                if isinstance(group.kv_cache_spec, MambaSpec):
                    # what the runner hands a connector: the layer's page tensor (the
                    # runner's cache that starts where the layer's first state view does)
                    cache = next(c for c in runner.kv_caches if isinstance(c, torch.Tensor)
                                 and c.data_ptr() == cache[0].data_ptr()
                                 and c.dtype == torch.int8)
                    regions = [kv_utils.mamba_transfer_region(cache, group.kv_cache_spec)]
                else:
                    regions = topo.attention_transfer_regions(cache)
                out[name] = [[r.data_ptr(), r.stride(0) * r.element_size()] for r in regions]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main(name: str, model_dir: str, out: str) -> None:
    install_overlay()
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs

    apply_engine_env()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    if _OVERLAY:
        import vllm.v1.worker.gpu_model_runner as gmr
        assert gmr.__file__.startswith(_OVERLAY), gmr.__file__

    llm = LLM(**llm_kwargs(name, model_dir, enable_prefix_caching=False))
    prompts = [{"prompt_token_ids": [3 + (i * 7 + salt * 13 + 3) % 1000 for i in range(n)]}
               for n, salt in ((5, 0), (37, 1), (130, 2))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    mamba, attention = {}, {}
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer_name in group.layer_names:
            layer = ctx[layer_name]
            if isinstance(spec, MambaSpec):
                views = list(layer.kv_cache)
                storage = views[0].untyped_storage()
                base = storage.data_ptr()
                raw = torch.empty(0, dtype=torch.int8).set_(storage)  # the layer's allocation
                ref = reference_0251_views(raw, spec)
                mamba[layer_name] = {
                    "type": type(layer.kv_cache).__name__,
                    "views": [describe(v, base) for v in views],
                    "reference_0251": [describe(v, base) for v in ref],
                    "page_size_bytes": spec.page_size_bytes,
                    "storage_nbytes": storage.nbytes(),
                }
            elif isinstance(spec, AttentionSpec):
                kv = layer.kv_cache
                attention[layer_name] = describe(kv, kv.untyped_storage().data_ptr())
    runner_caches = [
        {"kind": "tensor", "shape": list(c.shape), "dtype": str(c.dtype), "data_ptr": c.data_ptr()}
        if isinstance(c, torch.Tensor) else {"kind": type(c).__name__}
        for c in runner.kv_caches
    ]
    result = {
        "attn_backends": [b.get_name() for b in get_current_attn_backends(runner.vllm_config)],
        "transfer_regions": transfer_regions(runner, ctx),
        "tokens": tokens,
        "runner_class": type(runner).__name__,
        "reshape_inherited": (type(runner)._reshape_kv_cache_tensors
                              is GPUModelRunner._reshape_kv_cache_tensors),
        "has_bind_kv_cache": all(hasattr(ctx[n], "bind_kv_cache") for n in {**mamba, **attention}),
        "mamba": mamba,
        "attention": attention,
        "runner_kv_caches": runner_caches,
        "overlay": bool(_OVERLAY),
    }
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
