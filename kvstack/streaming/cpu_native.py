"""CPU fast path for a streaming layer whose history fits in one window.

When a request's whole host-tier history (``ctx <= window_tokens``) is attended in one window,
its attention is plain causal softmax attention over [history; new tokens]: no partial results,
so no log-sum-exp is needed. Then vLLM's own CPU attention kernel can compute it, through the
layer's own backend (`CPUAttentionBackendImpl.forward`) on a scratch paged KV cache that holds
exactly this request: the history window (read from the host tier) and the new tokens. The result
is what the native backend computes for a request whose KV is all on the device.

Longer histories take the windowed path (torch kernels that return the LSE, merged by
``merge_attn_states``): vLLM's CPU kernel (0.25.1, 0.32.0) does not return the LSE, and a kernel change would
need a recompile. `attend_one_window` returns False whenever the layer's backend is not vLLM's CPU
backend, so GPUs always take the windowed path.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .compat import cpu_attn_isa, cpu_scheduler_metadata_kwargs

try:  # vLLM's CPU attention backend (absent or unusable: the windowed path is used)
    from vllm import _custom_ops as _ops
    from vllm import envs as _envs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
except Exception:  # noqa: BLE001
    CPUAttentionBackendImpl = None


def usable(layer) -> bool:
    impl = getattr(layer, "impl", None)
    return (CPUAttentionBackendImpl is not None and isinstance(impl, CPUAttentionBackendImpl)
            and getattr(impl, "kv_sharing_target_layer_name", None) is None)


def attend_one_window(layer, query: torch.Tensor, hist_k: torch.Tensor | None,
                      hist_v: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                      out: torch.Tensor, block_size: int) -> bool:
    """Causal attention of ``query`` [T, Hq, D] (positions ctx..ctx+T-1) over the history
    [ctx, Hkv, D] (None when ctx == 0) and the new K/V [T, Hkv, D], written to ``out`` [T, Hq, D]
    by vLLM's CPU kernel. Returns False (nothing written) when the layer is not on that backend."""
    if not usable(layer):
        return False
    impl = layer.impl
    T = query.shape[0]
    if hist_k is not None and hist_k.shape[0]:
        keys = torch.cat([hist_k.to(new_k.dtype), new_k])
        values = torch.cat([hist_v.to(new_v.dtype), new_v])
    else:
        keys, values = new_k, new_v
    n = keys.shape[0]
    num_blocks = -(-n // block_size)
    hkv, d = new_k.shape[1], new_k.shape[2]
    cache_dtype = torch.uint8 if impl.is_fp8_kv_cache else new_k.dtype
    # the backend's own cache shape: [blocks, kv_heads, block_size, 2 * head_size]
    # zeros: the kernel reads whole blocks, and garbage (NaN) past the last token would leak
    kv_cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=cache_dtype)
    query_start_loc = torch.tensor([0, T], dtype=torch.int32)
    seq_lens = torch.tensor([n], dtype=torch.int32)
    slot_mapping = torch.arange(n, dtype=torch.int64)
    meta = SimpleNamespace(
        num_actual_tokens=T, query_start_loc=query_start_loc, seq_lens=seq_lens, causal=True,
        dynamic_causal=None, slot_mapping=slot_mapping,
        block_table=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        scheduler_metadata=_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=impl.num_heads, num_kv_heads=hkv, head_dim=d,
            seq_lens=seq_lens, dtype=query.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=impl.sliding_window, isa=cpu_attn_isa(layer),
            enable_kv_split=_envs.VLLM_CPU_ATTN_SPLIT_KV,
            **cpu_scheduler_metadata_kwargs(_ops.cpu_attn_get_scheduler_metadata, impl)),
        encoder_cache=None)
    # The backend's own cache write, then its attention with no key/value (so forward writes
    # nothing more, where it would: on every vLLM the cache is written exactly once).
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slot_mapping)
    impl.forward(layer, query, None, None, kv_cache, meta, out)
    return True
