"""Host tier: the full K/V history of the streaming layers, in pages of ``page_tokens`` tokens.

Two halves, as in vLLM's own paged cache:

- `PagePool` (scheduler side) owns the page table: free pages, per-request page lists,
  content hashes of full prompt pages for prefix reuse (kept, LRU-evictable, after the request
  finishes), and the counters reported as stats. It allocates; it never touches tensor data.
- `HostStore` (worker side) holds the tensors, one K and one V pool per streaming layer
  (``[num_pages, page_tokens, num_kv_heads, head_size]``; one page-locked arena for all of them
  when CUDA is available (pinned.HostArena: registered with cudaHostRegister, exactly its size),
  plain memory on CPU, or a memory-mapped file), and reads/writes token ranges of a request given
  its page list.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .pinned import HostArena


class HostTierFull(RuntimeError):
    pass


def page_hashes(token_ids: list[int], page_tokens: int, extra: str = "") -> list[bytes]:
    """Chained hashes of the full pages of `token_ids` (a page's hash covers all before it)."""
    out: list[bytes] = []
    prev = hashlib.sha256(extra.encode()).digest()
    for i in range(len(token_ids) // page_tokens):
        page = token_ids[i * page_tokens : (i + 1) * page_tokens]
        prev = hashlib.sha256(prev + repr(page).encode()).digest()
        out.append(prev)
    return out


@dataclass
class PoolStats:
    allocated_pages: int = 0
    freed_pages: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_requests: int = 0
    evicted_pages: int = 0
    refused_requests: int = 0
    waited_for_space: int = 0
    wait_timeouts: int = 0
    resumed_reuse_requests: int = 0
    resumed_reuse_tokens: int = 0
    failed_host_tier_full: int = 0
    cache_resets: int = 0
    reset_dropped_pages: int = 0


@dataclass
class _Req:
    pages: list[int] = field(default_factory=list)
    hashed: int = 0  # leading pages already registered under their hash


class PagePool:
    def __init__(self, num_pages: int, page_tokens: int):
        if num_pages <= 0:
            raise ValueError("kvstack streaming: the host tier holds no page")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0
        self._reqs: dict[str, _Req] = {}
        self.stats = PoolStats()

    # ---- capacity -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    def num_available(self) -> int:
        return len(self._free) + len(self._lru)

    def num_used(self) -> int:
        """Pages held by live requests (cached, evictable pages not counted)."""
        return self.num_pages - self.num_available()

    def num_cached(self) -> int:
        """Pages of finished requests kept for prefix reuse (evictable)."""
        return len(self._lru)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    # ---- requests ------------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        return req_id in self._reqs

    def pages(self, req_id: str) -> list[int]:
        return self._reqs[req_id].pages

    def match_prefix(self, hashes: list[bytes]) -> int:
        """Number of leading pages of `hashes` held in the pool (no side effect)."""
        n = 0
        for h in hashes:
            if h not in self._page_of:
                break
            n += 1
        return n

    def num_idle_hits(self, hashes: list[bytes], num_hit_pages: int) -> int:
        """How many of the first `num_hit_pages` pages of `hashes` are cached and held by no
        request: `num_available()` counts them, but a hit takes them out of reach of eviction,
        so admission must not count them as free space too."""
        return sum(1 for h in hashes[:num_hit_pages] if self._ref[self._page_of[h]] == 0)

    def start(self, req_id: str, hashes: list[bytes], num_hit_pages: int) -> None:
        """Open a request, sharing its first `num_hit_pages` pages with the cache."""
        req = _Req()
        for h in hashes[:num_hit_pages]:
            p = self._page_of[h]
            self._take(p)
            req.pages.append(p)
        req.hashed = num_hit_pages
        self._reqs[req_id] = req
        if num_hit_pages:
            self.stats.prefix_hit_requests += 1
            self.stats.prefix_hit_tokens += num_hit_pages * self.page_tokens

    def ensure(self, req_id: str, num_tokens: int) -> None:
        """Give `req_id` pages for its first `num_tokens` tokens (raises HostTierFull)."""
        req = self._reqs.get(req_id)  # every step of every request: no _Req made in vain
        if req is None:
            req = self._reqs[req_id] = _Req()
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        if need > self.num_available():
            raise HostTierFull(
                f"kvstack host tier full: request {req_id} needs {need} more page(s) of "
                f"{self.page_tokens} tokens, {self.num_available()} free of {self.num_pages}"
            )
        for _ in range(need):
            req.pages.append(self._alloc())

    def register_full_pages(self, req_id: str, hashes: list[bytes], num_tokens: int) -> None:
        """Publish the hashes of the pages of `req_id` whose tokens are all computed."""
        req = self._reqs.get(req_id)
        if req is None:
            return
        full = min(len(hashes), num_tokens // self.page_tokens, len(req.pages))
        for i in range(req.hashed, full):
            h, p = hashes[i], req.pages[i]
            if h not in self._page_of and p not in self._hash_of:
                self._page_of[h] = p
                self._hash_of[p] = h
        req.hashed = max(req.hashed, full)

    def finish(self, req_id: str) -> None:
        req = self._reqs.pop(req_id, None)
        if req is None:
            return
        # Last page first: the LRU evicts its oldest entry, so a cached prefix loses its tail
        # before its head, and every page left in the cache stays reachable by the chain of
        # hashes (a page whose predecessor was evicted could never be hit again).
        for p in reversed(req.pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._lru[p] = None  # keep for reuse, evictable
                else:
                    self._free.append(p)
                    self.stats.freed_pages += 1

    def reset_cache(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache: weights changed, sleep/wake,
        an operator's reset): cached pages of finished requests go back to the free list, and no
        page, a running request's included, can be hit again under its hash. Running requests
        keep their pages (and publish none of them again: each one's `hashed` stays where it
        is). Returns the number of cached pages dropped."""
        dropped = len(self._lru)
        self._free.extend(self._lru)
        self._lru.clear()
        self._hash_of.clear()
        self._page_of.clear()
        self.stats.freed_pages += dropped
        self.stats.reset_dropped_pages += dropped
        self.stats.cache_resets += 1
        return dropped

    # ---- internals ------------------------------------------------------------------------
    def _take(self, p: int) -> None:
        if self._ref[p] == 0:
            self._lru.pop(p, None)
        self._ref[p] += 1

    def _alloc(self) -> int:
        if self._free:
            p = self._free.pop()
        else:
            p, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(p)
            del self._page_of[h]
            self.stats.evicted_pages += 1
        self._ref[p] = 1
        self.stats.allocated_pages += 1
        return p


class HostStore:
    """K/V pools of the streaming layers (worker side), in one of two layouts:

    - ``"tokens"``: a K and a V pool per layer, ``[num_pages, page_tokens, num_kv_heads,
      head_size]``; `read` gathers token ranges for the windowed path (any device).
    - ``"cpu_kernel"``: one tensor per layer in vLLM's CPU paged-cache layout, ``[num_pages,
      num_kv_heads, page_tokens, 2 * head_size]`` (a page is one kernel block), so vLLM's own CPU
      attention kernel attends a request's history where it lies, given its pages as the block
      table (cpu_native.py). Written and read through the layer's backend only."""

    def __init__(self, layer_names: list[str], num_pages: int, page_tokens: int,
                 num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 path: str | None = None, pin: bool | None = None, layout: str = "tokens"):
        if layout not in ("tokens", "cpu_kernel"):
            raise ValueError(f"kvstack host tier: unknown layout {layout!r}")
        self.page_tokens = page_tokens
        self.layout = layout
        self.arena: HostArena | None = None  # the pools' memory (None: a file)
        numel = num_pages * page_tokens * num_kv_heads * head_size  # K (or V) of one layer
        if pin is None:
            pin = torch.cuda.is_available() and layout == "tokens"
        if path:
            # One memory-mapped file for all pools: more than RAM, paged by the OS.
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            flat = torch.from_file(path, shared=True, size=2 * numel * len(layer_names),
                                   dtype=dtype)
            per_layer = flat.split(2 * numel)
        else:
            # One arena for every layer's pools, allocated once (pinned: registered, exactly its
            # size; torch's pinned allocator would round it up to a power of two). The CPU kernel
            # reads whole blocks and masks the tail: its pools must hold numbers, never NaN
            # (zeros; a new file is zeros too, a kept file's earlier contents are K/V values)
            self.arena = HostArena(2 * numel * len(layer_names), dtype, pin,
                                   zero=layout == "cpu_kernel")
            per_layer = self.arena.tensor.split(2 * numel)
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.kv: dict[str, torch.Tensor] = {}
        for name, mem in zip(layer_names, per_layer):
            if layout == "tokens":
                shape = (num_pages, page_tokens, num_kv_heads, head_size)
                self.k[name], self.v[name] = (x.view(shape) for x in mem.split(numel))
            else:
                self.kv[name] = mem.view(num_pages, num_kv_heads, page_tokens, 2 * head_size)

    def slots(self, pages: list[int], start: int, n: int) -> torch.Tensor:
        """Flat slot (page * page_tokens + offset) of each of tokens [start, start + n)."""
        P = self.page_tokens
        pos = torch.arange(start, start + n)
        first = start // P
        table = torch.tensor(pages[first:(start + n - 1) // P + 1], dtype=torch.long)
        return table[pos // P - first] * P + pos % P

    def write(self, layer: str, pages: list[int], start: int,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens [start, start + len(k)) of a request ("tokens" layout)."""
        n = k.shape[0]
        if not n:
            return
        slots = self.slots(pages, start, n)
        kp, vp = self.k[layer], self.v[layer]
        # one scatter per pool (from a device: one copy of the step's tokens to the host first)
        kp.view(-1, *kp.shape[2:]).index_copy_(0, slots, k.to(device="cpu", dtype=kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, slots, v.to(device="cpu", dtype=vp.dtype))

    def read(self, layer: str, pages: list[int], start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, end) of a request: K, V of shape [end - start, H, D] (host)."""
        P = self.page_tokens
        first, last = start // P, (end - 1) // P
        idx = torch.tensor(pages[first:last + 1], dtype=torch.long)
        off = start - first * P
        k = self.k[layer].index_select(0, idx).flatten(0, 1)[off:off + end - start]
        v = self.v[layer].index_select(0, idx).flatten(0, 1)[off:off + end - start]
        return k, v
