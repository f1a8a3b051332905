"""Abort in the middle of a chunked prefill, and vLLM preempting running streaming requests, end
to end on the CPU engine with the sharp tiny Llama-4 (see test_exactness_sharp.py: on it a wrong
or missing page of history changes the result). After either, the host tier must be free
(no page held, no live request) and every request must get the native result.

Device budget: 16 blocks of 32 tokens shared by the four one-layer groups; each request may hold
up to 12 (3 per group: vLLM's admission cap for chunk 32 / window 1 with 64 batched tokens).
`long_prefill_token_threshold=56` leaves 8 tokens of each step's budget to short requests, so a
short request is admitted and decodes while the long one is still prefilling; when the long
prompt's next chunk spans three blocks per group, vLLM preempts the short one (the last running
request), which then recomputes its prompt and output into the host pages it kept.
"""

import pytest

from streaming_helpers import (close, greedy, greedy_logprobs, logprob_gap, make_llm_from,
                               needs_hooks, prompt, scheduler_connector, sharp_llama4)

pytestmark = needs_hooks

TOL = 0.03  # top-5 logprobs, absolute (see test_exactness_sharp.py)
N_NEW = 16
PAGE = 32
PAGE_BYTES = PAGE * 2 * 2 * 32 * 2  # page_tokens x (K,V) x kv_heads x head_dim x bf16, 1 layer
MAX_LEN = 1536
STREAMING = dict(window_tokens=48, page_tokens=PAGE, host_tier_gib=96 * PAGE_BYTES / 2**30,
                 on_host_tier_full="wait")
BUDGET = dict(num_gpu_blocks_override=16, max_num_batched_tokens=64,
              long_prefill_token_threshold=56, max_num_seqs=4, max_model_len=MAX_LEN)


def ids(p):
    return list(p["prompt_token_ids"])


def P(tokens):
    return {"prompt_token_ids": list(tokens)}


ABORTED = ids(prompt(960, 6))  # aborted after a few 56-token chunks
AFTER = {"same": ABORTED, "extends": ABORTED[:500] + ids(prompt(100, 7)),
         "other": ids(prompt(300, 8))}
PREEMPT = {"long": ids(prompt(700, 21)), "short1": ids(prompt(8, 22)),
           "short2": ids(prompt(12, 23)), "mid": ids(prompt(40, 24))}
# the same shapes, other tokens (a cached long prompt would be a prefix hit: no preemption)
PREEMPT_ABORT = {"long": ids(prompt(700, 31)), "short1": ids(prompt(8, 32)),
                 "short2": ids(prompt(12, 33)), "mid": ids(prompt(40, 34))}
# a long prompt preempted mid-prefill after a few 32-token pages (and local chunks): its resume
# reuses them; the control's prompts have other tokens (the first run's would be prefix hits)
PREEMPT_REUSE = {f"{run}-{name}": ids(prompt(n, salt + k))
                 for run, salt in (("reuse", 41), ("control", 51))
                 for k, (name, n) in enumerate((("short", 40), ("long", 700)))}


@pytest.fixture(scope="module")
def model():
    return sharp_llama4()


@pytest.fixture(scope="module")
def native(model):
    llm = make_llm_from(model, max_model_len=MAX_LEN)
    try:
        prompts = {**AFTER, **PREEMPT, **{f"pa-{n}": p for n, p in PREEMPT_ABORT.items()},
                   **PREEMPT_REUSE}
        outs = greedy_logprobs(llm, [P(p) for p in prompts.values()], N_NEW)
        return dict(zip(prompts, outs))
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(model, native):
    llm = make_llm_from(model, streaming=STREAMING, **BUDGET)
    yield llm
    close(llm)


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def assert_native(got: dict, native: dict):
    for name, res in got.items():
        gap = logprob_gap(res, native[name])
        print(f"{name}: streaming vs native {gap:.4f}")
        assert res[0] == native[name][0], name
        assert gap <= TOL, name


