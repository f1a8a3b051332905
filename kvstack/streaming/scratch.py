"""The windowed path's device scratch (issue 28, point 4): what a worker allocates on the
attention's device for streaming layers, after vLLM has profiled memory and sized the KV cache.

vLLM sizes the KV cache from a profiling run in which the connector does not exist yet, so memory
the connector allocates later is not counted, and at a high ``gpu_memory_utilization`` it could run
out mid-serve. kvstack's gpu_worker patch subtracts ``get_device_scratch_bytes`` of the configured
connector (``StreamingConnector.get_device_scratch_bytes`` = ``plan_for(vllm_config).total``) from
the KV cache memory before the cache is allocated, and logs it.

What is counted (bytes, per rank; T = ``max_num_batched_tokens``, the most query tokens of a step:
one request's, or all requests' together on the packed path (packed.py), whose accumulators are
alive at once; Hq / Hkv / D the rank's query heads, KV heads and head size; b the KV dtype's
bytes; ``window``: the window in tokens, StreamingConfig.window: ``window_tokens``, or ``window_mib``
in whole pages, at most ``max_model_len``):

- ``staging``: transfer.Transfer's two staging buffers of K and V, each a window plus one page
  (a window that starts inside a page): ``2 x 2 x staging_tokens(window, page) x Hkv x D x b``;
  allocated at start-up on a GPU (worker_side.prepare).
- ``attention``: the temporaries of one window's attention and LSE merge for a request of T
  tokens (windowed.py): the query regrouped for GQA, the kernel's output, its float32 copy and
  the running and merged accumulators, the new tokens' K/V repeated per query head:
  ``T x Hq x D x (4b + 16) + 16 x Hq x T``, plus a window's K/V made contiguous for the kernel
  ``2 x window x Hkv x D x b``.
- ``reference`` (only for soft-capped or ALiBi models, whose scores the fused kernel cannot
  apply: windowed.attend_reference): the float32 scores, their masked or capped copy and the
  probabilities of a window, ``3 x Hq x T x max(window, T) x 4``, the window of such a layer
  being at most 1024 tokens unless ``window_tokens`` says otherwise.

``device_scratch_mib`` (kv_connector_extra_config) replaces the sum; a value below the staging
buffers is refused at start-up (validate.engine_problems), one below the estimate is served with a
warning. The GPU check (ci/gpu/check_streaming.py) measures the peak the windowed path allocates
beyond what it held before against this plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import StreamingConfig
from .transfer import staging_tokens

MIB = 1 << 20


@dataclass(frozen=True)
class ScratchPlan:
    staging: int
    attention: int
    reference: int = 0
    configured: int | None = None  # device_scratch_mib, in bytes
    window: int = 0  # the window the plan is for, tokens (StreamingConfig.window)

    @property
    def estimate(self) -> int:
        return self.staging + self.attention + self.reference

    @property
    def total(self) -> int:
        """What is reserved out of the KV cache memory."""
        return self.configured if self.configured is not None else self.estimate

    def describe(self) -> str:
        parts = (f"staging {self.staging / MIB:.1f} MiB ({self.window}-token windows) + "
                 f"attention {self.attention / MIB:.1f} MiB"
                 + (f" + reference path {self.reference / MIB:.1f} MiB" if self.reference else ""))
        if self.configured is not None:
            return f"{self.total / MIB:.1f} MiB (device_scratch_mib; estimate: {parts})"
        return f"{self.total / MIB:.1f} MiB ({parts})"


def plan(cfg: StreamingConfig, *, q_heads: int, kv_heads: int, head_size: int, dtype_bytes: int,
         max_tokens: int, reference: bool = False, max_model_len: int | None = None) -> ScratchPlan:
    """`max_model_len`: caps a window sized by ``window_mib`` (StreamingConfig.window)."""
    T, b = max_tokens, dtype_bytes
    # the model's layers take the reference path (their window capped) or none does
    W = cfg.window(2 * kv_heads * head_size * b, max_model_len, reference)
    staging = 2 * 2 * staging_tokens(W, cfg.page_tokens) * kv_heads * head_size * b
    attention = T * q_heads * head_size * (4 * b + 16) + 16 * q_heads * T \
        + 2 * W * kv_heads * head_size * b
    ref = 3 * q_heads * T * max(W, T) * 4 if reference else 0
    configured = (int(cfg.device_scratch_mib * MIB) if cfg.device_scratch_mib is not None
                  else None)
    return ScratchPlan(staging, attention, ref, configured, W)


def needs_reference(model_config: Any) -> bool:
    """Whether the model's attention adds to plain softmax scores (soft-cap, ALiBi): the windowed
    path then computes scores in float32 (windowed.attend_reference)."""
    hf = getattr(model_config, "hf_text_config", None)
    if hf is None:
        return False
    if getattr(hf, "attn_logit_softcapping", None) or getattr(hf, "alibi", False):
        return True
    return getattr(hf, "model_type", "") in ("bloom", "mpt", "baichuan", "jais")


def plan_for(vllm_config: Any, cfg: StreamingConfig | None = None) -> ScratchPlan:
    """The plan of a rank of this engine (its share of the heads under tensor parallelism);
    `cfg`: the engine's StreamingConfig where the caller has parsed it already."""
    cfg = cfg if cfg is not None else StreamingConfig.from_vllm_config(vllm_config)
    model, par = vllm_config.model_config, vllm_config.parallel_config
    return plan(cfg, q_heads=model.get_num_attention_heads(par),
                kv_heads=model.get_num_kv_heads(par), head_size=model.get_head_size(),
                dtype_bytes=model.dtype.itemsize,
                max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                reference=needs_reference(model), max_model_len=model.max_model_len)


def problems(vllm_config: Any) -> list[str]:
    """A configured scratch that cannot hold the staging buffers (refused at start-up)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    cfg = StreamingConfig.from_extra(ktc.kv_connector_extra_config if ktc is not None else None)
    if cfg.device_scratch_mib is None:
        return []
    p = plan_for(vllm_config, cfg)
    if p.configured < p.staging:
        return [f"device_scratch_mib={cfg.device_scratch_mib:g} is below the windowed path's two "
                f"staging buffers ({p.staging / MIB:.1f} MiB at windows of {p.window} tokens"
                f", page_tokens={cfg.page_tokens}); raise it, lower window_mib or window_tokens, "
                "or leave it unset for the estimate"]
    return []
