"""Copies between the host tier's pools and the attention's device, for the windowed path.

The host pools (host_tier.HostStore, "tokens" layout: ``[num_pages, page_tokens, H, D]`` per layer,
allocated once at start-up, pinned when CUDA is available) are never gathered on the host and never
pinned per call. A window of a request's history is loaded as one copy per *run* of consecutive
pages, straight from the pool into one of two staging buffers on the device, on a copy stream, so
window i+1 loads while window i is attended; the new tokens' K/V go back to the pool the same way
(one copy per run of consecutive slots) without blocking the compute stream.

``Medium`` says how those copies run:

- ``Medium.for_device(cpu)``: copies run at once, events and streams are no-ops (vLLM's CPU engine;
  the same code as on a GPU, so CI runs it); a window in the pools' own dtype whose pages are one
  run is a view of the pools, nothing copied (``zero_copy``);
- ``Medium.for_device(cuda:N)``: a copy stream with events; the compute stream waits for a window's
  event before attending it, the copy stream waits for the compute stream before it overwrites a
  staging buffer or reads a step's new K/V; host-side readers of the pools (the shared tier) call
  ``sync_writes()`` first.

Imports only torch: the floor bench and the GPU checks can use it on a bare machine.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator

import torch

from . import gather


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in `pages`, first page id, count) of each run of consecutive page ids."""
    if pages and pages[-1] - pages[0] == len(pages) - 1 \
            and pages == list(range(pages[0], pages[-1] + 1)):
        return [(0, pages[0], len(pages))]  # one run (a list compare runs in C)
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == p:
            idx, first, n = runs[-1]
            runs[-1] = (idx, first, n + 1)
        else:
            runs.append((i, p, 1))
    return runs


def clip_runs(runs: list[tuple[int, int, int]], first: int, last: int,
              starts: list[int] | None = None) -> list[tuple[int, int, int]]:
    """The runs of `page_runs(pages)` cut to the pages of index [first, last], indices counted from
    `first`: equal to `page_runs(pages[first:last + 1])`. `starts`: the runs' first indices
    (found by bisection; computed when not given)."""
    if starts is None:
        starts = [r[0] for r in runs]
    out = []
    for idx, page, n in runs[max(0, bisect_right(starts, first) - 1):]:
        if idx > last:
            break
        a, b = max(idx, first), min(idx + n - 1, last)
        if a <= b:
            out.append((a - first, page + a - idx, b - a + 1))
    return out


