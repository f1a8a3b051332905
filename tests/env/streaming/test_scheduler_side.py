"""The connector's scheduler side without an engine: admission, anchors, preemption, freeing."""

from types import SimpleNamespace

import pytest
import torch

from streaming_helpers import needs_hooks

pytestmark = needs_hooks


def _side(num_pages=8, page=4, prefix_reuse=True, on_full="wait"):
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.connector import _Layout, _SchedulerSide

    cfg = StreamingConfig(page_tokens=page, prefix_reuse=prefix_reuse, on_host_tier_full=on_full)
    layout = _Layout(group=1, block_size=4, layers=("L",), num_kv_heads=1, head_size=8,
                     dtype=torch.bfloat16, num_pages=num_pages, reuse_ok=True)
    vc = SimpleNamespace(model_config=SimpleNamespace(max_model_len=num_pages * page))
    return _SchedulerSide(cfg, layout, vc)


def _meta(s, out):
    """The step's metadata as the worker sees it: page tables rebuilt from the deltas."""
    from kvstack.streaming.layout import PageTables

    m = s.build_meta(out)
    if not hasattr(s, "worker_tables"):
        s.worker_tables = PageTables()
    s.worker_tables.apply(m)
    return m


def _req(rid, n, max_tokens=4, salt=0):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=n, max_tokens=max_tokens,
                           prompt_token_ids=[salt * 100 + i for i in range(n)], num_tokens=n)


def _out(new=(), cached=(), resumed=(), sched=None):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([], b), num_computed_tokens=c)
                            for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else ([], b) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=sched)


def test_admission_anchor_preemption_and_free():
    s = _side()
    a, b = _req("a", 10), _req("b", 16, salt=3)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, 0)  # no external hit; reserves ceil(14/4) = 4 pages
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # needs 5, 4 left: wait
    assert s.pool.stats.waited_for_space == 1
    # step 1: a prefills 8 tokens in blocks [5, 9] of the streaming group
    m = _meta(s, _out(new=[("a", [5, 9, 2], 0)], sched={"a": 8}))
    (r,) = m.reqs
    assert (r.start, r.num_tokens, r.anchor_slot, len(r.pages)) == (0, 8, 5 * 4, 2)
    # step 2: a continues at position 8 -> third block (2), offset 0
    (r,) = _meta(s, _out(cached=[("a", None, 8)], sched={"a": 2})).reqs
    assert r.anchor_slot == 2 * 4 and len(r.pages) == 3
    # preempted after its 10 prompt tokens and one output token: all its blocks are new; it
    # keeps its pages and reuses the first 8 tokens they hold (page-aligned, the last recomputed)
    pages = list(r.pages)
    a.num_tokens = 11
    assert s.get_num_new_matched_tokens(a, 0) == (8, False)
    s.update_state_after_alloc(a, 8)
    (r,) = _meta(s, _out(cached=[("a", [7, 3, 6], 8)], resumed=["a"],
                         sched={"a": 3})).reqs
    assert r.anchor_slot == 6 * 4 and r.pages == pages and r.new_pages == []  # block 8 // 4
    assert s.stats()["resumed_reuse_tokens"] == 8
    s.finish("a")
    st = s.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0
    assert st["cached_pages"] == 2  # two full prompt pages kept for reuse
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)  # b fits now


def test_host_tier_full_fails_the_request_once_with_a_reason():
    s = _side(on_full="fail")
    a, b = _req("a", 10), _req("b", 16, salt=3)
    s.update_state_after_alloc(a, 0)  # a holds 4 of 8 pages
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # not scheduled...
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # (asked again: same answer)
    failed = s.take_failed()  # ...but failed, once, with a reason for the user
    assert list(failed) == ["b"]
    assert "host tier full" in failed["b"] and "20 tokens" in failed["b"]
    assert s.take_failed() == {}
    st = s.stats()
    assert st["failed_host_tier_full"] == 1 and st["waited_for_space"] == 0
    assert st["live_requests"] == 1  # a is untouched
    s.finish("a")
    assert s.get_num_new_matched_tokens(_req("c", 16, salt=4), 0) == (0, False)


