"""Start-up checks of the streaming connector: what the windowed path cannot compute exactly is
refused before the engine serves, with a message that says what to change.

Two stages, both before the first request:

- `check_engine(vllm_config)`: the engine configuration. Run where the KV cache specs are
  collected (``get_kv_paging_window``, in every worker) and when each side of the connector is
  built. Refused: vLLM's prefix caching, the hybrid KV cache manager switched off, decode /
  prefill context parallelism, speculative decoding, MLA models, a quantized KV cache dtype
  (fp8 ...), the attention + quantization fusion pass (quantized attention output), dual-batch
  overlap / micro-batching (``enable_dbo``, ``ubatch_size``), async scheduling, the V2 model
  runner, an attention backend requested (``attention_config.backend``) outside the allow-list of
  this vLLM base (`ATTENTION_BACKENDS`), and any CUDA
  graph mode that would capture the attention of a streaming layer (full graphs, or piecewise
  graphs whose pieces do not split at attention). ``StreamingConnector`` declares
  ``requires_piecewise_for_cudagraph``, so vLLM turns its GPU default FULL_AND_PIECEWISE into
  PIECEWISE before this check runs; the check catches what is still unsafe.
  Served: tensor parallelism (each rank streams its own KV heads into its own host tier) and
  pipeline parallelism (each stage streams its own layers into its own host tier, sized for the
  largest stage: layout._max_stage_layers); the scheduler side, with the page table, stays one
  per engine. Both run on vLLM's own multiprocess executor. Refused there: a file-backed host
  tier (``host_tier_path``), which every rank would map at once.
- `check_layers(vllm_config, layout)`: the loaded model's attention layers (worker side, when
  the KV caches are registered). Refused: a streaming layer that reads another layer's KV cache
  (KV sharing), an attention type other than decoder self-attention, a layer class other than
  vLLM's ``Attention``, a native sliding-window layer in a streaming group, a streaming layer
  whose backend class is not the registered class of an allowed backend (FlashInfer, MLA,
  FlexAttention, wrapped or unknown backends: the backend vLLM actually chose), and a layer the
  configuration selects for streaming that vLLM did not give a streaming KV spec (it would be
  attended by the backend over a one-token window). Logits soft-cap, attention sinks and ALiBi
  are implemented by the windowed path (`windowed.Features`), so they are read here, not refused.

And `check_device_budget` (scheduler side, once the KV cache is sized): at least one scheduler step
of every KV cache group plus vLLM's null block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import StreamingConfig, selects_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .layout import _Layout

PREFIX = "kvstack StreamingConnector: "

# The attention backends a streaming layer is known exact with, per vLLM base (major, minor), by
# vLLM's names (``AttentionBackendEnum``; the layer's backend must be the class registered under
# the name, not a wrapper of it). What the connector needs from a backend: metadata with
# ``query_start_loc`` and ``slot_mapping`` (worker_side._batch finds each request's rows by them)
# and an impl whose ``scale``, ``logits_soft_cap``, ``alibi_slopes`` and ``sinks`` are all it adds
# to softmax attention (windowed.Features). CPU_ATTN: both paths tested against native on the CPU
# engine (in place and windowed). FLASH_ATTN, TRITON_ATTN: the same metadata fields and impl
# attributes on both bases, attended by the windowed path (the GPU path, tested exact on the CPU
# engine; ci/gpu/check_streaming.py is its GPU check). Not allowed: FLASHINFER (its metadata has
# no ``query_start_loc``), the MLA backends (latent KV), FLEX_ATTENTION (block masks, not
# checked), every other name, and every base without an entry here.
ATTENTION_BACKENDS: dict[tuple[int, int], frozenset[str]] = {
    (0, 25): frozenset({"CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"}),
    (0, 32): frozenset({"CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"}),
}
_BACKEND_OPTION = ("choose an allowed one with --attention-backend "
                   "(attention_config={'backend': ...})")


def _base() -> tuple[int, int]:
    import vllm

    major, minor = (vllm.__version__.split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def allowed_backends() -> frozenset[str]:
    """The attention backends streaming layers may run on with this vLLM (empty: none)."""
    return ATTENTION_BACKENDS.get(_base(), frozenset())


def _allowed_text() -> str:
    allowed = allowed_backends()
    base = ".".join(map(str, _base()))
    if not allowed:
        return f"vLLM {base} has no allow-list of attention backends for streaming layers"
    return f"allowed on vLLM {base}: {', '.join(sorted(allowed))}"


def _requested_backend(vllm_config: "VllmConfig") -> tuple[str, str] | None:
    """(backend name, option) the configuration requests for full-attention layers (streaming
    layers are full attention to vLLM's backend selector), or None (vLLM chooses)."""
    attn = getattr(vllm_config, "attention_config", None)
    if attn is None:
        return None
    per_kind = getattr(attn, "backend_per_kind", None) or {}  # vLLM 0.32
    chosen = per_kind.get("full_attention")
    if chosen is not None:
        return getattr(chosen, "name", str(chosen)), "attention_config.backend_per_kind"
    chosen = getattr(attn, "backend", None)
    if chosen is not None:
        return getattr(chosen, "name", str(chosen)), "--attention-backend"
    return None


def _why(name: str | None) -> str:
    return {"FLASHINFER": " (its attention metadata has no query_start_loc, by which the "
                          "connector finds each request's rows)"}.get(name or "", "")


def backend_problem(backend: Any) -> str | None:
    """Why a streaming layer cannot run on attention backend class `backend`, or None."""
    try:
        name = backend.get_name()
    except Exception:  # noqa: BLE001 - no name: unknown
        name = None
    if name not in allowed_backends():
        shown = name or getattr(backend, "__name__", None) or "(unknown)"
        return (f"attention backend {shown}{_why(name)} is not one streaming layers are known "
                f"exact with ({_allowed_text()}); {_BACKEND_OPTION}")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        path = AttentionBackendEnum[name].get_path()
    except (KeyError, ValueError):
        path = None
    own = f"{getattr(backend, '__module__', '?')}.{getattr(backend, '__qualname__', '?')}"
    if own != path:
        return (f"attention backend {own} calls itself {name} but is not vLLM's registered "
                f"{name} class ({path}): a wrapped or unknown backend is not known exact; "
                f"{_BACKEND_OPTION}")
    return None


class UnsupportedConfiguration(ValueError):
    """An engine configuration the streaming path cannot serve exactly (refused at start-up)."""


def _refuse(problems: list[str]) -> None:
    if problems:
        raise UnsupportedConfiguration(PREFIX + "unsupported configuration:\n  - "
                                       + "\n  - ".join(problems))


def engine_problems(vllm_config: "VllmConfig") -> list[str]:
    problems: list[str] = []
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        problems.append(
            "vLLM's prefix caching is on: disable it (enable_prefix_caching=False / "
            "--no-enable-prefix-caching); the connector reuses prefixes from its host tier "
            "instead (streaming layers keep no device history to reuse)")
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        problems.append(
            "the hybrid KV cache manager is off: it bounds the device KV of streaming layers. "
            "For chunked-local models (Llama-4) set "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 and do not pass "
            "--disable-hybrid-kv-cache-manager")
    par = vllm_config.parallel_config
    for name, what in (("decode_context_parallel_size", "decode context"),
                       ("prefill_context_parallel_size", "prefill context")):
        size = getattr(par, name, 1) or 1
        if size > 1:
            problems.append(f"{what} parallelism ({name}={size}) is not supported with "
                            "streaming layers yet; run one rank")
    ranks = (getattr(par, "tensor_parallel_size", 1) or 1) * (
        getattr(par, "pipeline_parallel_size", 1) or 1)
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                    "kv_connector_extra_config", None) or {}
    if ranks > 1 and extra.get("host_tier_path"):
        problems.append(f"host_tier_path with {ranks} ranks (tensor x pipeline parallel): every "
                        "rank would map the same file for its own host tier; drop host_tier_path "
                        "(each rank keeps its host tier in memory) or run one rank")
    if extra.get("kv_joint_hits"):
        # next to other connectors under MultiConnector (joint prefix hits)
        if ranks > 1:
            problems.append(f"next to other connectors (MultiConnector) with {ranks} ranks "
                            "(tensor x pipeline parallel): not supported yet; run one rank, or "
                            "the StreamingConnector alone")
        if extra.get("lmcache"):
            problems.append("the shared tier ('lmcache' key) next to other connectors "
                            "(MultiConnector): with LMCacheConnectorV1 beside it, two LMCache "
                            "engines would share one process; drop one of them")
    if getattr(par, "enable_dbo", False) or (getattr(par, "ubatch_size", 0) or 0) > 1:
        problems.append(
            f"dual-batch overlap / micro-batching (enable_dbo={getattr(par, 'enable_dbo', False)}"
            f", ubatch_size={getattr(par, 'ubatch_size', 0)}) runs each layer once per "
            "micro-batch, with its own attention metadata, where the connector computes a "
            "streaming layer once per step for the whole batch; drop --enable-dbo and "
            "--ubatch-size (enable_dbo=False, ubatch_size=0)")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        problems.append(
            "async scheduling (scheduler_config.async_scheduling=True) is not shown exact with "
            "streaming layers (the next step is scheduled, and its host pages planned, before "
            "this one's tokens are known); pass --no-async-scheduling (async_scheduling=False). "
            "vLLM's CPU engine turns it off itself; on a GPU vLLM turns it on unless told not to")
    if getattr(vllm_config, "use_v2_model_runner", False):
        problems.append(
            "the V2 model runner is not shown exact with streaming layers (its own input "
            "batches and attention metadata); set VLLM_USE_V2_MODEL_RUNNER=0 and drop what "
            "forces it (vLLM 0.32: watermarking, HiSparse)")
    requested = _requested_backend(vllm_config)
    if requested is not None and requested[0] not in allowed_backends():
        name, option = requested
        problems.append(f"{option}={name}{_why(name)}: not an attention backend streaming "
                        f"layers are known exact with ({_allowed_text()}); choose an allowed one "
                        f"with {option}, or leave it unset for vLLM's choice")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding is not supported with streaming layers "
                        "(drop --speculative-config)")
    model = vllm_config.model_config
    if model is not None and getattr(model, "use_mla", False):
        problems.append("MLA attention (DeepSeek-style latent KV) is not supported by the "
                        "windowed path")
    dtype = str(cache.cache_dtype)
    if dtype not in ("auto", "bfloat16", "float16", "half", "float32", "float"):
        problems.append(
            f"kv_cache_dtype={dtype!r}: the host tier keeps the K/V the model computes, and a "
            "quantized KV cache would make streaming layers differ from the native result; use "
            "kv_cache_dtype='auto'")
    comp = vllm_config.compilation_config
    passes = getattr(comp, "pass_config", None)
    if passes is not None and getattr(passes, "fuse_attn_quant", False):
        problems.append("the attention + quantization fusion pass (pass_config.fuse_attn_quant) "
                        "gives attention a quantized output, which the windowed path does not "
                        "produce; turn the pass off")
    if model is not None:
        from .scratch import problems as scratch_problems

        problems.extend(scratch_problems(vllm_config))
    mode = comp.cudagraph_mode
    if mode is not None:
        if mode.has_full_cudagraphs():
            problems.append(
                f"cudagraph_mode={mode.name} captures attention in full CUDA graphs, where the "
                "connector cannot compute a streaming layer (a replay would run the backend over "
                "the one-token device window); use PIECEWISE (vLLM picks it for this connector "
                "unless told otherwise) or NONE / enforce_eager")
        elif mode.has_piecewise_cudagraphs() and not comp.is_attention_compiled_piecewise():
            problems.append(
                f"cudagraph_mode={mode.name} without attention among the splitting ops "
                f"(splitting_ops={comp.splitting_ops}): attention would be captured; keep vLLM's "
                "default splitting ops or use enforce_eager")
    return problems