def test_abort_mid_prefill_frees_the_host_tier(streaming, native):
    """A 960-token prompt aborted (LLMEngine.abort_request) after 4 chunked-prefill steps: no
    page held, no live request; its fully computed pages stay cached; later requests -- the same
    prompt, one sharing its first 500 tokens, an unrelated one -- hit those pages and get the
    native tokens and top-5 logprobs."""
    eng = streaming.llm_engine
    conn = scheduler_connector(streaming)
    before = conn.stats()
    eng.add_request("aborted", P(ABORTED), greedy(N_NEW))
    for _ in range(4):
        eng.step()
    (req,) = scheduler(streaming).running
    computed = req.num_computed_tokens
    assert 0 < computed < len(ABORTED) - 64 and req.num_output_tokens == 0  # mid-prefill
    st = conn.stats()
    assert st["live_requests"] == 1 and st["pages_in_use"] >= computed // PAGE
    print(f"aborted after {computed} of {len(ABORTED)} prompt tokens")
    eng.abort_request(["aborted"])  # the public API
    for _ in range(3):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    st = conn.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0, st
    # the fully computed prompt pages stay cached for reuse, the rest is freed
    assert st["cached_pages"] - before["cached_pages"] == computed // PAGE
    assert st["allocated_pages"] == st["freed_pages"] + st["cached_pages"] + st["evicted_pages"]

    # later requests: the same prompt and one extending its first 500 tokens reuse the pages the
    # aborted request wrote; all get the native result
    hits = st["prefix_hit_tokens"]
    got = dict(zip(AFTER, greedy_logprobs(streaming, [P(p) for p in AFTER.values()], N_NEW)))
    assert conn.stats()["prefix_hit_tokens"] - hits >= 2 * (computed // PAGE * PAGE)
    assert_native(got, native)
    st = conn.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0


def test_preempted_streaming_requests_get_native_tokens(streaming, native, monkeypatch):
    """vLLM preempts a short streaming request while it decodes (device blocks run out when the
    700-token prompt's chunk spans three blocks per group); it resumes by recomputing into the
    host pages it kept. Every request gets the native result; the host tier is free after."""
    conn = scheduler_connector(streaming)
    sched = scheduler(streaming)
    preempted = []
    real = sched._preempt_request

    def spy(request, timestamp, *args, **kwargs):  # observe only: vLLM's own preemption
        preempted.append(dict(req=request.request_id, computed=request.num_computed_tokens,
                              outputs=request.num_output_tokens,
                              host_pages_in_use=conn.stats()["pages_in_use"]))
        return real(request, timestamp, *args, **kwargs)  # (0.32 adds drop_stale_output=)

    monkeypatch.setattr(sched, "_preempt_request", spy)
    got = dict(zip(PREEMPT, greedy_logprobs(streaming, [P(p) for p in PREEMPT.values()], N_NEW)))
    print("preemptions:", preempted)
    assert preempted, "no preemption: the configuration no longer forces one"
    # a request preempted while decoding, its prompt and output K/V in host pages it keeps
    assert any(p["outputs"] > 0 and p["host_pages_in_use"] > 0 for p in preempted)
    assert_native(got, native)
    st = conn.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0, st


def test_abort_while_preempted_frees_the_host_tier(streaming, native, monkeypatch):
    """A request aborted while it waits, preempted (its host pages still held for its resume):
    its pages are freed; the others get the native result."""
    eng = streaming.llm_engine
    conn = scheduler_connector(streaming)
    sched = scheduler(streaming)
    preempted = []
    real = sched._preempt_request

    def spy(request, timestamp, *args, **kwargs):
        preempted.append(request.request_id)
        return real(request, timestamp, *args, **kwargs)

    monkeypatch.setattr(sched, "_preempt_request", spy)
    names = list(PREEMPT_ABORT)
    for name in names:
        eng.add_request(f"abort-preempted-{name}", P(PREEMPT_ABORT[name]), greedy(N_NEW))
    victim, outs = None, {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if victim is None and preempted:
            (req,) = [r for r in sched.waiting if r.request_id == preempted[0]]
            assert req.status.name == "PREEMPTED" and req.num_output_tokens > 0
            victim = req.request_id.rsplit("-", 1)[0]  # the id it was added with
            held = conn.stats()  # the victim still holds its pages (and its reservation)
            eng.abort_request([victim])
            st = conn.stats()
            assert st["live_requests"] == held["live_requests"] - 1
            assert st["pages_in_use"] < held["pages_in_use"]
    assert victim is not None, "no preemption: the configuration no longer forces one"
    assert not eng.has_unfinished_requests()
    st = conn.stats()
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0, st
    for name in names:
        rid = f"abort-preempted-{name}"
        if rid == victim:
            continue
        out = outs[rid].outputs[0]
        assert list(out.token_ids) == native[f"pa-{name}"][0], name


@pytest.mark.parametrize("run", ["reuse", "control"])
def test_resumed_request_reuses_its_host_pages(streaming, native, monkeypatch, run):
    """A request vLLM preempts mid-prefill keeps its host pages; on its resume they are a hit
    (whole pages and local chunks), counted in resumed_reuse_tokens, and every request gets the
    native result. The preemption is vLLM's own, through its public API
    (`LLM.reset_prefix_cache(reset_running_requests=True)`, which preempts every running request;
    the connector's cache is not reset, so its pages stay valid): on this engine a tight device
    budget preempts only requests shorter than a page (test above), since every group of the
    sharp Llama-4 keeps at most a chunk or a window of blocks per request. Control: the reused
    pages zeroed at the preemption change the long request's result (so the hit is real: a
    recompute would have rewritten them)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    eng = streaming.llm_engine
    conn = scheduler_connector(streaming)
    sched = scheduler(streaming)
    store = get_kv_transfer_group()._worker.store  # the worker side, in this process
    preempted = []
    real = sched._preempt_request

    def spy(request, timestamp, *args, **kwargs):
        computed = request.num_computed_tokens
        preempted.append(dict(req=request.request_id, computed=computed))
        if run == "control":
            for page in conn._sched.pool.pages(request.request_id)[:computed // PAGE]:
                for kv in store.kv.values():
                    kv[page].zero_()
        return real(request, timestamp, *args, **kwargs)

    monkeypatch.setattr(sched, "_preempt_request", spy)
    before = conn.stats()
    sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=5)
    for name in ("short", "long"):
        eng.add_request(f"{run}-{name}", P(PREEMPT_REUSE[f"{run}-{name}"]), sp)
    outs = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        long = [r for r in sched.running if r.request_id.startswith(f"{run}-long")]
        if not preempted and long and long[0].num_computed_tokens > 3 * PAGE:
            streaming.reset_prefix_cache(reset_running_requests=True)
    assert not eng.has_unfinished_requests()
    print("preemptions:", preempted)
    st = conn.stats()
    reused = st["resumed_reuse_tokens"] - before["resumed_reuse_tokens"]
    print(f"{run}: resumed requests reused {reused} tokens of their own host pages")
    assert [p["req"].startswith(f"{run}-long") for p in preempted] == [True], preempted
    assert reused == preempted[0]["computed"] // PAGE * PAGE > 2 * PAGE
    assert st["resumed_reuse_requests"] == before["resumed_reuse_requests"] + 1
    assert st["pages_in_use"] == 0 and st["live_requests"] == 0, st
    got = {f"{run}-{name}": (list(o.token_ids),
                             [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs])
           for name, o in ((n, outs[f"{run}-{n}"]) for n in ("long", "short"))}
    if run == "reuse":
        assert_native(got, native)
    else:
        assert got[f"{run}-short"][0] == native[f"{run}-short"][0]
        res, ref = got[f"{run}-long"], native[f"{run}-long"]
        print(f"control: long vs native {logprob_gap(res, ref):.4f}")
        assert logprob_gap(res, ref) > TOL, "zeroed reused pages changed nothing"