def test_unknown_host_tier_full_policy_is_refused():
    from kvstack.streaming.config import StreamingConfig

    assert StreamingConfig.from_extra({}).on_host_tier_full == "fail"
    with pytest.raises(ValueError, match="on_host_tier_full"):
        StreamingConfig.from_extra({"on_host_tier_full": "drop"})


def test_prefix_hit_is_page_aligned_and_leaves_last_token():
    s = _side()
    a = _req("a", 12, salt=1)
    s.update_state_after_alloc(a, 0)
    s.build_meta(_out(new=[("a", [1, 2, 3], 0)], sched={"a": 12}))
    s.finish("a")
    same = _req("c", 12, salt=1)
    assert s.get_num_new_matched_tokens(same, 0) == (8, False)  # 12 - 1 -> 2 full pages
    s.update_state_after_alloc(same, 8)
    assert s.stats()["prefix_hit_tokens"] == 8
    other = _req("d", 12, salt=2)
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)


def test_host_tier_smaller_than_max_model_len_is_refused():
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.connector import _Layout, _SchedulerSide

    layout = _Layout(group=0, block_size=4, layers=("L",), num_kv_heads=1, head_size=8,
                     dtype=torch.bfloat16, num_pages=4, reuse_ok=True)
    vc = SimpleNamespace(model_config=SimpleNamespace(max_model_len=100))
    with pytest.raises(ValueError, match="host tier"):
        _SchedulerSide(StreamingConfig(page_tokens=4), layout, vc)


def test_cached_prefix_is_evicted_from_its_tail():
    from kvstack.streaming.host_tier import PagePool, page_hashes

    pool = PagePool(6, 4)
    hashes = page_hashes(list(range(16)), 4)  # 4 full pages
    pool.start("a", hashes, 0)
    pool.ensure("a", 16)
    pool.register_full_pages("a", hashes, 16)
    pool.finish("a")
    assert pool.match_prefix(hashes) == 4 and pool.num_cached() == 4
    pool.start("b", [], 0)
    pool.ensure("b", 12)  # 2 free pages, then 1 evicted: the prefix's last page
    assert pool.stats.evicted_pages == 1
    assert pool.match_prefix(hashes) == 3  # the head is still reachable
    pool.ensure("b", 20)  # two more evictions, tail first again
    assert pool.match_prefix(hashes) == 1 and pool.num_cached() == 1


@pytest.mark.parametrize("seed", range(20))
def test_admission_never_overcommits_under_random_schedules(seed):
    """Random arrivals (many extending cached prefixes), steps and finishes: every admitted
    request gets its pages when it needs them (ensure never raises), and the tier always has
    room for what running requests reserved. Before cached hits stopped counting as free
    pages too, some seeds raised HostTierFull here."""
    import random

    rnd = random.Random(seed)
    s = _side(num_pages=12, page=4, on_full="fail")
    prefixes = [[1000 * k + i for i in range(rnd.randint(4, 20))] for k in range(3)]
    live: dict[str, list[int]] = {}  # rid -> [computed, total]
    for t in range(200):
        if rnd.random() < 0.5 and len(live) < 4:
            base = rnd.choice(prefixes)
            ids = base + [7 + t * 31 + i for i in range(rnd.randint(0, 12))]
            rid = f"r{t}"
            req = SimpleNamespace(request_id=rid, num_prompt_tokens=len(ids),
                                  max_tokens=rnd.randint(1, 6), prompt_token_ids=ids)
            hit, _ = s.get_num_new_matched_tokens(req, 0)
            if hit is not None:
                s.update_state_after_alloc(req, hit)
                live[rid] = [hit, len(ids) + req.max_tokens - 1]
                s._blocks[rid] = {s.layout.group: list(range(100))}
            s.take_failed()
        sched = {rid: min(rnd.randint(1, 8), tot - done) for rid, (done, tot) in live.items()
                 if tot > done}
        if sched:
            s.build_meta(_out(cached=[(rid, None, live[rid][0]) for rid in sched], sched=sched))
            for rid, n in sched.items():
                live[rid][0] += n
        for rid in [r for r, (done, tot) in live.items() if done >= tot or rnd.random() < 0.05]:
            s.finish(rid)
            del live[rid]
        assert s.pool.num_available() >= s._outstanding()


