"""Many row runs copied in one kernel launch (issue 32, point 6): scattered host-tier pages.

A window whose pages lie in order is one copy (one DMA) per run of consecutive pages; a window of
a request whose pages are scattered over the pool (a host tier after churn) is one copy per page:
~2,048 copies of 64 KiB for a 64K-token window of 32-token pages, issue-bound (one H200,
2026-11-30: prefill 8.98x and a decode step 8.37x of the PCIe floor, against 1.70x and 1.02x with
the pages in order). Here one kernel copies every run of a window, for K and V at once, reading
the host pool where it lies: on a GPU through the registered (page-locked, so device-mapped) host
memory, unified virtual addressing (UVA), on the copy stream; on the CPU, vLLM's engine, the same
rows by one ``index_select`` per pool.

- `run_rows(runs)`: the (source row, destination row) of every row of a list of runs
  ``(source row, destination row, rows)``, as one int32 tensor ``[2, rows]``.
- `copy_rows_kv(k_dst, v_dst, k_src, v_src, index)`: ``dst[index[1]] = src[index[0]]`` for K and V
  (rows: the first dim). ``kernel="triton"``: our Triton kernel (a GPU; on the CPU only under
  ``TRITON_INTERPRET=1``, which is how CI checks it), ``"torch"``: ``index_select`` +
  ``index_copy_`` (same device, any dtypes: it converts).
- `triton_usable(device, dtype, row_shape)`: whether the kernel runs here over a registered host
  source and gives the exact rows (checked once per device, dtype and row shape on a small
  problem, as `packed.varlen_usable` checks the varlen kernel); where it does not, the caller copies
  run by run.

Imports only torch (triton when the kernel is asked for): the floor bench uses it on a bare machine.
"""

from __future__ import annotations

import math

import torch

# a window with at least this many runs is gathered in one launch (fewer: one copy per run)
MIN_RUNS = 8

_kernel = None  # the Triton kernel, compiled (or interpreted) on first use


def run_rows(runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """``[2, rows]`` int32 on the CPU: the source and destination row of each row of `runs`
    ((source row, destination row, rows) each), in order."""
    t = torch.tensor(runs, dtype=torch.int64).view(-1, 3)
    n = t[:, 2]
    total = int(n.sum())
    run = torch.repeat_interleave(torch.arange(len(runs)), n, output_size=total)
    within = torch.arange(total) - torch.repeat_interleave(n.cumsum(0) - n, n, output_size=total)
    return (t[run, :2].T + within).to(torch.int32).contiguous()


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_rows_kv(k_src, v_src, k_dst, v_dst, index, rows, row_elems,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
            # program (p, c): rows [p * ROWS, (p + 1) * ROWS) of the index, elements
            # [c * BLOCK, (c + 1) * BLOCK) of each row, for K and V
            r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            live = r < rows
            src = tl.load(index + r, mask=live, other=0).to(tl.int64)
            dst = tl.load(index + rows + r, mask=live, other=0).to(tl.int64)
            e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = live[:, None] & (e < row_elems)[None, :]
            s = src[:, None] * row_elems + e[None, :]
            d = dst[:, None] * row_elems + e[None, :]
            tl.store(k_dst + d, tl.load(k_src + s, mask=mask), mask=mask)
            tl.store(v_dst + d, tl.load(v_src + s, mask=mask), mask=mask)

        _kernel = copy_rows_kv
    return _kernel


def _launch(k_dst, v_dst, k_src, v_src, index) -> None:
    rows = index.shape[1]
    row_elems = k_src[0].numel()
    block = min(1024, 1 << max(0, (row_elems - 1).bit_length()))
    per = max(1, min(16, 4096 // block))  # rows per program: ~4K elements a program
    grid = (-(-rows // per), -(-row_elems // block))
    _triton_kernel()[grid](k_src, v_src, k_dst, v_dst, index, rows, row_elems,
                           ROWS=per, BLOCK=block)


def copy_rows_kv(k_dst: torch.Tensor, v_dst: torch.Tensor, k_src: torch.Tensor,
                 v_src: torch.Tensor, index: torch.Tensor, kernel: str = "torch") -> None:
    """``k_dst[index[1]] = k_src[index[0]]`` and the same for V; rows are the first dim, the rest
    of each row contiguous. ``kernel``: "triton" (one launch for K and V; the destinations and the
    sources in one dtype, `index` where the kernel runs: on the device, or any tensor under the
    interpreter) or "torch" (`index_select` + `index_copy_`, converting the dtype)."""
    if not index.shape[1]:
        return
    if kernel == "triton":
        assert k_dst.dtype == k_src.dtype == v_dst.dtype == v_src.dtype, \
            "the kernel does not convert"
        assert all(t.is_contiguous() for t in (k_dst, v_dst, k_src, v_src, index))
        _launch(k_dst, v_dst, k_src, v_src, index)
        return
    src = index[0].to(device=k_src.device, dtype=torch.int64)
    dst = index[1].to(device=k_dst.device, dtype=torch.int64)
    for d, s in ((k_dst, k_src), (v_dst, v_src)):
        d.index_copy_(0, dst, s.index_select(0, src).to(d.dtype))


_USABLE: dict[tuple, bool] = {}


def triton_usable(device: torch.device, dtype: torch.dtype, row_shape: tuple) -> bool:
    """Whether our kernel, launched on `device`, reads a registered host source through UVA and
    gives exactly its rows (a small problem, shuffled runs, checked once per device, dtype and row
    shape). False where triton is missing, the kernel fails to build or launch (a CPU tensor
    Triton cannot reach), or a row differs."""
    key = (str(device), dtype, tuple(row_shape))
    ok = _USABLE.get(key)
    if ok is None:
        ok = False
        try:
            from .pinned import HostArena

            n = 64
            arenas = [HostArena(n * math.prod(row_shape), dtype, pin=device.type == "cuda")
                      for _ in range(2)]
            if device.type != "cuda" or all(a.method == "cudaHostRegister" for a in arenas):
                gen = torch.Generator().manual_seed(7)
                k_src, v_src = (a.tensor.view(n, *row_shape) for a in arenas)
                k_src.copy_(torch.randn(k_src.shape, generator=gen))
                v_src.copy_(torch.randn(v_src.shape, generator=gen))
                runs = [(40, 0, 3), (5, 3, 1), (60, 4, 4), (0, 8, 2)]
                index = run_rows(runs).to(device)
                k_dst = torch.zeros((10, *row_shape), dtype=dtype, device=device)
                v_dst = torch.zeros_like(k_dst)
                copy_rows_kv(k_dst, v_dst, k_src, v_src, index, kernel="triton")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                want = torch.cat([torch.arange(40, 43), torch.tensor([5]), torch.arange(60, 64),
                                  torch.arange(0, 2)])
                ok = (torch.equal(k_dst.cpu(), k_src[want])
                      and torch.equal(v_dst.cpu(), v_src[want]))
            del arenas
        except Exception:  # noqa: BLE001 - no triton, no UVA, no build: copy run by run
            ok = False
        _USABLE[key] = ok
    return ok
