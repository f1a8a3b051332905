"""CPU path: the host tier in vLLM's CPU paged-cache layout, attended in place by vLLM's kernel.

On a CPU engine the host tier and the "device" are the same memory, so the cheapest way to attend
a request's history is where it lies. The host store then keeps each streaming layer in the CPU
attention backend's own cache layout (``[pages, kv_heads, page_tokens, 2 * head_size]``,
`HostStore(layout="cpu_kernel")`), a host page being one kernel block. Per streaming layer and
step, for all requests of the batch at once:

1. the new tokens' K/V are written to their host pages by the backend's own cache write
   (``do_kv_cache_update`` with the pages' slots);
2. the backend's ``forward`` attends every request over its whole history + new tokens, with the
   request's host pages as its block table (causal, exactly what native vLLM computes when all
   the KV is on the device): no windows, no gathers, no log-sum-exp merge, no Python loop over
   requests in the kernel call.

`usable` / `fits` decide at start-up (all streaming layers on vLLM's CPU backend, the page size
one of its kernel block sizes); otherwise, or with ``cpu_native_attention: false``, the
windowed path (windowed.py, what a GPU runs) attends the history in windows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
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


def fits(layer, page_tokens: int) -> bool:
    """The layer is on vLLM's CPU backend, and a host page can be one of its kernel blocks."""
    if not usable(layer):
        return False
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        return False
    for size in backend.get_supported_kernel_block_sizes():
        base = getattr(size, "base", None)  # MultipleOf(n)
        if (page_tokens % base == 0) if base else page_tokens == size:
            return True
    return False


@dataclass
class KernelBatch:
    """One step's batch of a streaming group as vLLM's CPU kernel takes it: the requests' host
    pages as block table, their lengths after this step, and the host slots of the new tokens.
    Built once per step and group (`kernel_batch`), shared by the group's layers."""

    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max pages]; one request: a view of the worker's table (read only)
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    _meta: dict[Any, SimpleNamespace] = field(default_factory=dict)

    def metadata(self, layer, query: torch.Tensor, key: torch.Tensor) -> SimpleNamespace:
        """The backend's attention metadata for this batch (its scheduler metadata depends on
        the layer's heads, ISA and KV dtype, the same for every layer of a group)."""
        impl = layer.impl
        isa = cpu_attn_isa(layer)
        hq, (hkv, d) = query.shape[1], key.shape[1:]
        tag = (hq, hkv, d, isa, query.dtype, impl.sliding_window,
               getattr(impl, "kv_cache_dtype", None))
        meta = self._meta.get(tag)
        if meta is None:
            meta = self._meta[tag] = SimpleNamespace(
                num_actual_tokens=self.num_tokens, query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens, causal=True, dynamic_causal=None,
                slot_mapping=self.slot_mapping, block_table=self.block_table,
                scheduler_metadata=_ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=self.seq_lens.shape[0], num_heads=hq, num_kv_heads=hkv, head_dim=d,
                    seq_lens=self.seq_lens, dtype=query.dtype,
                    query_start_loc=self.query_start_loc, causal=True,
                    sliding_window_size=impl.sliding_window, isa=isa,
                    enable_kv_split=_split_kv(),
                    **cpu_scheduler_metadata_kwargs(_ops.cpu_attn_get_scheduler_metadata, impl)),
                encoder_cache=None)
        return meta


@functools.lru_cache(maxsize=None)
def _split_kv() -> bool:
    """VLLM_CPU_ATTN_SPLIT_KV, read once per process as vLLM's metadata builders do (at their
    construction; an env lookup per step costs more than the rest of the metadata's Python)."""
    return bool(_envs.VLLM_CPU_ATTN_SPLIT_KV)


def kernel_batch(segments, page_tokens: int) -> KernelBatch:
    """`segments`: (first row, last row + 1, ReqStep) per request of the batch, in batch order,
    contiguous from row 0."""
    P = page_tokens
    ends = [r.start + r.num_tokens for _, _, r in segments]
    used = [-(-end // P) for end in ends]
    only = segments[0][2] if len(segments) == 1 else None
    if only is not None and only.page_array is not None and only.page_array.shape[0] >= used[0]:
        # one request (a lone decode): its row is a view of the worker's table, nothing copied
        table = only.page_array[:used[0]].unsqueeze(0)
    else:
        table = torch.zeros(len(segments), max(used), dtype=torch.int32)
        for i, (_, _, r) in enumerate(segments):
            k = used[i]
            if r.page_array is not None and r.page_array.shape[0] >= k:
                table[i, :k] = r.page_array[:k]  # the worker's table: no list conversion
            else:  # sink pages past the table (a request failing this step), or no worker table
                table[i, :k] = torch.tensor(r.pages[:k], dtype=torch.int32)
    # slot of each new token: its request's page at pos // P, offset pos % P
    if segments[-1][1] <= 64:  # few new tokens (decode): plain lists are quicker (and numpy
        # makes a small tensor in a third of torch.tensor's time)
        slots = torch.from_numpy(np.array(
            [r.pages[p // P] * P + p % P for (_, _, r), e in zip(segments, ends)
             for p in range(r.start, e)], dtype=np.int64))
    else:
        row = torch.repeat_interleave(torch.arange(len(segments)),
                                      torch.tensor([r.num_tokens for _, _, r in segments]))
        pos = torch.cat([torch.arange(r.start, e) for (_, _, r), e in zip(segments, ends)])
        slots = table[row, pos // P].long() * P + pos % P
    qsl = [0] + [b for _, b, _ in segments]
    lens = np.array(qsl + ends, dtype=np.int32)  # one array: both tensors are views of it
    return KernelBatch(num_tokens=qsl[-1], query_start_loc=torch.from_numpy(lens[:len(qsl)]),
                       seq_lens=torch.from_numpy(lens[len(qsl):]), block_table=table,
                       slot_mapping=slots)


def attend_in_place(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    output: torch.Tensor, cache: torch.Tensor, batch: KernelBatch) -> None:
    """Write the batch's new K/V to their host pages in `cache` (the layer's host-tier tensor,
    CPU kernel layout), then attend every request over its pages; `output[:num_tokens]` is
    written."""
    impl = layer.impl
    n = batch.num_tokens
    impl.do_kv_cache_update(layer, key[:n], value[:n], cache, batch.slot_mapping)
    # no key/value: forward writes nothing more where it would (the cache is written once)
    impl.forward(layer, query, None, None, cache, batch.metadata(layer, query, key), output)
