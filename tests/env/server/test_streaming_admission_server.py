"""`vllm serve` with the StreamingConnector: a `prompt_logprobs` request sent while another request
holds most of the host tier, under `on_host_tier_full` "wait" and "fail" (issue 28).

vLLM reads no prefix hit for a request that asks for prompt logprobs (`skip_reading_prefix_cache`),
after the connector has answered. The connector counted the pages such a request shares with a
running one as a hit, so it admitted it into a tier that could not hold it, and the engine core died
(HostTierFull in the scheduler; measured before the fix, in-process: the exception; here, as users
run it, with the engine core in its own process). Now the connector admits such a request as the
request it will be (no hit), vLLM 0.32 keeps a connector's "not yet" for it (vLLM 0008), and a
request that still meets a full tier fails alone after its step.

Request B (640 tokens, 300 new) runs first and reserves 28 of the tier's 32 pages (prompt + 256
tokens of decode) from its admission on; 0.3 s after B's response started, request C (B's prompt +
40 tokens, prompt_logprobs=1) arrives. Its 680 + 8 tokens need 22 pages with no hit (2 beyond the 20 it shares with B, which is
what the connector used to count). Under "wait" C waits for B, then completes with the tokens of an offline run
without any connector and a logprob for every prompt token; under "fail" C fails alone with the
reason. Under "wait" with `wait_timeout_s: 0.2`, C waits and, B still running then, fails
alone with the reason (counted in vllm:kvstack_host_tier_wait_timeouts_total). Either way B
completes exact and the server serves the next request.
"""

from __future__ import annotations

import json
import random
import re
import threading

import pytest

from kvtest import default_base_only
from vllm_server import ROOT, OfflineRun, Server, serving

# CI time: runs on the default base; both bases run the admission case offline
# (tests/env/streaming/test_host_tier_full.py) and the reset (tests/env/streaming/test_reset_cache.py)
# Not serial: C must reach the engine while B runs, which a busier core only makes likelier (B's
# 300 tokens take longer); passed on one core of a parallel-pass worker, the other core busy
pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.streaming_hooks,
              default_base_only("this base: test_host_tier_full.py, test_reset_cache.py")]

MODEL = "build/tiny-models/llama4"
PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # page tokens x (K, V) x KV heads x head_dim x bf16, one layer
ENV = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}


