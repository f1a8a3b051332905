"""The windowed path for a whole step: the histories of all its requests packed back to back into
windows of `window` tokens, each window loaded once and attended for all its requests at once.

A request's history is attended in windows (windowed.py); with many requests in a step, one window
per request and call leaves most of each staging buffer empty for short histories and costs one
kernel call, one copy wait and one Python round per request and window. Here the step's histories
(in batch order) are cut into windows of `window` tokens as one sequence: a window may hold the end
of one request's history and the start of the next's (a *piece* each). Per window:

- the pieces are loaded into one staging buffer at their offsets (transfer.Transfer.packed: one
  copy per run of consecutive pool slots, on the copy stream, the next window loading while this
  one is attended);
- on a GPU, one FlashAttention varlen call attends every piece's request rows over that piece
  (``cu_seqlens`` of the rows and of the pieces; GQA native, the LSE returned); on the CPU each
  piece is attended by torch's CPU flash kernel (windowed.WindowQuery), the same pieces;
- each request's partial is merged by log-sum-exp into its own accumulator (windowed.Partials).

The new tokens' own partial (causal over themselves) and the write-back of their K/V are those of
windowed.windowed_attention: a decode token's K/V go to the pools first and are read back with its
history (no partial of its own); a prefill chunk's are written back after the windows. Plain
scores only: a layer with soft-cap, ALiBi or sinks keeps the per-request path.

Imports only torch (and windowed.py / transfer.py): the floor bench can use it on a bare machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .transfer import PagedHistory, Transfer, slot_runs
from .windowed import Partials, WindowQuery, attend, cpu_kernel_dtype


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of request `req`'s history, at offset `at` of its window."""

    req: int
    start: int
    end: int
    at: int