@pytest.mark.parametrize("what,first,second,shared", [
    ("same everything", {}, {}, True),
    ("cache salt", {"cache_salt": "a"}, {"cache_salt": "b"}, False),
    ("same cache salt", {"cache_salt": "a"}, {"cache_salt": "a"}, True),
    ("LoRA adapter", {"lora_request": SimpleNamespace(lora_name="x", lora_int_id=1)},
     {"lora_request": SimpleNamespace(lora_name="y", lora_int_id=2)}, False),
    ("LoRA vs base", {"lora_request": SimpleNamespace(lora_name="x", lora_int_id=1)}, {}, False),
    ("image", {"mm_features": [SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=2, length=4))]},
     {"mm_features": [SimpleNamespace(identifier="img-2", mm_position=SimpleNamespace(offset=2, length=4))]}, False),
    ("prompt embeddings", {"prompt_embeds": object()}, {"prompt_embeds": object()}, False),
])
def test_prefix_pages_are_keyed_like_vllm_block_hashes(what, first, second, shared):
    """Same token ids are not enough to share pages: LoRA, salt and multimodal inputs count."""
    s = _side()
    a = _req("a", 12, salt=1)
    a.__dict__.update(first)
    s.update_state_after_alloc(a, 0)
    s.build_meta(_out(new=[("a", [1, 2, 3], 0)], sched={"a": 12}))
    s.finish("a")
    b = _req("b", 12, salt=1)
    b.__dict__.update(second)
    assert s.get_num_new_matched_tokens(b, 0) == ((8 if shared else 0), False), what


def test_requests_reserve_part_of_their_output_and_grow_or_fail_alone():
    """decode_reserve_tokens (default 256): a request reserves prompt + min(max_tokens, 256), so
    a second request with a huge max_tokens (a server request without max_tokens) is admitted;
    one that cannot grow when it decodes past its reservation is failed alone, after a step whose
    new K/V go to the sink page."""
    from kvstack.streaming.config import StreamingConfig
    from kvstack.streaming.connector import _Layout, _SchedulerSide

    cfg = StreamingConfig(page_tokens=4, on_host_tier_full="fail", decode_reserve_tokens=8)
    layout = _Layout(group=1, block_size=4, layers=("L",), num_kv_heads=1, head_size=8,
                     dtype=torch.bfloat16, num_pages=8, reuse_ok=True)
    s = _SchedulerSide(cfg, layout, SimpleNamespace(model_config=SimpleNamespace(max_model_len=32)))
    a, b = _req("a", 8, max_tokens=1000, salt=1), _req("b", 4, max_tokens=1000, salt=2)
    for r in (a, b):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # 4 + 3 pages reserved
        s.update_state_after_alloc(r, 0)
    blocks = list(range(100))
    _meta(s, _out(new=[("a", blocks, 0), ("b", blocks, 0)], sched={"a": 8, "b": 4}))
    done = {"a": 8, "b": 4}
    for _ in range(20):  # decode one token each; a grows into the last free page, then b cannot
        m = _meta(s, _out(cached=[("a", None, done["a"]), ("b", None, done["b"])],
                              sched={"a": 1, "b": 1}))
        failed = s.take_failed()
        for r in m.reqs:
            done[r.req_id] += 1
        if failed:
            break
    assert list(failed) == ["b"] and "host tier full while decoding" in failed["b"]
    assert "decode_reserve_tokens" in failed["b"]
    step_b = next(r for r in m.reqs if r.req_id == "b")
    assert step_b.sink == [layout.num_pages]  # a sink page: no page of the table is touched
    assert step_b.pages[-1] == layout.num_pages
    s.finish("b")
    assert s.pool.num_available() >= s._outstanding()
    assert s.stats()["failed_host_tier_full"] == 1