def slot_runs(pages: list[int], page_tokens: int, start: int, n: int) -> list[tuple[int, int, int]]:
    """(first pool slot, first token offset in [start, start + n), length) of each run of tokens
    [start, start + n) of a request whose pool slots (page * page_tokens + offset) are consecutive."""
    P = page_tokens
    runs: list[tuple[int, int, int]] = []
    pos, end = start, start + n
    while pos < end:
        take = min(P - pos % P, end - pos)
        slot = pages[pos // P] * P + pos % P
        if runs and runs[-1][0] + runs[-1][2] == slot:
            s, o, length = runs[-1]
            runs[-1] = (s, o, length + take)
        else:
            runs.append((slot, pos - start, take))
        pos += take
    return runs


class Medium:
    """Synchronous copies (CPU): streams and events are no-ops. Subclassed for CUDA."""

    is_async = False

    def __init__(self, device: torch.device):
        self.device = device
        self.gather: str | None = None  # gather_kernel's answer where set (tests: "triton")

    @staticmethod
    def for_device(device: torch.device) -> "Medium":
        return CudaMedium(device) if device.type == "cuda" else Medium(device)

    def staging_dtype(self, pool_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the staging buffers: on the CPU float32, the CPU attention kernels' dtype
        (the copy into the buffer converts, instead of a conversion per window after it); on a
        GPU the pool's."""
        return torch.float32 if self.device.type == "cpu" else pool_dtype

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src on the copy stream (never blocking the compute stream)."""
        dst.copy_(src, non_blocking=self.is_async)

    def on_copy_stream(self):
        """Context for the copies of one transfer (CUDA: the copy stream)."""
        return _NoContext()

    def copy_event(self):
        """An event after the copies issued so far on the copy stream (None: already done)."""
        return None

    def compute_waits(self, event) -> None:
        """The compute stream waits for `event` (a window loaded)."""

    def compute_event(self):
        """An event after the work issued so far on the compute stream (None: already done)."""
        return None

    def copy_waits(self, event) -> None:
        """The copy stream waits for `event` (the compute stream done with a buffer or tensor)."""

    def zero_copy(self, pool: torch.Tensor, dtype: torch.dtype | None) -> bool:
        """Whether a window may be a view of `pool` itself: the medium reads the pool's memory
        synchronously (the CPU) and the kernel takes the pool's dtype."""
        return (not self.is_async and pool.device == self.device
                and (dtype or self.staging_dtype(pool.dtype)) == pool.dtype)

    def gather_kernel(self, rows: torch.Tensor, dtype: torch.dtype) -> str | None:
        """How a window of many runs (`gather.MIN_RUNS` or more) of a pool (`rows`: its token rows,
        ``[slots, H, D]``) is loaded into a staging buffer of `dtype` in one go
        (`gather.copy_rows_kv`'s kernel), or None: one copy per run. The CPU: "torch"
        (``index_select``, converting), or `gather` where a test set it; an asynchronous medium
        without a kernel of its own: None."""
        return self.gather or (None if self.is_async else "torch")

    def index_to_device(self, index: torch.Tensor) -> torch.Tensor:
        """A gather's row index where its kernel reads it."""
        return index

    def keep_alive(self, t: torch.Tensor) -> None:
        """`t`, made on the compute stream, is read by the copy stream: keep its memory until then."""

    def note_writes(self) -> None:
        """Remember the copy stream's position after a write-back (see sync_writes)."""

    def sync_writes(self) -> None:
        """The host waits for every write-back issued so far (before reading the pools on the host)."""


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CudaMedium(Medium):
    is_async = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=device)
        self._written = None
        self._pinned: dict[tuple, bool] = {}  # (pool storage, dtype, row shape): the kernel applies

    def on_copy_stream(self):
        return torch.cuda.stream(self.stream)

    def copy_event(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_waits(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def compute_event(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy_waits(self, event) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def gather_kernel(self, rows: torch.Tensor, dtype: torch.dtype) -> str | None:
        """Our Triton kernel reading the registered host pool through UVA, where it is pinned,
        the staging buffer is in its dtype and the kernel checked out on this device for this row
        shape (`gather.triton_usable`); else one copy per run."""
        if rows.device.type != "cpu" or dtype != rows.dtype:
            return None
        key = (rows.untyped_storage().data_ptr(), dtype, tuple(rows.shape[1:]))
        pinned = self._pinned.get(key)
        if pinned is None:
            pinned = self._pinned[key] = bool(rows.is_pinned()) and gather.triton_usable(
                self.device, dtype, tuple(rows.shape[1:]))
        return "triton" if pinned else None

    def index_to_device(self, index: torch.Tensor) -> torch.Tensor:
        return index.to(self.device, non_blocking=True)

    def keep_alive(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)

    def note_writes(self) -> None:
        self._written = self.copy_event()

    def sync_writes(self) -> None:
        if self._written is not None:
            self._written.synchronize()
            self._written = None


def staging_tokens(window: int, page: int) -> int:
    """Tokens of one staging buffer: a window's pages, one more when it starts inside a page."""
    return (-(-window // page) + 1) * page


class Transfer:
    """The copies of one device: two staging buffers per (K/V shape, dtype), reused across layers,
    requests and steps, each freed by an event when the compute stream is done with it."""

    def __init__(self, medium: Medium):
        self.medium = medium
        self._staging: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._consumed: dict[tuple, list] = {}  # per buffer: the compute stream's event after its use
        self.windows_loaded = 0
        self.copies = 0
        self.gathers = 0  # windows loaded by one gather (gather.copy_rows_kv) instead of `copies`

    @property
    def device(self) -> torch.device:
        return self.medium.device

    def _buffers(self, pool: torch.Tensor, tokens: int,
                 dtype: torch.dtype | None = None) -> tuple[tuple, list]:
        dtype = dtype or self.medium.staging_dtype(pool.dtype)
        key = (tuple(pool.shape[2:]), dtype)
        bufs = self._staging.get(key)
        if bufs is None or bufs[0][0].shape[0] < tokens:
            shape = (tokens, *pool.shape[2:])
            bufs = [(torch.empty(shape, dtype=dtype, device=self.device),
                     torch.empty(shape, dtype=dtype, device=self.device)) for _ in range(2)]
            self._staging[key] = bufs
            self._consumed[key] = [None, None]
        return key, bufs

    def reserve(self, pool: torch.Tensor, window: int) -> int:
        """Allocate the two staging buffers of `pool`'s shape for `window` now (start-up, so that
        they are in place before the first step); their bytes."""
        _, bufs = self._buffers(pool, staging_tokens(window, pool.shape[1]))
        return sum(t.numel() * t.element_size() for pair in bufs for t in pair)

    def windows(self, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: list[int], ctx: int,
                window: int, dtype: torch.dtype | None = None, cache: dict | None = None
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, K, V) of each window [start, min(start + window, ctx)) of a request's history
        (pages: the request's page list), K/V on the device as [tokens, H, D]: the next window is
        loaded while the caller attends this one; the caller must be done with a window (on the
        compute stream) when it asks for the next one. `dtype`: the staging buffers' (the copies
        convert; default `Medium.staging_dtype`). Where the medium shares the pools' memory
        (`Medium.zero_copy`) and `dtype` is the pools', a window whose pages are one run is a view
        of the pools, nothing copied. ``cache``: where the request's page runs and each window's
        gather index are kept for the next layer of the same step (the worker's `_Batch`: the
        same pages in every layer of a group), so that they are made once per step, not per
        layer (a 1M-token history is 32K pages to walk in Python)."""
        if ctx <= 0:
            return
        P = k_pool.shape[1]
        runs_key = (P, ctx, window)
        runs = cache.get(runs_key) if cache is not None else None
        if runs is None:
            runs = page_runs(pages[:(ctx - 1) // P + 1])  # once, cut per window
            runs = (runs, [r[0] for r in runs])
            if cache is not None:
                cache[runs_key] = runs
        # the pools as token rows (a view): a run of pages is one slice of them
        pools = (k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:]))
        share = self.medium.zero_copy(k_pool, dtype)
        staged: list = []  # (key, buffers), fetched at the first window that is copied

        def window_at(i: int):
            start = i * window
            end = min(start + window, ctx)
            if share:
                one = clip_runs(runs[0], start // P, (end - 1) // P, runs[1])
                if len(one) == 1:  # one run of pages: the window is a slice of the pools
                    s = one[0][1] * P + start % P
                    self.windows_loaded += 1
                    return (start, pools[0][s:s + end - start], pools[1][s:s + end - start]), \
                        None, None
            if not staged:
                staged.append(self._buffers(k_pool, staging_tokens(window, P), dtype))
            key, bufs = staged[0]
            k, v, ready = self._load(pools, P, runs, start, end, bufs[i % 2], key, i % 2,
                                     cache, (*runs_key, i))
            return (start, k, v), ready, key

        yield from self._double_buffered(-(-ctx // window), window_at)

    def packed(self, k_pool: torch.Tensor, v_pool: torch.Tensor, windows: list[list],
               runs_of: list[list[list[tuple[int, int, int]]]], window: int,
               dtypes: list[torch.dtype | None], index_cache: dict | None = None
               ) -> Iterator[tuple[list, list[tuple[torch.Tensor, torch.Tensor]], tuple | None]]:
        """The packed windows of a step (packed.plan: pieces of several requests' histories back to
        back; ``runs_of[i][j]``: the pool slot runs of window i's piece j, `slot_runs` of its
        request's pages), one after another: per window its pieces, the K/V of each piece
        ([tokens, H, D] on the device) and the window's staging buffers holding them all at the
        pieces' offsets ``(k, v, tokens)`` (None where a piece is a view of the pools). Each piece
        is loaded token-exact, one copy per run of consecutive pool slots, on the copy stream; the
        next window loads while the caller attends this one, and the caller must be done with a
        window (on the compute stream) when it asks for the next. ``dtypes``: each window's
        staging dtype (None: `Medium.staging_dtype`). Where the medium shares the pools' memory
        and a window's dtype is the pools', a piece of one slot run is a view of the pools.
        ``index_cache``: where a window's gather index (`gather.run_rows`, on the device) is kept
        for the next layer of the same step (`packed.StepPlan.gather_index`: the same windows and
        slots in every layer), so that it is built and copied once per step, not per layer."""
        if not windows:
            return
        P = k_pool.shape[1]
        pools = (k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:]))
        m = self.medium

        def window_at(i: int):
            pieces, dtype, runs = windows[i], dtypes[i], runs_of[i]
            kvs: list = [None] * len(pieces)
            if m.zero_copy(k_pool, dtype):
                for j, (pc, rr) in enumerate(zip(pieces, runs)):
                    if len(rr) == 1:  # one run of slots: the piece is a slice of the pools
                        s = rr[0][0]
                        kvs[j] = (pools[0][s:s + pc.end - pc.start],
                                  pools[1][s:s + pc.end - pc.start])
            self.windows_loaded += 1
            if all(kv is not None for kv in kvs):
                return (pieces, kvs, None), None, None
            key, bufs = self._buffers(k_pool, staging_tokens(window, P), dtype)
            bk, bv = bufs[i % 2]
            shared = m.zero_copy(k_pool, dtype)
            with m.on_copy_stream():
                m.copy_waits(self._consumed[key][i % 2])
                rows = []
                for j, (pc, rr) in enumerate(zip(pieces, runs)):
                    if kvs[j] is not None:
                        continue
                    rows += [(slot, pc.at + off, length) for slot, off, length in rr]
                    n = pc.end - pc.start
                    kvs[j] = (bk[pc.at:pc.at + n], bv[pc.at:pc.at + n])
                self._copy_runs(bk, bv, pools[0], pools[1], rows, index_cache, (i, shared))
                ready = m.copy_event()
            fill = max(pc.at + pc.end - pc.start for pc in pieces)
            whole = (bk[:fill], bv[:fill], fill) if not shared else None
            return (pieces, kvs, whole), ready, key

        yield from self._double_buffered(len(windows), window_at)

    def _copy_runs(self, bk, bv, kf, vf, runs: list[tuple[int, int, int]],
                   index_cache: dict | None = None, cache_key=None) -> None:
        """Row runs (source row, destination row, rows) of the pools `kf`/`vf` into the staging
        buffers `bk`/`bv`, on the copy stream: one gather where there are many runs and the
        medium has a kernel for them, else one copy per run. The gather's index is taken from
        (or kept in) ``index_cache[cache_key]`` when a cache is given (the same runs there)."""
        m = self.medium
        if len(runs) >= gather.MIN_RUNS:
            kernel = m.gather_kernel(kf, bk.dtype)
            if kernel is not None:
                index = index_cache.get(cache_key) if index_cache is not None else None
                if index is None:
                    index = m.index_to_device(gather.run_rows(runs))
                    if index_cache is not None:
                        index_cache[cache_key] = index
                gather.copy_rows_kv(bk, bv, kf, vf, index, kernel)
                self.gathers += 1
                return
        for src, dst, rows in runs:
            m.copy(bk[dst:dst + rows], kf[src:src + rows])
            m.copy(bv[dst:dst + rows], vf[src:src + rows])
        self.copies += 2 * len(runs)

    def _double_buffered(self, count: int, window_at) -> Iterator:
        """Windows 0..count-1, each loaded (``window_at(i)``: (what to yield, its copy event,
        the staging buffers' key or None where nothing was copied into buffer i % 2)) while the
        caller attends the one before: the compute stream waits for a window's copies before the
        caller gets it, and once the caller asks for the next one, buffer i % 2 is marked
        consumed (the copy stream waits for that before it overwrites the buffer)."""
        m = self.medium
        pending = window_at(0)
        for i in range(count):
            item, ready, key = pending
            if i + 1 < count:  # overlaps with the caller's attention of this window
                pending = window_at(i + 1)
            m.compute_waits(ready)
            yield item
            if key is not None:
                self._consumed[key][i % 2] = m.compute_event()

    def _load(self, pools, P, runs, start, end, buf, key, which, index_cache=None,
              cache_key=None):
        """Tokens [start, end) of the request into staging buffer `which` of `key`: one copy per
        run of consecutive pages (`pools`: the K and V pools as token rows, `P` tokens a page;
        `runs`: the request's page runs and their first indices), or one gather where there are
        many (its index kept in ``index_cache[cache_key]``), on the copy stream, after the
        compute stream is done with the buffer."""
        first, last = start // P, (end - 1) // P
        (bk, bv), (kf, vf) = buf, pools
        m = self.medium
        with m.on_copy_stream():
            m.copy_waits(self._consumed[key][which])
            self._copy_runs(bk, bv, kf, vf, [(page * P, idx * P, n * P) for idx, page, n
                                             in clip_runs(runs[0], first, last, runs[1])],
                            index_cache, cache_key)
            ready = m.copy_event()
        self.windows_loaded += 1
        off = start - first * P
        return bk[off:off + end - start], bv[off:off + end - start], ready

    def write_back(self, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: list[int], start: int,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens [start, start + len(k)) of a request into the pools: one copy per run of
        consecutive slots, on the copy stream after the compute stream has made k and v; nothing
        waits for it here (sync_writes() before the host reads the pools)."""
        n = k.shape[0]
        if not n:
            return
        P = k_pool.shape[1]
        kf, vf = k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])
        k, v = k.to(kf.dtype), v.to(vf.dtype)
        m = self.medium
        made = m.compute_event()
        with m.on_copy_stream():
            m.copy_waits(made)
            for slot, off, length in slot_runs(pages, P, start, n):
                m.copy(kf[slot:slot + length], k[off:off + length])
                m.copy(vf[slot:slot + length], v[off:off + length])
                self.copies += 2
        m.keep_alive(k)
        m.keep_alive(v)
        m.note_writes()

    def sync_writes(self) -> None:
        self.medium.sync_writes()


class PagedHistory:
    """A request's history in the pools of one layer, for windowed_attention: its windows come
    through `transfer` (page runs into staging buffers on the attention's device)."""

    def __init__(self, transfer: Transfer, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 pages: list[int], cache: dict | None = None):
        self.transfer, self.k_pool, self.v_pool, self.pages = transfer, k_pool, v_pool, pages
        self.cache = cache  # the request's runs and gather indexes of this step (Transfer.windows)

    def windows(self, ctx: int, window: int, dtype: torch.dtype | None = None
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return self.transfer.windows(self.k_pool, self.v_pool, self.pages, ctx, window, dtype,
                                     self.cache)

    def append(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K/V [start, start + len(k)) into the pools (Transfer.write_back)."""
        self.transfer.write_back(self.k_pool, self.v_pool, self.pages, start, k, v)


class Transfers:
    """A Transfer per device, made on first use (`made`: those made so far)."""

    def __init__(self):
        self.made: dict[torch.device, Transfer] = {}

    def __call__(self, device: torch.device) -> Transfer:
        t = self.made.get(device)
        if t is None:
            t = self.made[device] = Transfer(Medium.for_device(device))
        return t


def transfers() -> Transfers:
    return Transfers()