def plan(spans: list[int], window: int) -> list[list[Piece]]:
    """The windows of histories of `spans` tokens (in order) packed back to back, `window` tokens
    each (the last one shorter): every token of every history in exactly one piece, the pieces of
    a window in request order and contiguous from offset 0."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    windows: list[list[Piece]] = []
    cur: list[Piece] = []
    fill = 0
    for req, span in enumerate(spans):
        pos = 0
        while pos < span:
            take = min(span - pos, window - fill)
            cur.append(Piece(req, pos, pos + take, fill))
            pos += take
            fill += take
            if fill == window:
                windows.append(cur)
                cur, fill = [], 0
    if cur:
        windows.append(cur)
    return windows


def span(new_tokens: int, ctx: int) -> int:
    """The history a request's windows cover: its `ctx` tokens, and a decode token's own (its K/V
    go to the pools first and are read back with its history)."""
    return ctx + 1 if new_tokens == 1 and ctx > 0 else ctx


class StepPlan:
    """What packed windows of a step need that every layer of a streaming group shares (same
    requests, pages and page size): the spans, the windows (`plan`) and each piece's runs of
    consecutive pool slots (`slot_runs`), the gather index of each window that is loaded by
    one gather (`Transfer.packed`'s ``index_cache``, filled by the first layer) and each window's
    arguments of the varlen call (`varlen_args`). Built once per step and window size (the
    worker's _Batch keeps it), not per layer."""

    __slots__ = ("spans", "windows", "runs", "gather_index", "rows", "_varlen")

    def __init__(self, segments: list, window: int, page_tokens: int):
        self.rows = [(a, b) for a, b, _ in segments]
        self._varlen: dict = {}
        self.spans = [span(b - a, r.start) for a, b, r in segments]
        self.windows = plan(self.spans, window)
        self.runs = [[slot_runs(segments[pc.req][2].pages, page_tokens, pc.start, pc.end - pc.start)
                      for pc in pieces] for pieces in self.windows]
        self.gather_index: dict = {}

    def varlen_args(self, i: int, device: torch.device) -> tuple:
        """Window i's varlen call: (first request, last request, cu_q, cu_k, max_q, max_k), the
        rows of its requests (a contiguous range of the batch; a request in that range without a
        piece here gets an empty key range) over its pieces back to back. The cumulative lengths
        of every window of the step are one int32 tensor, made on `device` by one copy at the
        first call (not two copies per window and layer), each window's a view of it."""
        args = self._varlen.get(device)
        if args is None:
            flat, spans = [], []
            for pieces in self.windows:
                by_req = {pc.req: pc for pc in pieces}
                first, last = pieces[0].req, pieces[-1].req
                a0 = self.rows[first][0]
                cu_q, cu_k, end_k = [0], [0], 0
                for r in range(first, last + 1):
                    pc = by_req.get(r)
                    cu_q.append(self.rows[r][1] - a0)
                    end_k = pc.at + pc.end - pc.start if pc is not None else end_k
                    cu_k.append(end_k)
                spans.append((first, last, len(flat), len(cu_q),
                              max(b - a for a, b in zip(cu_q, cu_q[1:])),
                              max(b - a for a, b in zip(cu_k, cu_k[1:]))))
                flat += cu_q + cu_k
            t = torch.tensor(flat, dtype=torch.int32, device=device)
            args = [(first, last, t[o:o + n], t[o + n:o + 2 * n], mq, mk)
                    for first, last, o, n, mq, mk in spans]
            self._varlen[device] = args
        return args[i]


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
    """FlashAttention's varlen forward (CUDA): (out [rows, Hq, D], lse [Hq, rows] float32).
    `cu_q` / `cu_k`: int32 cumulative row counts on q's device; GQA native; ``causal`` only with
    as many keys as queries per request (the new tokens over themselves)."""
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                  False, scale=scale)
    out, lse = res[0], res[1]
    if lse.dim() == 3:  # [1, Hq, rows] in some builds
        lse = lse[0]
    if lse.shape[0] != q.shape[1]:  # [rows, Hq]
        lse = lse.transpose(0, 1)
    return out, lse.float()


_VARLEN_OK: dict[tuple, bool] = {}


def varlen_usable(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Whether FlashAttention's varlen forward runs here and gives what the per-piece kernel gives
    on a small GQA problem with an empty key range (checked once per device, dtype and shape, as
    the floor bench picks its kernel): where it does not, packed windows are attended per piece."""
    key = (device, dtype, hq, hkv, d)
    ok = _VARLEN_OK.get(key)
    if ok is None:
        gen = torch.Generator().manual_seed(123)
        q = torch.randn((6, hq, d), generator=gen).to(dtype)
        k = torch.randn((100, hkv, d), generator=gen).to(dtype)
        v = torch.randn((100, hkv, d), generator=gen).to(dtype)
        cu_q, cu_k = [0, 3, 4, 6], [0, 70, 70, 100]  # the second request: no keys here
        try:
            out, lse = varlen(q.to(device), k.to(device), v.to(device),
                              torch.tensor(cu_q, dtype=torch.int32, device=device),
                              torch.tensor(cu_k, dtype=torch.int32, device=device), 3, 70,
                              d ** -0.5)
            ok = True
            for (qa, qb), (ka, kb) in (((0, 3), (0, 70)), ((4, 6), (70, 100))):
                ro, rl = WindowQuery(q[qa:qb], d ** -0.5).attend(k[ka:kb], v[ka:kb])
                ok = ok and torch.allclose(out[qa:qb].float().cpu(), ro.float(), atol=2e-2) \
                    and torch.allclose(lse[:, qa:qb].cpu(), rl.float(), atol=2e-2)
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _VARLEN_OK[key] = ok
    return ok


class _Req:
    """One request of the step: its rows, history span, query prepared for the windows, partials."""

    __slots__ = ("a", "b", "ctx", "span", "hist", "wq", "q", "parts", "kernel", "append_after")

    def __init__(self, a, b, r, query, key, value, transfer, k_pool, v_pool, scale):
        self.a, self.b, self.ctx = a, b, r.start
        T, Hq, Hkv = b - a, query.shape[1], key.shape[1]
        q = query[a:b]
        self.hist = PagedHistory(transfer, k_pool, v_pool, r.pages)
        self.parts = Partials(query.device)
        self.span = span(T, self.ctx)
        self.append_after = self.span == self.ctx
        if not self.append_after:  # a decode token: its K/V first, read back with its history
            self.hist.append(self.ctx, key[a:b], value[a:b])
        self.kernel = (cpu_kernel_dtype(query.dtype, T * Hq // Hkv)
                       if query.device.type == "cpu" and self.ctx > 0 else None)
        self.wq = WindowQuery(q, scale, self.kernel)
        self.q = q.float() if self.kernel is not None else q
        if self.span == self.ctx:  # the new tokens over themselves (causal)
            self.parts.add(*attend(self.q, key[a:b], value[a:b], scale, 0, None, self.ctx,
                                   self.ctx))


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     segments: list, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     transfer: Transfer, window: int, scale: float, output: torch.Tensor,
                     use_varlen: bool | None = None, step: StepPlan | None = None) -> None:
    """Causal attention of each request of the step (`segments`: (first row, end row, ReqStep
    with ``start`` and ``pages``) in batch order) over its history in the pools + its new tokens,
    into ``output[a:b]``; the new tokens' K/V written to the pools. ``use_varlen``: one
    FlashAttention varlen call per window (default: on CUDA), else one kernel call per piece.
    ``step``: the step's StepPlan for these segments, `window` and the pools' page size (made
    here when not given)."""
    if step is None:
        step = StepPlan(segments, window, k_pool.shape[1])
    reqs = [_Req(a, b, r, query, key, value, transfer, k_pool, v_pool, scale)
            for a, b, r in segments]
    assert step.spans == [rq.span for rq in reqs], "a StepPlan of another step"
    windows = step.windows
    # a window's staging dtype: its requests' kernel dtype where they agree, else float32 (each
    # WindowQuery converts what is not its own)
    dtypes = []
    for pieces in windows:
        kinds = {reqs[pc.req].kernel for pc in pieces}
        dtypes.append(kinds.pop() if len(kinds) == 1 else torch.float32)
    if use_varlen is None:
        use_varlen = query.device.type == "cuda" and varlen_usable(
            query.device, query.dtype, query.shape[1], key.shape[1], query.shape[2])
    loads = transfer.packed(k_pool, v_pool, windows, step.runs, window, dtypes, step.gather_index)
    for i, (pieces, kvs, whole) in enumerate(loads):
        if use_varlen and whole is not None and _attend_varlen(
                reqs, pieces, whole, query, scale, step.varlen_args(i, query.device)):
            continue
        for pc, (k, v) in zip(pieces, kvs):
            rq = reqs[pc.req]
            part = rq.wq(k, v)
            rq.parts.add(*(part or attend(rq.q, k, v, scale, None, None, rq.ctx, pc.start)))
    for rq, (a, b, _) in zip(reqs, segments):
        if rq.append_after:  # after the windows (a GPU's first window load need not wait)
            rq.hist.append(rq.ctx, key[a:b], value[a:b])
        output[a:b].copy_(rq.parts.result())


def _attend_varlen(reqs: list[_Req], pieces: list[Piece], whole, query: torch.Tensor,
                   scale: float, args: tuple) -> bool:
    """One varlen call for a window (`args`: `StepPlan.varlen_args`): the rows of its requests
    (a contiguous range of the batch; a request in that range without a piece here gets an empty
    key range, its result unused) over their pieces. False where the kernel refuses (the caller
    attends per piece)."""
    k, v, _ = whole
    first, last, cu_q, cu_k, max_q, max_k = args
    a0 = reqs[first].a
    try:
        out, lse = varlen(query[a0:reqs[last].b], k, v, cu_q, cu_k, max_q, max_k, scale)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    for i in dict.fromkeys(pc.req for pc in pieces):
        rq = reqs[i]
        rows = slice(rq.a - a0, rq.b - a0)
        rq.parts.add(out[rows], lse[:, rows].contiguous())  # merge_attn_states: contiguous LSE
    return True
