#!/usr/bin/env python3
"""Standalone benchmark of windowed streaming attention + LSE merge (torch only; issue 15).

A Llama-4-Scout-shaped NoPE stack (12 layers, 8 KV heads x 128, 40 query heads, bf16) keeps its
whole KV history in a paged host tier (pinned when CUDA is there). Each layer's history is
attended window by window: the pages of a window are copied by page-table-driven DMA (one
``copy_`` per run of consecutive pages, no host gather) into one of two device staging buffers
on a copy stream, while the compute stream attends the previous window (all requests of the batch
in one varlen call) and merges it by log-sum-exp into a running (out, lse) accumulator. Design and
cost model: docs/streaming.md ("The GPU path").

Figures, per context size (``--contexts``; ``max`` = what fits in a fraction of MemAvailable):

- prefill over a cached context: ``--prefill-tokens`` new tokens of one request attend the whole
  cached context in every layer; floor = KV bytes of the context / measured H2D bandwidth;
- decode step (``--decode-batch`` requests, one new token each; the last ``--recent-tokens`` of
  each request stay on the device): ``stream`` (copy the older history) with floor = streamed
  bytes / H2D bandwidth, and ``host`` (q to the host, attention on the host's cores over the
  pinned pool, out + lse back) with floor = the same bytes / host memory read bandwidth.

Before the figures, an exactness check (windowed + merged == direct fp32 attention, every path)
with a negative control (one history key made dominant, then flipped: the output must change);
exit status 1 if either fails. The last line starts with ``RESULT `` and carries every figure.

    python bench/streaming_gpu.py                         # CUDA: full sizes (128K,1M,max)
    python bench/streaming_gpu.py --device cpu --tiny     # what CI runs (< 30 s on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

# the connector's copy planning, its window attention, its varlen kernel, its pinned pools and its
# gather of scattered pages (kvstack/streaming/transfer.py, windowed.py, packed.py, pinned.py and
# gather.py import only torch, triton for the gather kernel, vLLM's merge only when it is there;
# the working tree a GPU machine gets holds them, so nothing needs carrying)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvstack.streaming import gather  # noqa: E402
from kvstack.streaming.config import DEFAULT_WINDOW_MIB  # noqa: E402  (the connector's window)
from kvstack.streaming.packed import StepPlan, packed_attention, varlen, varlen_usable  # noqa: E402
from kvstack.streaming.pinned import HostArena  # noqa: E402
from kvstack.streaming.transfer import Medium, PagedHistory, Transfer, slot_runs  # noqa: E402
from kvstack.streaming.windowed import WindowQuery, windowed_attention  # noqa: E402

NEG_INF = float("-inf")
GIB = 1 << 30
MIB = 1 << 20


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Geometry, page tables, window plans (device-agnostic)


@dataclass(frozen=True)
class Geometry:
    layers: int
    hq: int
    hkv: int
    d: int
    page: int
    dtype: torch.dtype

    @property
    def rep(self) -> int:
        return self.hq // self.hkv

    @property
    def layer_token_bytes(self) -> int:
        """K + V bytes of one token in one layer: 2 x Hkv x D x sizeof(dtype)."""
        return 2 * self.hkv * self.d * torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        return self.layer_token_bytes * self.layers

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)


def page_table(n_pages: int, pool_pages: int, order: str, seed: int, rotate: int = 0) -> list[int]:
    """The pool pages of one request's history, in token order. ``contiguous``: consecutive pool
    pages (from ``rotate``, wrapping); ``shuffled``: a random permutation of the pool's pages."""
    assert n_pages <= pool_pages, (n_pages, pool_pages)
    if order == "contiguous":
        return [(rotate + i) % pool_pages for i in range(n_pages)]
    perm = list(range(pool_pages))
    random.Random(seed).shuffle(perm)
    return [perm[(rotate + i) % pool_pages] for i in range(n_pages)]


def token_runs(pages: list[int], page: int, start: int, end: int) -> list[tuple[int, int]]:
    """Tokens [start, end) of a history as runs (first token in the flat pool, length), runs of
    consecutive pool pages coalesced into one: the connector's own planning
    (kvstack.streaming.transfer.slot_runs, what its windows and write-backs copy by)."""
    return [(slot, n) for slot, _, n in slot_runs(pages, page, start, max(0, end - start))]


@dataclass
class Window:
    """One window of the streamed history of a batch: the copies that fill a staging buffer and,
    for the attention call, which requests are in it and how many of their tokens."""
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src tok, dst tok, n)
    reqs: list[int] = field(default_factory=list)
    k_lens: list[int] = field(default_factory=list)
    total: int = 0
    meta: dict = field(default_factory=dict)  # device tensors, filled by Batch.prepare


def plan_windows(histories: list[tuple[list[int], int, int]], page: int,
                 window_tokens: int) -> list[Window]:
    """Cut the streamed histories (page table, first token, end token) of all requests of a batch
    into windows of at most ``window_tokens`` tokens, filled request after request; a request's
    tokens inside one window are contiguous in the staging buffer."""
    windows = [Window()]
    for r, (pages, start, end) in enumerate(histories):
        for src, n in token_runs(pages, page, start, end):
            while n:
                w = windows[-1]
                if w.total == window_tokens:
                    w = Window()
                    windows.append(w)
                take = min(n, window_tokens - w.total)
                w.copies.append((src, w.total, take))
                if not w.reqs or w.reqs[-1] != r:
                    w.reqs.append(r)
                    w.k_lens.append(0)
                w.k_lens[-1] += take
                w.total += take
                src, n = src + take, n - take
    return [w for w in windows if w.total]


def cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


# ----------------------------------------------------------------------------------------------
# Host tier