def check_engine(vllm_config: "VllmConfig") -> None:
    _refuse(engine_problems(vllm_config))


def check_device_budget(vllm_config: "VllmConfig", kv_cache_config: Any) -> None:
    """The device KV cache must hold one scheduler step of every KV cache group plus vLLM's
    null block. vLLM 0.25.1's own start-up check does not count the null block, so a budget of
    exactly the blocks one request needs starts, then leaves a long request waiting forever
    (vLLM 0.32.0's check reserves it and refuses such a budget first; this check then agrees)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_utils import (
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
    )

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        return
    needed = 1 + cdiv(_max_memory_usage_bytes_from_groups(vllm_config, groups),
                      _pool_bytes_per_block(vllm_config, groups))
    if kv_cache_config.num_blocks < needed:
        step = vllm_config.scheduler_config.max_num_batched_tokens
        _refuse([f"the device KV cache has {kv_cache_config.num_blocks} blocks; one request needs "
                 f"at least {needed} (one scheduler step of max_num_batched_tokens={step} in each "
                 f"of the {len(groups)} KV cache groups, plus vLLM's null block): raise the "
                 "budget (num_gpu_blocks_override / gpu_memory_utilization) or lower "
                 "max_num_batched_tokens"])


def _attention_layers(vllm_config: "VllmConfig") -> dict[str, Any]:
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    return {name: layer for name, layer in ctx.items() if hasattr(layer, "impl")}


def layer_problems(vllm_config: "VllmConfig", layout: "_Layout",
                   cfg: StreamingConfig) -> list[str]:
    from vllm.v1.attention.backend import AttentionType

    problems: list[str] = []
    layers = _attention_layers(vllm_config)
    for name in layout.layers:
        layer = layers.get(name)
        if layer is None:
            problems.append(f"{name}: not found among the model's attention layers")
            continue
        if getattr(layer, "kv_sharing_target_layer_name", None):
            problems.append(f"{name} reads the KV cache of "
                            f"{layer.kv_sharing_target_layer_name} (KV sharing); exclude it with "
                            "'streaming_layers'")
        if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            problems.append(f"{name}: attention type {layer.attn_type} (only decoder "
                            "self-attention streams)")
        if getattr(layer.impl, "scale", None) is None:
            problems.append(f"{name}: its backend {type(layer.impl).__name__} has no softmax "
                            "scale the windowed path can read")
        if type(layer).__name__ != "Attention":
            problems.append(f"{name}: layer class {type(layer).__name__} (only vLLM's Attention "
                            "is known exact streamed); exclude it with 'streaming_layers'")
        window = getattr(layer, "sliding_window", None)
        if window is not None:
            problems.append(
                f"{name} is a sliding-window layer (sliding_window={window}) in a streaming KV "
                f"cache group (its window equals device_window_tokens={cfg.device_window_tokens})"
                ": the connector would attend its whole history; exclude it with "
                "'streaming_layers' or choose another device_window_tokens")
        backend = getattr(layer, "attn_backend", None)
        problem = backend_problem(backend)
        if problem is not None:
            problems.append(f"{name}: {problem}, or exclude the layer with 'streaming_layers'")
    streamed = set(layout.layers)
    for name, layer in layers.items():
        full = (getattr(layer, "sliding_window", None) is None
                and getattr(layer, "attn_type", None) == AttentionType.DECODER
                and type(layer).__name__ == "Attention")
        if full and name not in streamed and selects_layer(cfg, vllm_config.model_config, name):
            problems.append(
                f"{name} is selected for streaming but has no streaming KV cache spec (kv cache "
                f"dtype {getattr(layer, 'kv_cache_dtype', '?')}); the backend would attend it over "
                "a one-token window: exclude it with 'streaming_layers'")
    return problems


def check_layers(vllm_config: "VllmConfig", layout: "_Layout", cfg: StreamingConfig) -> None:
    _refuse(layer_problems(vllm_config, layout, cfg))