def test_reserve_max_refuses_the_second_long_request_at_admission():
    from kvstack.streaming.config import StreamingConfig

    s = _side(num_pages=8, page=4, on_full="fail")
    s.cfg = StreamingConfig.from_extra({"page_tokens": 4, "on_host_tier_full": "fail",
                                        "decode_reserve_tokens": "max"})
    a, b = _req("a", 8, max_tokens=1000, salt=1), _req("b", 4, max_tokens=1000, salt=2)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, 0)  # reserves the whole tier
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert "prompt + max_tokens" in s.take_failed()["b"]
    with pytest.raises(ValueError, match="decode_reserve_tokens"):
        StreamingConfig.from_extra({"decode_reserve_tokens": "lots"})
    assert StreamingConfig.from_extra({"decode_reserve_tokens": "max"}).decode_reserve_tokens is None


def test_page_tables_reach_the_worker_as_deltas():
    """Each step carries only the pages a request's table gained (O(new pages), not O(context));
    the worker's tables, rebuilt from them, equal the scheduler's; finished requests' tables are
    dropped at the next step; a table out of step is a clear error, never a wrong page."""
    from kvstack.streaming.layout import PageTables, ReqStep, StreamingMetadata

    s = _side(num_pages=16)
    a, b = _req("a", 20), _req("b", 5, salt=2)
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, 0)
    blocks = list(range(100))
    m = _meta(s, _out(new=[("a", blocks, 0), ("b", blocks, 0)], sched={"a": 8, "b": 5}))
    assert [(r.known_pages, len(r.new_pages)) for r in m.reqs] == [(0, 2), (0, 2)]
    done = {"a": 8, "b": 5}
    for _ in range(3):  # a prefills 4 tokens a step (one new page each), b decodes in its page
        m = _meta(s, _out(cached=[("a", None, done["a"]), ("b", None, done["b"])],
                          sched={"a": 4, "b": 1}))
        for r in m.reqs:
            assert r.pages == s.pool.pages(r.req_id)  # the worker's view equals the scheduler's
            done[r.req_id] += {"a": 4, "b": 1}[r.req_id]
        ra, rb = m.reqs
        assert len(ra.new_pages) == 1 and ra.known_pages == len(ra.pages) - 1
        assert rb.new_pages == []
    s.finish("b")
    m = _meta(s, _out(cached=[("a", None, done["a"])], sched={"a": 1}))
    assert m.finished == ["b"] and len(s.worker_tables) == 1
    with pytest.raises(RuntimeError, match="page table of request x is out of step"):
        PageTables().apply(StreamingMetadata(reqs=[ReqStep("x", 8, 1, 0, [3], known_pages=2)]))


def test_wait_is_first_come_first_served():
    """on_host_tier_full="wait": a large request waiting for room keeps its place; small
    requests that came after it and would fit wait behind it (a stream of them never starves
    it), and go in once it is admitted; one that leaves the line (aborted) frees its place."""
    s = _side(num_pages=8, page=4)
    a = _req("a", 10)  # holds 4 pages (10 prompt + 4 reserved tokens)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, 0)
    big, small = _req("big", 16, salt=1), [_req(f"s{i}", 4, salt=2 + i) for i in range(3)]
    assert s.get_num_new_matched_tokens(big, 0) == (None, False)  # needs 5 of 4 free
    for r in small:  # 2 pages each would fit in the 4 free pages, but big waits first
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.stats()["waiting_requests"] == 4
    s.finish("a")
    assert s.get_num_new_matched_tokens(big, 0) == (0, False)  # the head goes in first...
    s.update_state_after_alloc(big, 0)
    # 3 pages left: the first small one fits; it keeps its place (its 2 pages) until vLLM
    # allocates it, so the next one gets only what is left after it
    assert s.get_num_new_matched_tokens(small[0], 0) == (0, False)
    assert s.get_num_new_matched_tokens(small[1], 0) == (None, False)
    # small[0] leaves the line before vLLM allocated it (aborted): the next takes its place
    s.finish("s0")
    assert s.get_num_new_matched_tokens(small[1], 0) == (0, False)
    s.update_state_after_alloc(small[1], 0)
    assert s.stats()["waiting_requests"] == 1


