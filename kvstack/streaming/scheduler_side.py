"""Scheduler side of the streaming connector: the host-tier page table (admission, per-step
pages, prefix reuse, freeing) and the per-step metadata for the worker."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .config import StreamingConfig
from .host_tier import HostTierFull, PagePool, page_hashes
from .layout import ReqStep, StreamingMetadata, _Layout
from .log import logger
from .shared_tier import SharedTier, open_for_engine, predict_store_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def request_key(request: "Request") -> str:
    """What besides the token ids decides a page's K/V, as in vLLM's own block hashes: the
    LoRA adapter, the cache salt and the multimodal inputs (identifier and placeholder range).
    It seeds the chain of page hashes, so requests that differ in any of them share no page.
    Prompt embeddings have no token ids to hash: such a request shares nothing."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    for f in getattr(request, "mm_features", None) or []:
        pos = getattr(f, "mm_position", None)
        parts.append(f"mm={f.identifier}@{getattr(pos, 'offset', '')}+{getattr(pos, 'length', '')}")
    if getattr(request, "prompt_embeds", None) is not None:
        parts.append(f"embeds={request.request_id}")
    return "|".join(parts)


class _SchedulerSide:
    def __init__(self, cfg: StreamingConfig, layout: _Layout, vllm_config: "VllmConfig"):
        self.cfg = cfg
        self.layout = layout
        self.pool = PagePool(layout.num_pages, cfg.page_tokens)
        max_len = vllm_config.model_config.max_model_len
        if self.pool.capacity_tokens < max_len:
            raise ValueError(
                f"kvstack StreamingConnector: the host tier ({cfg.host_tier_gib} GiB = "
                f"{self.pool.capacity_tokens} tokens of {len(layout.layers)} streaming layer(s)) "
                f"cannot hold one request of max_model_len={max_len}; raise host_tier_gib or "
                f"lower max_model_len (longer requests are then refused up front by vLLM).")
        self.prefix_reuse = cfg.prefix_reuse and layout.reuse_ok
        self._granule_pages = max(1, layout.reuse_granule // cfg.page_tokens)
        if self.prefix_reuse and self._granule_pages > 1:
            logger.info("kvstack streaming: prefix reuse in steps of %d tokens (where the "
                        "chunked-local layers' chunks end)", layout.reuse_granule)
        if cfg.prefix_reuse and not self.prefix_reuse:
            logger.warning("kvstack streaming: prefix reuse off (layers outside the host tier "
                           "would need their device KV restored)")
        self._reserved: dict[str, int] = {}  # req_id -> pages reserved (admission, growth)
        self._hashes: dict[str, list[bytes]] = {}
        # block ids per request in each streaming group
        self._blocks: dict[str, dict[int, list[int]]] = {}
        self._prompt_len: dict[str, int] = {}
        self._failed: dict[str, str] = {}  # req_id -> reason, until the scheduler takes it
        # on_host_tier_full="wait": req_id -> [first wait (monotonic s), pages it needs], in the
        # order they began to wait, until vLLM allocates them (or they finish)
        self._waiting: dict[str, list] = {}
        # req_id -> tokens whose K/V its host pages hold (what a resume after preemption reuses)
        self._written: dict[str, int] = {}
        # the worker's copy of each page table: pages sent so far; finished requests to drop
        self._sent: dict[str, int] = {}
        self._finished: list[str] = []
        self.max_pages_in_use = 0
        # the shared tier (LMCache's storage below the host tier; shared_tier.py)
        self.shared: SharedTier | None = None
        self._fetched: dict[str, tuple[int, list]] = {}  # rid -> (pool hit, fetched payloads)
        self._saved: dict[str, int] = {}  # rid -> leading prompt pages the shared tier holds
        self._loaded: dict[str, int] = {}  # rid -> prefix tokens its pages hold, until scheduled
        self._loads: list[tuple[int, Any]] = []  # (page, payload) for the next step's worker
        # bumped by reset_cache: seeds the page hashes, so nothing hashed before a reset (the
        # host tier's pages, the shared tier's objects) is found after it
        self._generation = 0
        if cfg.lmcache is not None:
            self.shared = open_for_engine(cfg, layout, vllm_config,
                                          predict_store_tag(cfg, vllm_config, layout))

    def _hashes_of(self, request: "Request") -> list[bytes]:
        h = self._hashes.get(request.request_id)
        if h is None:
            key = request_key(request)
            if self._generation:
                key += f"|gen={self._generation}"
            h = page_hashes(list(request.prompt_token_ids or []), self.cfg.page_tokens,
                            extra=key)
            self._hashes[request.request_id] = h
        return h

    def _outstanding(self) -> int:
        return sum(max(0, r - len(self.pool.pages(i)) if self.pool.has(i) else r)
                   for i, r in self._reserved.items())

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        rid = request.request_id
        # vLLM drops any hit of a request that must not read the prefix cache (prompt_logprobs,
        # some pooling) after this answer: admit it as the request it will be, with no hit
        skip_reading = bool(getattr(request, "skip_reading_prefix_cache", False))
        if self.pool.has(rid):  # resumed after preemption: its pages are still held
            return self._resume_hit(request, num_computed_tokens, skip_reading), False
        need = self._admission_pages(request)
        hit_pages = 0
        shared_pages = 0
        if self.prefix_reuse and num_computed_tokens == 0 and not skip_reading:
            limit = (request.num_prompt_tokens - 1) // self.cfg.page_tokens
            hit_pages = self.pool.match_prefix(self._hashes_of(request))
            hit_pages = min(hit_pages, limit)
            if self.shared is not None and hit_pages < limit:
                # after the host tier, the hash chain goes on in LMCache's storage: only pages
                # fetched and checked now count as a hit (a backend that fails costs a recompute)
                fetched = self._fetched.get(rid)
                if fetched is None or fetched[0] != hit_pages:
                    fetched = self._fetched[rid] = (
                        hit_pages, self.shared.fetch(self._hashes_of(request), hit_pages, limit))
                shared_pages = len(fetched[1])
            # end where every local chunk ends (the host tier's pages first, then the shared's)
            total = hit_pages + shared_pages
            total -= total % self._granule_pages
            hit_pages, shared_pages = min(hit_pages, total), max(0, total - hit_pages)
        # Cached pages this request hits are taken, not freed: counted once, as hits.
        idle_hits = self.pool.num_idle_hits(self._hashes_of(request), hit_pages) if hit_pages else 0
        free = self.pool.num_available() - idle_hits - self._outstanding()
        if self.cfg.on_host_tier_full == "wait":
            # first come, first served: what earlier waiting requests need is kept for them
            free -= self._needed_ahead_of(rid)
            if need - hit_pages > free:
                return self._wait(request, need - hit_pages, free), False
            if rid in self._waiting:  # admitted: it keeps its place until vLLM allocates it
                self._waiting[rid][1] = need - hit_pages
        elif need - hit_pages > free:
            self._fail(rid, (
                f"kvstack StreamingConnector: host tier full: this request needs "
                f"{(need - hit_pages) * self.cfg.page_tokens} tokens of host tier "
                f"(prompt + {self._reserve_what()}), "
                f"{max(free, 0) * self.cfg.page_tokens} are free "
                f"({len(self._reserved)} running request(s) hold the rest of "
                f"{self.pool.capacity_tokens}); retry later, or raise host_tier_gib"))
            return None, False  # not scheduled; the scheduler fails it (take_failed)
        # pages from the shared tier need pages of the host tier: counted in `need` above
        return (hit_pages + shared_pages) * self.cfg.page_tokens, False

    def _needed_ahead_of(self, rid: str) -> int:
        """Pages the requests waiting since before `rid` still need (all waiting ones when
        `rid` has not waited yet)."""
        ahead = 0
        for other, (_, need) in self._waiting.items():
            if other == rid:
                break
            ahead += need
        return ahead

    def _wait(self, request: "Request", need: int, free: int) -> None:
        """`request` waits for `need` pages (on_host_tier_full="wait"), in line behind the
        requests that waited before it; past ``wait_timeout_s`` it fails alone instead."""
        rid = request.request_id
        now = time.monotonic()
        entry = self._waiting.setdefault(rid, [now, need])
        entry[1] = need
        self.pool.stats.waited_for_space += 1
        timeout = self.cfg.wait_timeout_s
        if timeout is not None and now - entry[0] >= timeout and rid not in self._failed:
            self.pool.stats.wait_timeouts += 1
            self._fail(rid, (
                f"kvstack StreamingConnector: host tier full: this request waited "
                f"{now - entry[0]:.1f} s (wait_timeout_s={timeout:g}) for "
                f"{need * self.cfg.page_tokens} tokens of host tier (prompt + "
                f"{self._reserve_what()}); {max(free, 0) * self.cfg.page_tokens} are free to it "
                f"({len(self._reserved)} running and {len(self._waiting) - 1} other waiting "
                f"request(s) hold or need the rest of {self.pool.capacity_tokens}); retry later, "
                f"raise host_tier_gib or wait_timeout_s"))
        return None

    def _fail(self, rid: str, reason: str) -> None:
        """`rid` fails with `reason` (the scheduler takes it, take_failed); counted once."""
        if rid not in self._failed:
            self.pool.stats.failed_host_tier_full += 1
        self._failed[rid] = reason

    def _resume_hit(self, request: "Request", num_computed_tokens: int,
                    skip_reading: bool) -> int:
        """A request preempted by vLLM keeps its host pages: on its resume, the tokens whose
        K/V those pages hold are an external hit (no device KV to restore: every other layer
        streams, or is chunked-local and the hit ends where its chunks end, or a sibling
        connector restores it under joint hits), up to the last token, which it recomputes."""
        if not self.layout.reuse_ok or skip_reading:
            return 0
        total = min(self._written.get(request.request_id, 0), request.num_tokens - 1)
        granule = self._granule_pages * self.cfg.page_tokens
        total -= total % granule
        return max(0, total - num_computed_tokens)

    def _admission_pages(self, request: "Request") -> int:
        """Pages reserved when a request is admitted: its prompt and the first
        ``decode_reserve_tokens`` of its output (all of max_tokens with "max")."""
        max_tokens = getattr(request, "max_tokens", None) or 0
        reserve = self.cfg.decode_reserve_tokens
        decode = max_tokens if reserve is None else min(max_tokens, reserve)
        return min(self.pool.pages_for(request.num_prompt_tokens + decode), self.pool.num_pages)

    def _reserve_what(self) -> str:
        reserve = self.cfg.decode_reserve_tokens
        return "max_tokens" if reserve is None else f"up to {reserve} output tokens"

    def _grow(self, rid: str, num_tokens: int) -> bool:
        """Extend `rid`'s reservation to cover `num_tokens` from the pages no one has
        reserved; False (nothing changed) when the tier has too few."""
        deficit = self.pool.pages_for(num_tokens) - self._reserved.get(rid, 0)
        if deficit <= 0:
            return True
        if self.pool.num_available() - self._outstanding() < deficit:
            return False
        self._reserved[rid] = self._reserved.get(rid, 0) + deficit
        return True

    def take_failed(self) -> dict[str, str]:
        """Requests refused since the last call (reported once), with their reason."""
        failed, self._failed = self._failed, {}
        for rid in failed:
            self._hashes.pop(rid, None)
            self._fetched.pop(rid, None)
            self._waiting.pop(rid, None)
        return failed

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int):
        rid = request.request_id
        self._waiting.pop(rid, None)
        if self.pool.has(rid):
            if num_external_tokens > 0:  # a resume reusing its own pages (_resume_hit)
                self.pool.stats.resumed_reuse_requests += 1
                self.pool.stats.resumed_reuse_tokens += num_external_tokens
            return
        hashes = self._hashes_of(request) if self.prefix_reuse else []
        hit = num_external_tokens // self.cfg.page_tokens
        pool_hit, fetched = self._fetched.pop(rid, (hit, []))
        pool_hit = min(pool_hit, hit)
        self.pool.start(rid, hashes, pool_hit)
        self._loaded[rid] = pool_hit * self.cfg.page_tokens
        self._reserved[rid] = self._admission_pages(request)
        self._prompt_len[rid] = request.num_prompt_tokens
        if self.shared is not None:
            shared = min(hit - pool_hit, len(fetched))
            if shared > 0:
                # pages for what the shared tier gave: filled by the worker before the forward
                # (meta.loads), published under their hashes at once (the same step's other
                # requests may hit them: they are attended after the copy)
                self.pool.ensure(rid, (pool_hit + shared) * self.cfg.page_tokens)
                pages = self.pool.pages(rid)[pool_hit:pool_hit + shared]
                self._loads.extend(zip(pages, fetched[:shared]))
                self.pool.register_full_pages(rid, hashes, (pool_hit + shared) * self.cfg.page_tokens)
                self.pool.stats.prefix_hit_tokens += shared * self.cfg.page_tokens
                if not pool_hit:
                    self.pool.stats.prefix_hit_requests += 1
            # the pages before the hit's end came from a tier that has them: not stored again
            self._saved[rid] = pool_hit + max(shared, 0)
            self._loaded[rid] += max(shared, 0) * self.cfg.page_tokens

    def build_meta(self, so: "SchedulerOutput") -> StreamingMetadata:
        meta = StreamingMetadata()
        groups = self.layout.all_groups()
        steps: list[tuple[str, int]] = []
        for nr in so.scheduled_new_reqs:
            self._blocks[nr.req_id] = {g: list(nr.block_ids[g]) for g in groups}
            steps.append((nr.req_id, nr.num_computed_tokens))
            self._check_start(nr.req_id, nr.num_computed_tokens)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self._blocks[rid] = {g: list(nb[g]) if nb is not None else [] for g in groups}
            elif nb is not None:
                held = self._blocks.setdefault(rid, {g: [] for g in groups})
                for g in groups:
                    held[g].extend(nb[g])
            steps.append((rid, cr.num_computed_tokens[i]))
        sinks = 0  # sink pages handed out in this step
        for rid, start in steps:
            n = so.num_scheduled_tokens[rid]
            if not self._grow(rid, start + n):
                # Decoding past its reservation with no free page
                reserved = self._reserved.get(rid, 0) * self.cfg.page_tokens
                sinks += self._sink_step(meta, rid, start, n, sinks, (
                    f"kvstack StreamingConnector: host tier full while decoding: this request "
                    f"reached {start + n} tokens, past the {reserved} it reserved (prompt + "
                    f"{self._reserve_what()}), and no page is free; its output so far is kept. "
                    f"Raise host_tier_gib, or set decode_reserve_tokens to 'max' to reserve "
                    f"prompt + max_tokens at admission"))
                continue
            try:
                self.pool.ensure(rid, start + n)
            except HostTierFull as e:
                # Admission keeps num_available() >= every live request's reserved pages not yet
                # allocated (tests/env/streaming/test_scheduler_side.py checks it over random
                # schedules), unless vLLM changed a request's hit after the connector answered
                # (a path admission does not know). Never an engine death: this request alone
                # fails after the step.
                logger.error("kvstack streaming: host tier full for request %s: %s", rid, e)
                sinks += self._sink_step(meta, rid, start, n, sinks, (
                    f"kvstack StreamingConnector: host tier full: this request needs "
                    f"{start + n} tokens of host tier and no page is free ({e}); retry later, "
                    f"or raise host_tier_gib"))
                continue
            anchors = self._anchors(rid, start)
            first = anchors.pop(self.layout.group)
            meta.reqs.append(self._step(rid, start, n, first, anchors))
            self._written[rid] = start + n
            if self.prefix_reuse:
                self.pool.register_full_pages(
                    rid, self._hashes.get(rid, []), min(start + n, self._prompt_len.get(rid, 0)))
                if self.shared is not None:
                    self._save_full_pages(meta, rid, start + n)
        self.max_pages_in_use = max(self.max_pages_in_use, self.pool.num_used())
        meta.finished, self._finished = self._finished, []
        meta.loads, self._loads = self._loads, []
        return meta

    def _sink_step(self, meta: StreamingMetadata, rid: str, start: int, n: int, sinks: int,
                   reason: str) -> int:
        """Schedule `rid`'s step with the pages the tier can give and sink pages for the rest, and
        fail the request after this step (take_failed) with `reason`. This step's tokens are still
        computed right (the K/V with no page go to sink pages, distinct within the step); the
        request keeps its output so far. Returns the number of sink pages used."""
        have = len(self.pool.pages(rid)) if self.pool.has(rid) else 0
        reserved = self._reserved.get(rid, 0)
        target = max(have, min(reserved, have + self.pool.num_available()))
        self.pool.ensure(rid, min(start + n, target * self.cfg.page_tokens))
        k = self.pool.pages_for(start + n) - len(self.pool.pages(rid))
        first_sink = self.layout.num_pages + sinks
        self._fail(rid, reason)
        anchors = self._anchors(rid, start)
        first = anchors.pop(self.layout.group)
        meta.reqs.append(self._step(rid, start, n, first, anchors,
                                    list(range(first_sink, first_sink + k))))
        return k

    def _check_start(self, rid: str, start: int) -> None:
        """A new request must start within the prefix its pages hold. Past it (another
        connector loaded a longer prefix, e.g. under a MultiConnector without joint hits), its
        streaming layers would attend pages never written: the request fails instead."""
        loaded = self._loaded.pop(rid, None)
        if loaded is None or start <= loaded or rid in self._failed:
            return
        logger.error("kvstack streaming: request %s starts at token %d, its host tier holds "
                     "%d", rid, start, loaded)
        self._failed[rid] = (
            f"kvstack StreamingConnector: this request starts after {start} prefix tokens "
            f"loaded by another connector, but the host tier holds only its first {loaded}: "
            "its streaming layers cannot attend the rest. Run the StreamingConnector alone, "
            "or next to others under a MultiConnector with joint prefix hits (kvstack's "
            "patched vLLM)")

    def _save_full_pages(self, meta: StreamingMetadata, rid: str, computed: int) -> None:
        """List for the worker the full prompt pages this step completes (stored once each, after
        the forward; pages that came from a tier are not written back)."""
        hashes = self._hashes.get(rid, [])
        full = min(computed, self._prompt_len.get(rid, 0)) // self.cfg.page_tokens
        full = min(full, len(hashes))
        done = self._saved.get(rid, 0)
        if full > done:
            pages = self.pool.pages(rid)
            meta.saves.extend((pages[i], hashes[i]) for i in range(done, full))
            self._saved[rid] = full

    def _step(self, rid: str, start: int, n: int, first: int, anchors: dict[int, int],
              sink: list[int] | None = None) -> ReqStep:
        """The request's step, with the pages its table gained since it was last sent."""
        held = self.pool.pages(rid)
        known = self._sent.get(rid, 0)
        self._sent[rid] = len(held)
        return ReqStep(rid, start, n, first, held[known:], anchors, known_pages=known,
                       sink=sink or [])

    def _anchors(self, rid: str, start: int) -> dict[int, int]:
        bs = self.layout.block_size
        return {g: blocks[start // bs] * bs + start % bs for g, blocks in self._blocks[rid].items()}

    def finish(self, rid: str) -> None:
        if self._sent.pop(rid, None) is not None:
            self._finished.append(rid)  # the worker drops its table at the next step
        self.pool.finish(rid)
        self._reserved.pop(rid, None)
        self._hashes.pop(rid, None)
        self._blocks.pop(rid, None)
        self._prompt_len.pop(rid, None)
        self._failed.pop(rid, None)
        self._fetched.pop(rid, None)
        self._saved.pop(rid, None)
        self._loaded.pop(rid, None)
        self._waiting.pop(rid, None)
        self._written.pop(rid, None)

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True) (`LLM.reset_prefix_cache(reset_connector=
        True)`, `POST /reset_prefix_cache?reset_external=true`): no prefix computed before it is
        reused after it. The host tier drops its cached pages and forgets every hash; the page hashes of
        later requests get a new seed, so the shared tier's objects stored before are not looked
        up either (they stay in the backend for engines that still want them); running requests
        keep their pages but publish none of them."""
        dropped = self.pool.reset_cache()
        self._generation += 1
        for rid in self._hashes:
            self._hashes[rid] = []  # running: computed before the reset, never published now
        self._written.clear()  # nor reused by a resume after preemption
        self._fetched.clear()
        logger.info("kvstack streaming: cache reset: %d cached host-tier page(s) dropped, "
                    "prefix hashes reseeded (generation %d)", dropped, self._generation)
        return True

    def stats(self) -> dict[str, Any]:
        s = self.pool.stats
        return dict(
            capacity_tokens=self.pool.capacity_tokens,
            pages_total=self.pool.num_pages,
            pages_in_use=self.pool.num_used(),
            cached_pages=self.pool.num_cached(),
            max_pages_in_use=self.max_pages_in_use,
            live_requests=len(self._reserved),
            prefix_hit_requests=s.prefix_hit_requests,
            prefix_hit_tokens=s.prefix_hit_tokens,
            allocated_pages=s.allocated_pages,
            freed_pages=s.freed_pages,
            evicted_pages=s.evicted_pages,
            waited_for_space=s.waited_for_space,
            waiting_requests=len(self._waiting),
            wait_timeouts=s.wait_timeouts,
            resumed_reuse_requests=s.resumed_reuse_requests,
            resumed_reuse_tokens=s.resumed_reuse_tokens,
            failed_host_tier_full=s.failed_host_tier_full,
            cache_resets=s.cache_resets,
            reset_dropped_pages=s.reset_dropped_pages,
            **(self.shared.stats if self.shared is not None else {}),
        )