class HostTier:
    """Per layer a K and a V pool [num_pages, page, Hkv, D]. With CUDA the pools are page-locked:
    each a `pinned.HostArena` (the connector's host tier allocates its pools the same way):
    page-aligned, exactly its size, registered with cudaHostRegister (torch's pinned allocator
    rounds each allocation up to a power of two, which would waste up to half of the host's
    memory); ``pin_memory=True`` allocation is the fallback."""

    def __init__(self, geo: Geometry, num_pages: int, pin: bool, fill_seed: int | None,
                 label: str = "host tier"):
        self.geo, self.num_pages = geo, num_pages
        shape = (num_pages, geo.page, geo.hkv, geo.d)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pin_method = "none"
        self.pin_error = ""
        self._arenas: list[HostArena] = []  # unregistered when the tier (and they) are collected
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(fill_seed if fill_seed is not None else 0)
        pattern = torch.randn((64, geo.page, geo.hkv, geo.d), generator=gen).to(geo.dtype)
        for layer in range(geo.layers):
            for pools in (self.k, self.v):
                arena = HostArena(math.prod(shape), geo.dtype, pin)
                self._arenas.append(arena)
                self.pin_method = arena.method
                self.pin_error = self.pin_error or arena.error
                t = arena.tensor.view(shape)
                if fill_seed is not None:  # small pools (exactness check): random everywhere
                    t.copy_(torch.randn(shape, generator=gen))
                else:  # big pools: a repeated random pattern (touches every page; fast)
                    full = num_pages // 64 * 64
                    if full:
                        t[:full].view(-1, *pattern.shape).copy_(pattern.expand(
                            full // 64, *pattern.shape))
                    if num_pages - full:
                        t[full:].copy_(pattern[:num_pages - full])
                pools.append(t)
            if num_pages * geo.page * geo.layer_token_bytes >= GIB:
                log(f"  {label}: layer {layer + 1}/{geo.layers} allocated "
                    f"({time.perf_counter() - t0:.1f} s, pinned: {self.pin_method})")

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geo
        return self.k[layer].view(-1, g.hkv, g.d), self.v[layer].view(-1, g.hkv, g.d)

    def gather(self, layer: int, pages: list[int], start: int, end: int, device) -> tuple:
        """Tokens [start, end) of a history, gathered (setup and reference only, never timed)."""
        kf, vf = self.flat(layer)
        runs = token_runs(pages, self.geo.page, start, end)
        if not runs:
            e = kf[:0]
            return e.to(device), e.to(device)
        k = torch.cat([kf[s:s + n] for s, n in runs])
        v = torch.cat([vf[s:s + n] for s, n in runs])
        return k.to(device), v.to(device)


# ----------------------------------------------------------------------------------------------
# Attention kernels (partial attention with LSE) and the merge


class Attention:
    """Partial attention of varlen batches: q [Tq, Hq, D], k/v [Tk, Hkv, D], cumulative lengths per
    request -> (out [Tq, Hq, D], lse [Hq, Tq] fp32). ``causal`` is only used with Tq == Tk per
    request (a request's new tokens over themselves).

    - ``flash_varlen`` (CUDA): one ``aten._flash_attention_forward`` call for all requests
      (cum_seq_q / cum_seq_k, GQA native in FlashAttention-2, LSE [Hq, Tq]).
    - ``sdpa_flash`` (CUDA fallback) / ``cpu_flash`` (CPU): one call per request of
      ``aten._scaled_dot_product_flash_attention`` / ``..._for_cpu``; GQA without repeating K/V
      when not causal (the rep query heads of a KV head become rep x more query rows)."""

    def __init__(self, device: torch.device, geo: Geometry, impl: str):
        self.device, self.geo, self.impl = device, geo, impl
        if impl == "cpu_flash":
            self.op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        elif impl == "sdpa_flash":
            self.op = torch.ops.aten._scaled_dot_product_flash_attention
        else:
            self.op = None

    def __call__(self, q, k, v, cu_q: list[int], cu_k: list[int], causal: bool,
                 cu_q_t=None, cu_k_t=None):
        if self.impl == "flash_varlen":  # the connector's packed windows' call (packed.varlen)
            if cu_q_t is None:
                cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=self.device)
                cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=self.device)
            return varlen(q, k, v, cu_q_t, cu_k_t, max(b - a for a, b in zip(cu_q, cu_q[1:])),
                          max(b - a for a, b in zip(cu_k, cu_k[1:])), self.geo.scale,
                          causal=causal)
        outs, lses = [], []
        for r in range(len(cu_q) - 1):
            qr = q[cu_q[r]:cu_q[r + 1]]
            kr, vr = k[cu_k[r]:cu_k[r + 1]], v[cu_k[r]:cu_k[r + 1]]
            o, lse = self._one(qr, kr, vr, causal)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), torch.cat(lses, dim=1)

    def _one(self, q, k, v, causal):
        g = self.geo
        T = q.shape[0]
        if not causal:  # the connector's window attention (windowed.WindowQuery), in q's dtype
            out, lse = WindowQuery(q, g.scale, q.dtype).attend(k, v)
            return out, lse.float()
        assert k.shape[0] == T, "causal partials are square (new tokens over themselves)"
        kh = k.repeat_interleave(g.rep, 1).transpose(0, 1).unsqueeze(0)
        vh = v.repeat_interleave(g.rep, 1).transpose(0, 1).unsqueeze(0)
        res = self.op(q.transpose(0, 1).unsqueeze(0), kh, vh, 0.0, True, scale=g.scale)
        return res[0][0].transpose(0, 1), res[1][0].float()


def merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
               part_lse: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """acc [T, H, D] fp32 / acc_lse [H, T] fp32 <- LSE merge with a partial result (in place).
    ``rows``: the partial covers only these rows of the accumulator. An LSE of +inf (what
    FlashAttention writes for an empty key range) counts as -inf: no keys."""
    if rows is not None:
        a, al = acc.index_select(0, rows), acc_lse.index_select(1, rows)
    else:
        a, al = acc, acc_lse
    pl = part_lse.masked_fill(part_lse == float("inf"), NEG_INF)
    m = torch.maximum(al, pl)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wp = torch.exp(al - m), torch.exp(pl - m)
    tot = wa + wp
    a.mul_((wa / tot).t().unsqueeze(-1)).add_(part.float() * (wp / tot).t().unsqueeze(-1))
    new_lse = torch.log(tot) + m
    if rows is not None:
        acc.index_copy_(0, rows, a)
        acc_lse.index_copy_(1, rows, new_lse)
    else:
        acc_lse.copy_(new_lse)


# ----------------------------------------------------------------------------------------------
# The batch of one step and the streaming pipeline


class Batch:
    """The requests of one step: history page tables and lengths, new tokens' q/K/V per layer,
    the device-resident recent tokens, and the window plan of the streamed history (the same for
    every layer: all layers share the page tables)."""

    def __init__(self, geo, tier, device, pages: list[list[int]], ctx: list[int],
                 new: list[int], recent: int, window_tokens: int, seed: int,
                 q_override=None):
        self.geo, self.tier, self.device = geo, tier, device
        self.pages, self.ctx, self.new = pages, ctx, new
        self.recent = [min(recent, c) for c in ctx]
        self.streamed = [c - r for c, r in zip(ctx, self.recent)]
        self.cu_q = cumsum(new)
        self.cu_recent = cumsum(self.recent)
        T = self.cu_q[-1]
        gen = torch.Generator().manual_seed(seed)
        L, g = geo.layers, geo
        self.q = [q_override[i] if q_override is not None else
                  torch.randn((T, g.hq, g.d), generator=gen).to(g.dtype).to(device)
                  for i in range(L)]
        self.new_k = [torch.randn((T, g.hkv, g.d), generator=gen).to(g.dtype).to(device)
                      for _ in range(L)]
        self.new_v = [torch.randn((T, g.hkv, g.d), generator=gen).to(g.dtype).to(device)
                      for _ in range(L)]
        self.recent_kv = []
        for layer in range(L):
            ks, vs = [], []
            for r in range(len(ctx)):
                k, v = tier.gather(layer, pages[r], self.streamed[r], ctx[r], device)
                ks.append(k)
                vs.append(v)
            self.recent_kv.append((torch.cat(ks), torch.cat(vs)))
        self.windows = plan_windows([(p, 0, s) for p, s in zip(pages, self.streamed)],
                                    geo.page, window_tokens)
        self.t_cu_q = torch.tensor(self.cu_q, dtype=torch.int32, device=device)
        self.t_cu_recent = torch.tensor(self.cu_recent, dtype=torch.int32, device=device)
        for w in self.windows:  # device metadata once per step, reused by every layer
            cu_q = cumsum([new[r] for r in w.reqs])
            w.meta["cu_q"], w.meta["cu_k"] = cu_q, cumsum(w.k_lens)
            w.meta["cu_q_t"] = torch.tensor(cu_q, dtype=torch.int32, device=device)
            w.meta["cu_k_t"] = torch.tensor(w.meta["cu_k"], dtype=torch.int32, device=device)
            if len(w.reqs) == len(ctx):
                w.meta["rows"] = None
            else:
                rows = [i for r in w.reqs for i in range(self.cu_q[r], self.cu_q[r + 1])]
                w.meta["rows"] = torch.tensor(rows, dtype=torch.long, device=device)
            # the rows of its copies for one gather (gather.copy_rows_kv), where there are several
            w.meta["gather_index"] = (gather.run_rows(w.copies).to(device)
                                      if len(w.copies) > 1 else None)

    @property
    def streamed_bytes(self) -> int:
        return sum(self.streamed) * self.geo.token_bytes

    def copies_per_window(self) -> float:
        return sum(len(w.copies) for w in self.windows) / max(1, len(self.windows))

    def device_part(self, attn: Attention, layer: int):
        """The accumulator of a layer, started from what is on the device: the new tokens over
        themselves (causal) and, merged, over the recent tokens of their request."""
        q, nk, nv = self.q[layer], self.new_k[layer], self.new_v[layer]
        out, lse = attn(q, nk, nv, self.cu_q, self.cu_q, True, self.t_cu_q, self.t_cu_q)
        acc, acc_lse = out.float(), lse.contiguous()
        if self.cu_recent[-1]:
            rk, rv = self.recent_kv[layer]
            if all(self.recent):
                part, plse = attn(q, rk, rv, self.cu_q, self.cu_recent, False,
                                  self.t_cu_q, self.t_cu_recent)
                merge_into(acc, acc_lse, part, plse)
            else:  # some request has no recent tokens: attend per request that has some
                for r, n in enumerate(self.recent):
                    if n:
                        a, b = self.cu_recent[r], self.cu_recent[r + 1]
                        qa, qb = self.cu_q[r], self.cu_q[r + 1]
                        part, plse = attn(q[qa:qb], rk[a:b], rv[a:b], [0, qb - qa], [0, b - a],
                                          False)
                        rows = torch.arange(qa, qb, device=self.device)
                        merge_into(acc, acc_lse, part, plse, rows)
        return acc, acc_lse