def test_wait_first_come_first_served_control():
    """The same line with the place-keeping removed (a mutation of _needed_ahead_of): the
    small requests overtake the large one, as they did before the line existed."""
    s = _side(num_pages=8, page=4)
    s._needed_ahead_of = lambda rid: 0
    a = _req("a", 10)
    s.update_state_after_alloc(a, 0)
    assert s.get_num_new_matched_tokens(_req("big", 16, salt=1), 0) == (None, False)
    assert s.get_num_new_matched_tokens(_req("s0", 4, salt=2), 0) == (0, False)  # overtakes


def test_wait_timeout_fails_the_waiting_request_alone():
    import time

    from kvstack.streaming.config import StreamingConfig

    s = _side(num_pages=8, page=4)
    s.cfg = StreamingConfig.from_extra({"page_tokens": 4, "on_host_tier_full": "wait",
                                        "wait_timeout_s": 0.05})
    a, big = _req("a", 10), _req("big", 16, salt=1)
    s.update_state_after_alloc(a, 0)
    assert s.get_num_new_matched_tokens(big, 0) == (None, False)
    assert s.take_failed() == {}  # waiting, not failed
    time.sleep(0.06)
    assert s.get_num_new_matched_tokens(big, 0) == (None, False)
    failed = s.take_failed()
    assert list(failed) == ["big"] and "waited" in failed["big"]
    assert "wait_timeout_s=0.05" in failed["big"]
    st = s.stats()
    assert st["wait_timeouts"] == 1 and st["waiting_requests"] == 0 and st["live_requests"] == 1
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="wait_timeout_s"):
            StreamingConfig.from_extra({"on_host_tier_full": "wait", "wait_timeout_s": bad})
    with pytest.raises(ValueError, match="'wait' only"):
        StreamingConfig.from_extra({"on_host_tier_full": "fail", "wait_timeout_s": 5})


@pytest.mark.parametrize("case", ["reuse", "layers on the device", "prompt_logprobs", "reset"])
def test_resumed_request_reuses_its_own_pages(case):
    """After preemption a request's host pages are still its own: its resume is a hit of the
    tokens they hold (whole pages, never its last token), unless the layers outside the host
    tier would need their device KV back, the request must not read a cache, or a cache reset
    came in between (the pages may hold K/V of older weights)."""
    s = _side(num_pages=16)
    if case == "layers on the device":
        s.layout = s.layout.__class__(**{**s.layout.__dict__, "reuse_ok": False})
    a = _req("a", 10)
    s.get_num_new_matched_tokens(a, 0)
    s.update_state_after_alloc(a, 0)
    _meta(s, _out(new=[("a", [1, 2, 3, 4], 0)], sched={"a": 10}))
    _meta(s, _out(cached=[("a", None, 10)], sched={"a": 1}))  # first output token's K/V
    a.num_tokens = 12  # 10 prompt + 2 outputs: 11 tokens' K/V in its pages
    if case == "prompt_logprobs":
        a.skip_reading_prefix_cache = True
    if case == "reset":
        s.reset_cache()
    want = 8 if case == "reuse" else 0
    assert s.get_num_new_matched_tokens(a, 0) == (want, False)
    assert s.get_num_new_matched_tokens(a, 8) == (0, False)  # vLLM's own cache had as much
    s.update_state_after_alloc(a, want)
    st = s.stats()
    assert (st["resumed_reuse_requests"], st["resumed_reuse_tokens"]) == (int(want > 0), want)