def serve_args(policy: str) -> list[str]:
    """`policy`: "wait", "fail", or "timeout" ("wait" with wait_timeout_s 1)."""
    extra = {"window_tokens": 48, "page_tokens": 32, "host_tier_gib": 32 * PAGE_BYTES / 2**30,
             "on_host_tier_full": "wait" if policy == "timeout" else policy}
    if policy == "timeout":
        extra["wait_timeout_s"] = WAIT_TIMEOUT_S
    kv = {"kv_connector": "StreamingConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "kvstack.streaming", "kv_connector_extra_config": extra}
    return [MODEL, "--host", "127.0.0.1", "--port", "8000", "--dtype", "bfloat16",
            "--block-size", "32", "--max-model-len", "1024", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--num-gpu-blocks-override", "40",
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]


def prompt(n: int, salt: int) -> list[int]:
    rng = random.Random(2000 + salt)
    return [rng.randrange(3, 1000) for _ in range(n)]


B = prompt(640, 1)
C = B + prompt(40, 2)
AFTER = prompt(100, 3)
B_TOKENS, C_TOKENS = 300, 8  # B decodes for seconds: C surely arrives while B runs
# "timeout": well below the time B still runs after C arrives (on a fast machine B's 300 tokens take
# about a second; with a 1 s timeout, C could wait, then run normally once B finished)
WAIT_TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def reference():
    from kvstack.testbed.tiny_models import make_model

    make_model("llama4", ROOT / MODEL)
    run = OfflineRun("llama4-admission-offline", "llama4", MODEL, [B, C, AFTER],
                     max_tokens=B_TOKENS, max_model_len=1024, max_num_batched_tokens=64)
    yield run
    run.stop()


def _b_then_c(server: Server) -> tuple[dict, object]:
    """B streamed; C sent 0.3 s after B's response has started (B is in the engine then and
    holds its pages from admission on: the connector reserves them there; B runs for seconds).
    Not at B's first streamed token: on a loaded machine the API server can hand that over
    after B has finished."""
    client = server.client()
    got: dict = {}

    def send_c():
        try:
            got["c"] = client.completions.create(
                model=server.model, prompt=C, max_tokens=C_TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "prompt_logprobs": 1})
        except Exception as e:  # noqa: BLE001 - the test looks at what the client got
            got["c_error"] = e

    b_tokens: list[int] = []
    stream = client.completions.create(model=server.model, prompt=B, max_tokens=B_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    t = threading.Timer(0.3, send_c)
    t.start()
    finish = None
    for chunk in stream:
        ch = chunk.choices[0]
        b_tokens += list(getattr(ch, "token_ids", None) or [])
        finish = ch.finish_reason or finish
    t.join(timeout=300)
    return {"b": b_tokens, "b_finish": finish, **got}, client


@pytest.mark.parametrize("policy", ["wait", "fail", "timeout"])
def test_prompt_logprobs_request_under_a_full_tier(policy, reference):
    expected = reference.result()
    # Should C still reach the engine after B has finished (a very loaded machine), it met no
    # contention (it neither waited nor failed) and says nothing: a new server runs the pair
    # again (up to 3 times; a new one, as B's cached pages would make a repeat of B faster)
    for attempt in range(3):
        with serving(Server(f"llama4-admission-{policy}", serve_args(policy), ENV)) as server:
            out, client = _b_then_c(server)
            assert out["b"] == expected[0] and out["b_finish"] == "length", server.tail()
            c = out.get("c")
            if policy == "wait":
                waits = "vllm:kvstack_host_tier_waits_total"
                met = server.wait_metrics(lambda m: m.get(waits, 0) > 0, timeout_s=20).get(waits, 0)
            else:
                met = c is None or c.choices[0].finish_reason not in ("length", "stop")
            if not met:
                print(f"attempt {attempt + 1}: C met no contention (it reached the engine after B "
                      "finished, or B finished within the wait timeout); again")
                continue
            _check_contended(policy, server, client, out, expected)
            return
    pytest.fail("C never met B holding the tier (3 servers)")


def _check_contended(policy, server, client, out, expected):
    if policy == "wait":
        c = out.get("c")
        assert c is not None, f"{out.get('c_error')!r}\n{server.tail()}"
        choice = c.choices[0]
        assert choice.finish_reason == "length"
        assert list(choice.token_ids) == expected[1][:C_TOKENS]
        plp = choice.prompt_logprobs
        assert len(plp) == len(C) and plp[0] is None and all(plp[1:])
    else:
        c, err = out.get("c"), out.get("c_error")
        if c is not None:  # finished with an error as its finish reason
            assert c.choices[0].finish_reason not in ("length", "stop"), c
        else:
            assert err is not None
        log = server.log.read_text(errors="replace")
        assert "host tier full" in log
        if policy == "timeout":
            assert f"wait_timeout_s={WAIT_TIMEOUT_S:g}" in log, server.tail()
    m = server.wait_metrics(lambda m: m.get("vllm:kvstack_host_tier_requests", 1) == 0)
    if policy == "wait":  # C waited for room, then ran; nothing failed
        assert m["vllm:kvstack_host_tier_waits_total"] >= 1, m
        assert m["vllm:kvstack_host_tier_full_failed_requests_total"] == 0, m
    else:  # C alone failed, at admission (at once, or after waiting 0.2 s)
        assert m["vllm:kvstack_host_tier_full_failed_requests_total"] == 1, m
        timeouts = m.get("vllm:kvstack_host_tier_wait_timeouts_total", 0)
        assert timeouts == (1 if policy == "timeout" else 0), m
    # the engine serves on
    assert server.complete(AFTER, max_tokens=8, client=client) == expected[2][:8]
    text = server.log.read_text(errors="replace")
    assert "EngineDeadError" not in text and "HostTierFull" not in text, server.tail()


def test_reset_prefix_cache_through_the_server(reference):
    """`POST /reset_prefix_cache?reset_external=true` (vLLM's development endpoints,
    VLLM_SERVER_DEV_MODE=1, as an RL trainer or operator calls it): the StreamingConnector drops
    its cached pages; the next request with the same prefix hits nothing from before and gives
    the offline tokens; the one after hits the pages computed since."""
    import urllib.request

    expected = reference.result()
    env = {**ENV, "VLLM_SERVER_DEV_MODE": "1"}
    with serving(Server("llama4-reset", serve_args("wait"), env)) as server:
        client = server.client()
        assert server.complete(AFTER, max_tokens=8, client=client) == expected[2][:8]
        m = server.wait_metrics(lambda m: m.get("vllm:kvstack_host_tier_pages_cached", 0) > 0)
        cached = m["vllm:kvstack_host_tier_pages_cached"]
        hits = m["vllm:kvstack_prefix_hit_tokens_total"]
        req = urllib.request.Request(server.url + "/reset_prefix_cache?reset_external=true",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        # the reset counts show with the next step's stats
        assert server.complete(AFTER, max_tokens=8, client=client) == expected[2][:8]
        m = server.wait_metrics(lambda m: m.get("vllm:kvstack_cache_resets_total", 0) >= 1)
        assert m["vllm:kvstack_cache_resets_total"] == 1, m
        assert m["vllm:kvstack_cache_reset_dropped_pages_total"] == cached, m
        assert m["vllm:kvstack_prefix_hit_tokens_total"] == hits, m  # nothing from before
        # the connector's INFO line in the server's log, in vLLM's format (kvstack/streaming/log.py)
        assert re.search(r"INFO \d\d-\d\d [\d:]+ \[scheduler_side\.py:\d+\] kvstack streaming: "
                         rf"cache reset: {int(cached)} cached host-tier page\(s\) dropped",
                         server.log.read_text(errors="replace")), server.tail()
        assert server.complete(AFTER, max_tokens=8, client=client) == expected[2][:8]
        m = server.wait_metrics(lambda m: m["vllm:kvstack_prefix_hit_tokens_total"] > hits)
        assert m["vllm:kvstack_prefix_hit_tokens_total"] > hits, m