class Streamer:
    """Two device staging buffers of ``window_tokens`` K and V, reused for every window of every
    layer. On CUDA: a copy stream and the compute stream, with explicit events: ``ready[b]``
    (recorded on the copy stream after the copies into buffer b) and ``free[b]`` (recorded on the
    compute stream after the attention that last read buffer b). The copies of item i+1 are issued
    before the attention of item i; the copy stream waits ``free`` of the buffer it overwrites, the
    compute stream waits ``ready`` of the buffer it reads. On CPU the same loop runs with
    synchronous copies and no events. ``gather``: a window of at least ``min_runs`` copies is
    loaded by one `gather.copy_rows_kv` with that kernel ("triton": ours, reading the registered
    tier through UVA; "torch": index_select) instead of one copy per run; None: run by run."""

    def __init__(self, geo: Geometry, device: torch.device, window_tokens: int,
                 gather_kernel: str | None = None, min_runs: int = gather.MIN_RUNS):
        self.geo, self.device, self.window_tokens = geo, device, window_tokens
        self.gather, self.min_runs = gather_kernel, min_runs
        self.gathers_issued = 0
        self.cuda = device.type == "cuda"
        shape = (window_tokens, geo.hkv, geo.d)
        self.sk = [torch.empty(shape, dtype=geo.dtype, device=device) for _ in range(2)]
        self.sv = [torch.empty(shape, dtype=geo.dtype, device=device) for _ in range(2)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.ready = [torch.cuda.Event() for _ in range(2)]
            self.free = [torch.cuda.Event() for _ in range(2)]
        self.free_used = [False, False]
        self.copies_issued = 0

    def issue(self, i: int, tier: HostTier, layer: int, w: Window, do_copy: bool = True) -> None:
        b = i % 2
        ctx = torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            if self.cuda and self.free_used[b]:
                self.copy_stream.wait_event(self.free[b])
            if do_copy:
                kf, vf = tier.flat(layer)
                sk, sv = self.sk[b], self.sv[b]
                index = w.meta.get("gather_index")
                if self.gather is not None and index is not None and len(w.copies) >= self.min_runs:
                    gather.copy_rows_kv(sk, sv, kf, vf, index, self.gather)
                    self.gathers_issued += 1
                else:
                    for src, dst, n in w.copies:
                        sk[dst:dst + n].copy_(kf[src:src + n], non_blocking=True)
                        sv[dst:dst + n].copy_(vf[src:src + n], non_blocking=True)
                    self.copies_issued += 2 * len(w.copies)
            if self.cuda:
                self.ready[b].record(self.copy_stream)

    def run(self, tier: HostTier, items: list[tuple[int, Window]], prologue, consume,
            do_copy: bool = True) -> None:
        """items: (layer, window) in execution order. ``prologue()`` runs after the first copy is
        issued (the device part of every layer overlaps it); ``consume(layer, window, k, v)``
        attends and merges one window."""
        if items:
            self.issue(0, tier, *items[0], do_copy)
        prologue()
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for i, (layer, w) in enumerate(items):
            if i + 1 < len(items):
                self.issue(i + 1, tier, *items[i + 1], do_copy)  # overlaps the attention below
            b = i % 2
            if self.cuda:
                compute.wait_event(self.ready[b])
            consume(layer, w, self.sk[b][:w.total], self.sv[b][:w.total])
            if self.cuda:
                self.free[b].record(compute)
            self.free_used[b] = True


def step_stream(batch: Batch, streamer: Streamer, attn: Attention, out: torch.Tensor,
                do_copy: bool = True, do_attn: bool = True) -> None:
    """One step of every layer: device part, then the streamed history window by window; the
    result of layer l is written to out[l] ([T, Hq, D], the model's dtype)."""
    L = batch.geo.layers
    accs: list = [None] * L

    def prologue():
        for layer in range(L):
            accs[layer] = batch.device_part(attn, layer)

    def consume(layer, w, k, v):
        if not do_attn:
            return
        m = w.meta
        q = batch.q[layer] if m["rows"] is None else batch.q[layer].index_select(0, m["rows"])
        part, plse = attn(q, k, v, m["cu_q"], m["cu_k"], False, m["cu_q_t"], m["cu_k_t"])
        merge_into(accs[layer][0], accs[layer][1], part, plse, m["rows"])

    items = [(layer, w) for layer in range(L) for w in batch.windows]
    streamer.run(batch.tier, items, prologue, consume, do_copy)
    for layer in range(L):
        out[layer].copy_(accs[layer][0])


# ----------------------------------------------------------------------------------------------
# Host-side decode attention


def host_history_batches(tier: HostTier, layer: int, pages: list[int], n_tokens: int,
                         chunk_tokens: int, gather_buf):
    """A request's history [0, n_tokens) on the host as batches [n, L, Hkv, D] of K and V for one
    split-K kernel call each: strided views of the pool where pages are consecutive (no copy),
    else pages gathered (index_select) into a reusable buffer of a few MiB."""
    g = tier.geo
    kp, vp = tier.k[layer], tier.v[layer]
    ppc = max(1, chunk_tokens // g.page)  # pages per chunk
    full = n_tokens // g.page
    rem = n_tokens - full * g.page
    runs = token_runs(pages, g.page, 0, full * g.page)
    if len(runs) * ppc <= max(1, full):  # long runs: views
        for src, n in runs:
            p0, np_ = src // g.page, n // g.page
            nb = np_ // ppc
            if nb:
                yield (kp[p0:p0 + nb * ppc].view(nb, ppc * g.page, g.hkv, g.d),
                       vp[p0:p0 + nb * ppc].view(nb, ppc * g.page, g.hkv, g.d))
            if np_ - nb * ppc:
                a, b = p0 + nb * ppc, p0 + np_
                yield (kp[a:b].view(1, (b - a) * g.page, g.hkv, g.d),
                       vp[a:b].view(1, (b - a) * g.page, g.hkv, g.d))
    else:  # scattered pages: gather groups of pages
        bk, bv = gather_buf
        gp = bk.shape[0]
        idx_all = torch.tensor(pages[:full], dtype=torch.long)
        for a in range(0, full, gp):
            idx = idx_all[a:a + gp]
            n = idx.numel()
            torch.index_select(kp, 0, idx, out=bk[:n])
            torch.index_select(vp, 0, idx, out=bv[:n])
            nb = n // ppc
            if nb:
                yield (bk[:nb * ppc].view(nb, ppc * g.page, g.hkv, g.d),
                       bv[:nb * ppc].view(nb, ppc * g.page, g.hkv, g.d))
            if n - nb * ppc:
                yield (bk[nb * ppc:n].view(1, (n - nb * ppc) * g.page, g.hkv, g.d),
                       bv[nb * ppc:n].view(1, (n - nb * ppc) * g.page, g.hkv, g.d))
    if rem:
        yield kp[pages[full], :rem].unsqueeze(0), vp[pages[full], :rem].unsqueeze(0)


def host_attend(tier: HostTier, layer: int, q_host: torch.Tensor, pages: list[int],
                n_tokens: int, chunk_tokens: int, gather_buf):
    """One decode token's attention over a history in the host tier, on the host's cores:
    q_host [Hq, D] -> (out [Hq, D] fp32, lse [Hq] fp32). Split-K: each batch is one call of the
    CPU flash kernel (bf16 in, LSE out) over n chunks in parallel; the partials are LSE-merged."""
    g = tier.geo
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qg = q_host.reshape(g.hkv, g.rep, g.d)
    outs, lses = [], []
    for kb, vb in host_history_batches(tier, layer, pages, n_tokens, chunk_tokens, gather_buf):
        n = kb.shape[0]
        qb = qg.unsqueeze(0).expand(n, g.hkv, g.rep, g.d).contiguous()
        o, lse = op(qb, kb.permute(0, 2, 1, 3), vb.permute(0, 2, 1, 3), 0.0, False,
                    scale=g.scale)
        outs.append(o)
        lses.append(lse)
    if not outs:
        return (torch.zeros((g.hq, g.d)), torch.full((g.hq,), NEG_INF))
    o = torch.cat(outs).float()  # [N, Hkv, rep, D]
    lse = torch.cat(lses).float()  # [N, Hkv, rep]
    m = lse.amax(0)
    w = torch.exp(lse - m)
    s = w.sum(0)
    out = (o * w.unsqueeze(-1)).sum(0) / s.unsqueeze(-1)
    return out.reshape(g.hq, g.d), (m + torch.log(s)).reshape(g.hq)


def step_connector(batch: Batch, transfer: Transfer, window: int, out: torch.Tensor) -> None:
    """One step of every layer through the StreamingConnector's own windowed path, as its worker
    runs a streaming layer on a GPU: a lone request by `windowed.windowed_attention` over a
    `PagedHistory`, several by `packed.packed_attention` (packed windows, one varlen call per
    window where it checks out) with one `StepPlan` for all layers, the copies by `Transfer` (page
    runs, or one gather for scattered pages, into two staging buffers on a copy stream), the new
    tokens' K/V written back to the tier. The connector keeps no recent tokens on the device: the
    whole history streams (`batch` built with recent 0, its page tables covering the new tokens).
    Layer after layer, each layer's windows pipelined on their own (the first window of a layer
    overlaps nothing), as in the engine."""
    g = batch.geo
    assert not any(batch.recent), "the connector streams the whole history"
    segments = [(batch.cu_q[r], batch.cu_q[r + 1], SimpleNamespace(start=c, pages=batch.pages[r]))
                for r, c in enumerate(batch.ctx)]
    plan = StepPlan(segments, window, g.page) if len(segments) > 1 else None
    for layer in range(g.layers):
        kp, vp = batch.tier.k[layer], batch.tier.v[layer]
        q, k, v = batch.q[layer], batch.new_k[layer], batch.new_v[layer]
        if len(segments) > 1:
            packed_attention(q, k, v, segments, kp, vp, transfer, window, g.scale, out[layer],
                             step=plan)
        else:
            windowed_attention(q, k, v, PagedHistory(transfer, kp, vp, batch.pages[0]),
                               batch.ctx[0], window, g.scale, out=out[layer])


def step_host_decode(batch: Batch, attn: Attention, out: torch.Tensor, chunk_tokens: int,
                     gather_buf) -> None:
    """Decode step with host-side attention of the history: per layer, the device part is
    enqueued (async on CUDA), q goes D2H, the host attends its pinned pool, out + lse go H2D and
    are merged. Only q and the output cross PCIe."""
    g = batch.geo
    B = len(batch.ctx)
    assert batch.cu_q[-1] == B, "host decode: one new token per request"
    for layer in range(g.layers):
        acc, acc_lse = batch.device_part(attn, layer)
        q_host = batch.q[layer].to("cpu")
        ho = torch.empty((B, g.hq, g.d))
        hl = torch.empty((g.hq, B))
        for r in range(B):
            o, lse = host_attend(batch.tier, layer, q_host[r], batch.pages[r],
                                 batch.streamed[r], chunk_tokens, gather_buf)
            ho[r], hl[:, r] = o, lse
        if batch.device.type == "cuda":
            ho = ho.pin_memory().to(batch.device, non_blocking=True)
            hl = hl.pin_memory().to(batch.device, non_blocking=True)
        merge_into(acc, acc_lse, ho, hl)
        out[layer].copy_(acc)


# ----------------------------------------------------------------------------------------------
# Reference and exactness check


def reference(batch: Batch) -> torch.Tensor:
    """Direct fp32 attention over the gathered history + new tokens (causal for the new tokens):
    [L, T, Hq, D] fp32."""
    g = batch.geo
    T = batch.cu_q[-1]
    res = torch.empty((g.layers, T, g.hq, g.d))
    for layer in range(g.layers):
        q = batch.q[layer].float().cpu()
        nk, nv = batch.new_k[layer].float().cpu(), batch.new_v[layer].float().cpu()
        for r, c in enumerate(batch.ctx):
            a, b = batch.cu_q[r], batch.cu_q[r + 1]
            hk, hv = batch.tier.gather(layer, batch.pages[r], 0, c, "cpu")
            k = torch.cat([hk.float(), nk[a:b]])
            v = torch.cat([hv.float(), nv[a:b]])
            qr = q[a:b].view(b - a, g.hkv, g.rep, g.d)
            s = torch.einsum("tgrd,sgd->grts", qr, k) * g.scale
            t = torch.arange(b - a).unsqueeze(1)
            sidx = torch.arange(c + b - a).unsqueeze(0)
            s = s.masked_fill(sidx > c + t, NEG_INF)
            p = torch.softmax(s, dim=-1)
            res[layer, a:b] = torch.einsum("grts,sgd->tgrd", p, v).reshape(b - a, g.hq, g.d)
    return res


def exactness(geo: Geometry, device, attn: Attention, tol: float, seed: int,
              gather_kernel: str | None = None) -> dict:
    """2 requests x a few thousand tokens (not page multiples), 2 layers, shuffled pages, windows
    of 5 pages (windows straddle requests): prefill (stream), decode (stream, recent tokens on the
    device) and decode (host) against the direct reference; then the negative control: request
    0's query made to attend one history key sharply (layer 0), that key flipped: the windowed
    output must follow (and still match the reference). With ``gather_kernel``, every window of
    more than one copy is loaded by one gather of that kernel (the shuffled pages make them so)."""
    g = Geometry(2, geo.hq, geo.hkv, geo.d, geo.page, geo.dtype)
    ctx = [2500, 3100]
    n_pages = [math.ceil(c / g.page) for c in ctx]
    pool_pages = sum(n_pages) + 7
    tier = HostTier(g, pool_pages, pin=device.type == "cuda", fill_seed=seed, label="check")
    perm = page_table(pool_pages, pool_pages, "shuffled", seed)
    pages = [perm[:n_pages[0]], perm[n_pages[0]:n_pages[0] + n_pages[1]]]
    window = 5 * g.page
    streamer = Streamer(g, device, window, gather_kernel, min_runs=2)
    j = 1000  # the sharp key: request 0, streamed (not recent), in a middle window
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(g.d, generator=gen)
    alpha = 30.0 / (g.scale * float(u @ u))  # score of the sharp key: 30 (others ~ N(0, 1))
    p, off = divmod(j, g.page)
    tier.k[0][pages[0][p], off] = (alpha * u).to(g.dtype)  # every KV head

    results = {"max_diff": 0.0, "control_diff": float("inf")}
    cases = [("prefill stream", [7, 4], 0, "stream"),
             ("decode stream", [1, 1], 256, "stream"),
             ("decode host", [1, 1], 256, "host"),
             ("prefill connector", [7, 4], 0, "connector"),
             ("decode connector", [1, 1], 0, "connector")]
    # the connector's path writes the new tokens' K/V after each history: its page tables cover
    # them (request 0 keeps its pages, so the sharp key stays where it is)
    need = [math.ceil((c + 7) / g.page) for c in ctx]
    conn_pages = [perm[:need[0]], perm[need[0]:need[0] + need[1]]]
    transfer = Transfer(Medium.for_device(device))  # gathers as the connector does (gather.py)
    for name, new, recent, mode in cases:
        diffs = []
        outs = []
        loaded = transfer.windows_loaded
        for flip in (False, True):
            if flip:
                tier.k[0][pages[0][p], off] = (-alpha * u).to(g.dtype)
            else:
                tier.k[0][pages[0][p], off] = (alpha * u).to(g.dtype)
            qs = []
            for layer in range(g.layers):
                q = torch.randn((sum(new), g.hq, g.d), generator=gen)
                if layer == 0:
                    q[:new[0]] = u  # every head of request 0 looks for the sharp key
                qs.append(q.to(g.dtype).to(device))
            batch = Batch(g, tier, device, conn_pages if mode == "connector" else pages, ctx, new,
                          recent, window, seed + 2, q_override=qs)
            out = torch.empty((g.layers, sum(new), g.hq, g.d), dtype=g.dtype, device=device)
            if mode == "stream":
                step_stream(batch, streamer, attn, out)
            elif mode == "connector":
                step_connector(batch, transfer, window, out)
            else:
                step_host_decode(batch, attn, out, chunk_tokens=4 * g.page,
                                 gather_buf=_gather_buf(g, 64))
            got = out.float().cpu()
            diffs.append(float((got - reference(batch)).abs().max()))
            outs.append(got[0, :new[0]])
        ctrl = float((outs[0] - outs[1]).abs().max())
        per_layer = ((transfer.windows_loaded - loaded) // (2 * g.layers) if mode == "connector"
                     else len(batch.windows))
        log(f"exactness {name}: {per_layer} windows/layer, max |windowed - reference| = "
            f"{max(diffs):.2e} (tolerance {tol:g}); control (sharp key flipped): output changed "
            f"by {ctrl:.3f}")
        results["max_diff"] = max(results["max_diff"], *diffs)
        results["control_diff"] = min(results["control_diff"], ctrl)
    results["ok"] = results["max_diff"] <= tol
    results["control_changed"] = results["control_diff"] > 10 * tol
    return results


def _gather_buf(g: Geometry, pages: int):
    shape = (pages, g.page, g.hkv, g.d)
    return torch.empty(shape, dtype=g.dtype), torch.empty(shape, dtype=g.dtype)


# ----------------------------------------------------------------------------------------------
# Bandwidths, sizes, timing


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def h2d_bandwidth(device, nbytes: int, reps: int) -> float:
    """Pinned host -> device (CPU: host memcpy), one large copy, median of reps, bytes/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t = timed(lambda: dst.copy_(src, non_blocking=True), device, reps, 1)
    return nbytes / t


def host_read_bandwidth(nbytes: int, reps: int) -> tuple[float, float]:
    """Host memory: read bandwidth (a float32 sum over the buffer, all threads) and copy
    bandwidth (bytes copied / s), both in bytes/s, medians of reps."""
    x = torch.empty(nbytes, dtype=torch.uint8)
    x.fill_(1)
    y = torch.empty_like(x)
    cpu = torch.device("cpu")
    read = nbytes / timed(lambda: x.view(torch.float32).sum(), cpu, reps, 1)
    copy = nbytes / timed(lambda: y.copy_(x), cpu, reps, 1)
    return read, copy


MODEL_CONTEXTS = (("128K", 128 * 1024), ("1M", 1 << 20), ("4M", 4 << 20))


def attention_rates(device, geo: Geometry, attn: "Attention", window_tokens: int,
                    prefill_tokens: int, reps: int = 3) -> tuple[float, float]:
    """(FLOP/s of one prefill-shaped window call, seconds of one decode-shaped window call): the
    attention kernel on `prefill_tokens` (resp. 1) query tokens against one window of KV."""
    g = geo
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((window_tokens, g.hkv, g.d), generator=gen).to(device, g.dtype)
    v = torch.randn((window_tokens, g.hkv, g.d), generator=gen).to(device, g.dtype)
    times = []
    for n in (prefill_tokens, 1):
        q = torch.randn((n, g.hq, g.d), generator=gen).to(device, g.dtype)
        times.append(timed(lambda: attn(q, k, v, [0, n], [0, window_tokens], False), device,
                           reps, 1))
    flops = 4 * prefill_tokens * g.hq * g.d * window_tokens  # QK^T and PV
    return flops / times[0], times[1]


def cost_model(geo: Geometry, h2d: float, prefill_flops: float, decode_window_s: float,
               window_tokens: int, prefill_tokens: int, recent_tokens: int,
               contexts=MODEL_CONTEXTS) -> dict[str, dict[str, float]]:
    """Predicted seconds per context (docs/streaming.md, "Cost model"), copies and attention
    overlapped (two staging buffers): a prefill of `prefill_tokens` over a cached context of C
    tokens takes max(copy, attention) with copy = L x C x b / W and attention = L x 4 x N x Hq x D
    x C / F (F measured on one window); a decode step (batch 1) takes max(copy of the C - R older
    tokens, L x windows x one decode-shaped window call). `floor` is the copy alone (the bench's
    ratios are against it)."""
    out = {}
    for lab, c in contexts:
        copy = geo.layers * c * geo.layer_token_bytes / h2d
        att = geo.layers * 4 * prefill_tokens * geo.hq * geo.d * c / prefill_flops
        older = max(0, c - recent_tokens)
        dcopy = geo.layers * older * geo.layer_token_bytes / h2d
        datt = geo.layers * math.ceil(older / window_tokens) * decode_window_s
        out[lab] = {"tokens": c, "prefill_copy_s": copy, "prefill_attn_s": att,
                    "prefill_s": max(copy, att), "prefill_ratio": max(copy, att) / copy,
                    "decode_copy_s": dcopy, "decode_attn_s": datt, "decode_s": max(dcopy, datt),
                    "decode_ratio": max(dcopy, datt) / dcopy if dcopy else 1.0}
    return out


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def parse_tokens(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def gbps(x: float) -> str:
    return f"{x / 1e9:.2f}"


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Windowed streaming attention + LSE merge over a paged pinned host tier "
                    "(Llama-4-Scout NoPE stack), torch only. Design: docs/streaming.md, 'The GPU path'.")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes for CI: 2 layers, 2 KV heads x 64, 6 q heads, contexts 2K,8K, "
                         "64 KiB windows, 256 recent tokens, 64 prefill tokens")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--contexts", default="128K,1M,max",
                    help="tokens per request, comma-separated (K = 1024, M = 1024^2; max = what "
                         "fits in --host-mem-fraction of MemAvailable)")
    ap.add_argument("--host-mem-fraction", type=float, default=0.55,
                    help="share of MemAvailable the host tier may take for 'max' (default 0.55)")
    ap.add_argument("--page-order", default="contiguous,shuffled",
                    help="page allocation of the host tier: contiguous, shuffled, or both")
    ap.add_argument("--window-mib", type=float, default=DEFAULT_WINDOW_MIB,
                    help="K+V bytes of one window of one layer, MiB (default %(default)g: the "
                         "connector's window_mib default)")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--decode-batch", default="1,8",
                    help="decode batch sizes (each request has the full context; when the pool "
                         "holds less than batch x context the requests' page tables alias the "
                         "same pool pages, at different rotations)")
    ap.add_argument("--batch-max-tokens", default="2M",
                    help="skip decode batches whose batch x context exceeds this (default 2M)")
    ap.add_argument("--recent-tokens", type=int, default=4096,
                    help="last tokens of each request kept on the device (decode streams the rest)")
    ap.add_argument("--decode", default="stream,host",
                    help="decode variants: stream (history over PCIe), host (attention on the "
                         "host), connector (the StreamingConnector's own windowed path, for the "
                         "prefill too: its Transfer, windowed/packed attention and write-back)")
    ap.add_argument("--host-chunk-tokens", type=int, default=2048,
                    help="host decode: split-K chunk (tokens per partial)")
    ap.add_argument("--host-gather-mib", type=float, default=64.0,
                    help="host decode, scattered pages: gather buffer size (K and V each)")
    ap.add_argument("--gather", choices=["auto", "off"], default="auto",
                    help="a window of many page runs (scattered pages) loaded by one gather: "
                         "auto = our Triton kernel on a GPU where it checks out (index_select on "
                         "the CPU); off = one copy per run")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions (median)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time copy-only and attention-only passes at the first context")
    ap.add_argument("--bw-mib", type=float, default=1024.0,
                    help="buffer size of the bandwidth measurements, MiB")
    ap.add_argument("--threads", type=int, default=0,
                    help="host threads for torch (default: torch's choice; --tiny: 1, stable on a "
                         "small shared machine where a busy core stalls every OpenMP barrier)")
    ap.add_argument("--tolerance", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.kv_heads, args.q_heads, args.head_dim = 2, 2, 6, 64
        args.contexts = "2K,8K" if args.contexts == ap.get_default("contexts") else args.contexts
        args.window_mib = 1 / 16
        args.prefill_tokens, args.recent_tokens = 64, 256
        args.decode_batch = "1,4"
        args.bw_mib = 64.0
        args.host_chunk_tokens = 256
        args.host_gather_mib = 1.0
        args.breakdown = True
        args.threads = args.threads or 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("error: --device cuda but CUDA is not available (use --device cpu)")
        return 2
    geo = Geometry(args.layers, args.q_heads, args.kv_heads, args.head_dim, args.page_tokens,
                   torch.bfloat16)
    assert geo.hq % geo.hkv == 0
    orders = [o.strip() for o in args.page_order.split(",") if o.strip()]
    variants = [v.strip() for v in args.decode.split(",") if v.strip()]
    batches = [int(b) for b in args.decode_batch.split(",") if b.strip()]
    batch_cap = parse_tokens(args.batch_max_tokens)
    window_tokens = max(geo.page, int(args.window_mib * MIB) // geo.layer_token_bytes
                        // geo.page * geo.page)
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"cpu ({os.cpu_count()} cores)")
    log(f"device: {dev_name}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
        f"date {time.strftime('%Y-%m-%d')}")
    log(f"stack: {geo.layers} layers, Hq {geo.hq}, Hkv {geo.hkv} x {geo.d}, bf16, page "
        f"{geo.page}: {geo.token_bytes / 1024:g} KiB of KV per token; window {window_tokens} "
        f"tokens ({window_tokens * geo.layer_token_bytes / MIB:g} MiB K+V per layer-window)")

    # attention kernel
    if device.type == "cpu":
        attn = Attention(device, geo, "cpu_flash")
        kernel_note = "aten._scaled_dot_product_flash_attention_for_cpu, one call per request"
    else:
        attn, kernel_note = pick_cuda_attention(device, geo, args.tolerance)
    log(f"attention kernel: {kernel_note}")
    if device.type == "cpu":
        log("cpu mode: the 'device' is the host (staging buffers, copies and attention on the CPU); "
            "the figures exercise the code paths, they say nothing about PCIe or a GPU")

    # bandwidths
    bw_bytes = int(args.bw_mib * MIB)
    h2d = h2d_bandwidth(device, bw_bytes, 5)
    host_read, host_copy = host_read_bandwidth(bw_bytes, 5)
    h2d_label = "H2D (pinned -> device)" if device.type == "cuda" else "cpu (host memcpy)"
    log(f"bandwidth: {h2d_label} {gbps(h2d)} GB/s; host memory read {gbps(host_read)} GB/s, "
        f"copy {gbps(host_copy)} GB/s ({args.bw_mib:g} MiB, median of 5)")

    # exactness + negative control
    # scattered pages (a window of many runs): one gather per window where a kernel applies
    if args.gather == "off":
        gather_kernel, gather_note = None, "off (one copy per run)"
    elif device.type == "cpu":
        gather_kernel, gather_note = "torch", "index_select (cpu)"
    elif gather.triton_usable(device, geo.dtype, (geo.hkv, geo.d)):
        gather_kernel, gather_note = "triton", "ours (Triton), from the registered tier by UVA"
    else:
        gather_kernel, gather_note = None, "Triton kernel unusable here: one copy per run"
    log(f"gather: windows of >= {gather.MIN_RUNS} runs: {gather_note}")
    if args.gather == "off":  # the connector's Transfer (--decode connector) copies run by run too
        gather.MIN_RUNS = sys.maxsize
    ex = exactness(geo, device, attn, args.tolerance, args.seed, gather_kernel)
    verdict = "identical within tolerance" if ex["ok"] else "MISMATCH"
    log(f"exactness: {verdict} (max diff {ex['max_diff']:.2e} <= {args.tolerance:g}); "
        f"negative control: {'changed' if ex['control_changed'] else 'NOT changed'} "
        f"(min change {ex['control_diff']:.3f})")

    # the cost model: predicted prefill and decode step at 128K / 1M / 4M tokens from the measured
    # H2D bandwidth and attention throughput (measured figures below are compared with it)
    flops, dec_win = attention_rates(device, geo, attn, window_tokens, args.prefill_tokens)
    model = cost_model(geo, h2d, flops, dec_win, window_tokens, args.prefill_tokens,
                       args.recent_tokens)
    log(f"cost model: W = {gbps(h2d)} GB/s, attention {flops / 1e12:.3g} TFLOP/s (prefill-shaped, "
        f"one window), a decode-shaped window call {dec_win * 1e3:.3g} ms; copies and attention "
        f"overlapped (docs/streaming.md, 'Cost model')")
    for lab, m in model.items():
        log(f"  predicted at {lab}: prefill {args.prefill_tokens} tokens {m['prefill_s']:.4f} s "
            f"(copy {m['prefill_copy_s']:.4f}, attention {m['prefill_attn_s']:.4f}; "
            f"{m['prefill_ratio']:.2f}x the copy floor, goal <= 1.5), decode step b1 "
            f"{m['decode_s']:.4f} s ({m['decode_ratio']:.2f}x its floor)")

    result: dict[str, str] = {
        "device": device.type, "h2d_gbps": gbps(h2d), "host_read_gbps": gbps(host_read),
        "host_copy_gbps": gbps(host_copy), "kernel": attn.impl,
        "exact_maxdiff": f"{ex['max_diff']:.2e}", "exact_tol": f"{args.tolerance:g}",
        "exact_ok": str(int(ex["ok"])), "control_changed": str(int(ex["control_changed"])),
        "window_tokens": str(window_tokens), "date": time.strftime("%Y-%m-%d"),
        "attn_tflops": f"{flops / 1e12:.3g}", "decode_window_ms": f"{dec_win * 1e3:.3g}",
        "gather": gather_kernel or ("off" if args.gather == "off" else "unusable"),
    }
    for lab, m in model.items():
        result[f"model_prefill_s_{lab}"] = f"{m['prefill_s']:.4f}"
        result[f"model_prefill_ratio_{lab}"] = f"{m['prefill_ratio']:.2f}"
        result[f"model_decode_s_{lab}"] = f"{m['decode_s']:.4f}"

    # context sizes
    labels = [c.strip() for c in args.contexts.split(",") if c.strip()]
    avail = mem_available()
    max_tokens = int(avail * args.host_mem_fraction) // geo.token_bytes // geo.page * geo.page
    sizes = []
    for lab in labels:
        n = max_tokens if lab.lower() == "max" else parse_tokens(lab)
        if n > max_tokens:
            log(f"context {lab}: {n} tokens need {n * geo.token_bytes / GIB:.1f} GiB of host tier, "
                f"more than {args.host_mem_fraction:g} x MemAvailable ({avail / GIB:.1f} GiB): skipped")
            result[f"skipped_{lab}"] = "1"
            continue
        sizes.append((lab, n))
    if any(lab.lower() == "max" for lab, _ in sizes):
        result["max_tokens"] = str(max_tokens)
        log(f"max: {max_tokens} tokens ({max_tokens * geo.token_bytes / GIB:.1f} GiB, "
            f"{args.host_mem_fraction:g} x MemAvailable {avail / GIB:.1f} GiB)")
    if not sizes:
        log("no context size fits")
    streamer = Streamer(geo, device, window_tokens, gather_kernel)
    gather_pages = max(1, int(args.host_gather_mib * MIB) // (geo.page * geo.layer_token_bytes // 2))
    gather_buf = _gather_buf(geo, gather_pages)
    pool_tokens = max((n for _, n in sizes), default=0)
    pool_pages = math.ceil(pool_tokens / geo.page)
    # the connector's path writes the new tokens after each history: room for them
    conn_extra = math.ceil(args.prefill_tokens / geo.page) + 1 if "connector" in variants else 0
    pool_pages += conn_extra
    transfer = Transfer(Medium.for_device(device))
    tier = None
    if sizes:
        log(f"host tier: {pool_pages} pages x {geo.layers} layers = "
            f"{pool_pages * geo.page * geo.token_bytes / GIB:.2f} GiB")
        tier = HostTier(geo, pool_pages, pin=device.type == "cuda", fill_seed=None)
        log(f"host tier ready (pinned: {tier.pin_method}"
            f"{'; ' + tier.pin_error if tier.pin_error else ''})")
        result["pin"] = tier.pin_method
    first = True
    for lab, n in sizes:
        for order in orders:
            key = f"{lab}_{order}"
            n_pages = math.ceil(n / geo.page)
            # prefill over a cached context
            pt = page_table(n_pages, pool_pages, order, args.seed)
            batch = Batch(geo, tier, device, [pt], [n], [args.prefill_tokens], 0, window_tokens,
                          args.seed)
            out = torch.empty((geo.layers, args.prefill_tokens, geo.hq, geo.d), dtype=geo.dtype,
                              device=device)
            floor = batch.streamed_bytes / h2d
            log(f"[{lab} {order}] prefill {args.prefill_tokens} tokens over {n} cached tokens: "
                f"{len(batch.windows)} windows/layer, {batch.copies_per_window():.1f} copies per "
                f"window (x2: K and V) ...")
            t = timed(lambda: step_stream(batch, streamer, attn, out), device, args.reps,
                      1 if first else 0)
            log(f"[{lab} {order}] prefill: {t:.4f} s; floor {floor:.4f} s "
                f"({batch.streamed_bytes / GIB:.2f} GiB / {gbps(h2d)} GB/s); ratio {t / floor:.2f} "
                f"(goal <= 1.5)")
            result[f"prefill_s_{key}"] = f"{t:.4f}"
            result[f"prefill_floor_s_{key}"] = f"{floor:.4f}"
            result[f"prefill_ratio_{key}"] = f"{t / floor:.2f}"
            m = cost_model(geo, h2d, flops, dec_win, window_tokens, args.prefill_tokens,
                           args.recent_tokens, ((lab, n),))[lab]
            pred = m["prefill_s"]
            log(f"[{lab} {order}] prefill: measured / predicted {t / pred:.2f} (predicted "
                f"{pred:.4f} s)")
            result[f"prefill_vs_model_{key}"] = f"{t / pred:.2f}"
            result[f"copies_per_window_{key}"] = f"{batch.copies_per_window():.1f}"
            if "connector" in variants:
                cb = Batch(geo, tier, device, [page_table(n_pages + conn_extra, pool_pages, order,
                                                          args.seed)],
                           [n], [args.prefill_tokens], 0, window_tokens, args.seed)
                tc = timed(lambda: step_connector(cb, transfer, window_tokens, out), device,
                           args.reps, 1)
                log(f"[{lab} {order}] prefill connector: {tc:.4f} s; ratio {tc / floor:.2f} "
                    f"(the StreamingConnector's own path: windowed_attention over Transfer; "
                    f"stream above {t / floor:.2f})")
                result[f"prefill_connector_s_{key}"] = f"{tc:.4f}"
                result[f"prefill_connector_ratio_{key}"] = f"{tc / floor:.2f}"
                del cb
            if first and args.breakdown:
                tc = timed(lambda: step_stream(batch, streamer, attn, out, do_attn=False), device,
                           args.reps, 1)
                ta = timed(lambda: step_stream(batch, streamer, attn, out, do_copy=False), device,
                           args.reps, 1)
                log(f"[{lab} {order}] prefill breakdown: copies only {tc:.4f} s, attention + "
                    f"merge only {ta:.4f} s, both overlapped {t:.4f} s")
                result[f"prefill_copy_only_s_{key}"] = f"{tc:.4f}"
                result[f"prefill_attn_only_s_{key}"] = f"{ta:.4f}"
            del batch, out
            # decode steps
            for B in batches:
                if B * n > batch_cap:
                    log(f"[{lab} {order}] decode batch {B}: {B} x {n} tokens > "
                        f"--batch-max-tokens: skipped")
                    continue
                pts = [page_table(n_pages, pool_pages, order, args.seed, rotate=r * pool_pages // B)
                       for r in range(B)]
                batch = Batch(geo, tier, device, pts, [n] * B, [1] * B, args.recent_tokens,
                              window_tokens, args.seed)
                out = torch.empty((geo.layers, B, geo.hq, geo.d), dtype=geo.dtype, device=device)
                kb = f"{key}_b{B}"
                sb = batch.streamed_bytes
                times = {}
                if "stream" in variants:
                    t = timed(lambda: step_stream(batch, streamer, attn, out), device, args.reps,
                              1 if first else 0)
                    fl = sb / h2d
                    times["stream"] = t
                    log(f"[{lab} {order}] decode b{B} stream: {t:.4f} s; floor {fl:.4f} s "
                        f"({sb / GIB:.2f} GiB streamed, {args.recent_tokens} recent tokens/request "
                        f"on device); ratio {t / fl:.2f} (goal <= 1.5)")
                    result[f"decode_stream_s_{kb}"] = f"{t:.4f}"
                    result[f"decode_stream_ratio_{kb}"] = f"{t / fl:.2f}"
                    if B == 1:
                        pred = m["decode_s"]
                        log(f"[{lab} {order}] decode b1 stream: measured / predicted "
                            f"{t / pred:.2f} (predicted {pred:.4f} s)")
                        result[f"decode_vs_model_{kb}"] = f"{t / pred:.2f}"
                if "host" in variants:
                    t = timed(lambda: step_host_decode(batch, attn, out, args.host_chunk_tokens,
                                                       gather_buf),
                              device, args.reps, 1 if first else 0)
                    fl = sb / host_read
                    times["host"] = t
                    log(f"[{lab} {order}] decode b{B} host: {t:.4f} s; floor {fl:.4f} s "
                        f"({sb / GIB:.2f} GiB / host read {gbps(host_read)} GB/s); ratio "
                        f"{t / fl:.2f}")
                    result[f"decode_host_s_{kb}"] = f"{t:.4f}"
                    result[f"decode_host_ratio_{kb}"] = f"{t / fl:.2f}"
                if "connector" in variants:
                    cpts = [page_table(n_pages + 1, pool_pages, order, args.seed,
                                       rotate=r * pool_pages // B) for r in range(B)]
                    cb = Batch(geo, tier, device, cpts, [n] * B, [1] * B, 0, window_tokens,
                               args.seed)
                    # the step's plan made in the step, as the connector's worker does
                    t = timed(lambda: step_connector(cb, transfer, window_tokens, out), device,
                              args.reps, 1)
                    fl = cb.streamed_bytes / h2d
                    log(f"[{lab} {order}] decode b{B} connector: {t:.4f} s; floor {fl:.4f} s "
                        f"({cb.streamed_bytes / GIB:.2f} GiB streamed, no recent tokens on the "
                        f"device); ratio {t / fl:.2f} (the StreamingConnector's own path)")
                    result[f"decode_connector_s_{kb}"] = f"{t:.4f}"
                    result[f"decode_connector_ratio_{kb}"] = f"{t / fl:.2f}"
                    del cb
                if "stream" in times and "host" in times:
                    win = min(("stream", "host"), key=times.get)
                    log(f"[{lab} {order}] decode b{B}: {win} wins "
                        f"({max(times.values()) / min(times.values()):.2f}x)")
                    result[f"decode_winner_{kb}"] = win
                del batch, out
            first = False
    log("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if ex["ok"] and ex["control_changed"] else 1


def pick_cuda_attention(device, geo: Geometry, tol: float):
    """FlashAttention varlen (one call for the batch) where the connector would use it
    (packed.varlen_usable: it runs and matches the per-piece kernel on a small GQA varlen problem),
    else per-request SDPA flash if that matches the CPU kernel within `tol`."""
    if varlen_usable(device, geo.dtype, geo.hq, geo.hkv, geo.d):
        return Attention(device, geo, "flash_varlen"), (
            "aten._flash_attention_forward varlen (cum_seq_q/k, packed.varlen), one call per "
            "window for the whole batch, GQA native")
    log("attention kernel flash_varlen: unavailable or differs from the per-piece kernel "
        "(packed.varlen_usable), not used")
    gen = torch.Generator().manual_seed(123)
    cu_q, cu_k = [0, 3, 4], [0, 70, 100]
    q = torch.randn((4, geo.hq, geo.d), generator=gen).to(geo.dtype)
    k = torch.randn((100, geo.hkv, geo.d), generator=gen).to(geo.dtype)
    v = torch.randn((100, geo.hkv, geo.d), generator=gen).to(geo.dtype)
    ref = Attention(torch.device("cpu"), geo, "cpu_flash")(q, k, v, cu_q, cu_k, False)
    a = Attention(device, geo, "sdpa_flash")
    try:
        o, lse = a(q.to(device), k.to(device), v.to(device), cu_q, cu_k, False)
        if (float((o.float().cpu() - ref[0].float()).abs().max()) <= tol
                and float((lse.cpu() - ref[1]).abs().max()) <= 1e-2):
            return a, ("aten._scaled_dot_product_flash_attention, one call per request (flash "
                       "varlen unavailable)")
        log("attention kernel sdpa_flash: result differs from the CPU kernel, not used")
    except (RuntimeError, NotImplementedError, TypeError) as e:
        log(f"attention kernel sdpa_flash: unavailable ({str(e).splitlines()[0][:120]})")
    raise SystemExit("no usable CUDA attention kernel")


if __name__ == "__main__":
    sys.exit(main())
