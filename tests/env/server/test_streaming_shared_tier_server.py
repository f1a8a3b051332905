"""`vllm serve` with the StreamingConnector's shared tier (issue 17), as docs/streaming-usage.md shows it: the
command of test_streaming_server.py with an ``lmcache`` dict in the connector's extra config, its
pages in LMCache's storage through ``lmcache_server`` on loopback.

Server A serves a long prompt and is stopped; server B, a new process that shares only the
``lmcache_server``, serves a prompt that extends it: the tokens of offline `LLM.generate` (no
connector), and B's host tier counts the prefix as a hit (/metrics) though B never computed it.
The speed of a shared-tier hit is measured offline (test_shared_tier.py: Redis, 10x asserted).
"""

from __future__ import annotations

import json

import pytest

import test_streaming_server as st
from kvtest import default_base_only
from vllm_server import LMCACHE_PORT, ROOT, OfflineRun, Server, free_port, lmcache_server, serving

# CI time: runs on the default base; the shared tier itself is tested on both (test_shared_tier.py).
pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.streaming_hooks,
              default_base_only("this base's shared tier: test_shared_tier.py")]

PAGE = 128  # fewer, larger objects: lmcache_server answers each small object after a delayed ACK
KV_TRANSFER = {**st.KV_TRANSFER, "kv_connector_extra_config": {
    **st.KV_TRANSFER["kv_connector_extra_config"], "page_tokens": PAGE,
    "lmcache": {"remote_url": f"lm://127.0.0.1:{LMCACHE_PORT}"}}}
SERVE = [*st.SERVE[:-1], json.dumps(KV_TRANSFER, separators=(",", ":"))]
LMCACHE_SERVER = ["127.0.0.1", LMCACHE_PORT]
PREFIX = st.prompt(1500, 60)
EXTENDED = PREFIX + st.prompt(200, 61)


@pytest.fixture(scope="module")
def expected():
    from kvstack.testbed.tiny_models import make_model

    make_model("llama4", ROOT / st.MODEL)
    run = OfflineRun("llama4-offline-shared", "llama4", st.MODEL, [PREFIX, EXTENDED],
                     max_tokens=st.MAX_TOKENS, max_model_len=st.MAX_LEN, max_num_batched_tokens=128)
    yield run
    run.stop()


def test_a_second_server_extends_a_prefix_the_first_one_stored(expected):
    port = free_port()
    with lmcache_server(port):
        with serving(Server("llama4-shared-a", SERVE, st.ENV, ports={LMCACHE_PORT: port})) as a:
            first = a.complete(PREFIX, st.MAX_TOKENS)
        with serving(Server("llama4-shared-b", SERVE, st.ENV, ports={LMCACHE_PORT: port})) as b:
            before = b.metrics()["vllm:kvstack_prefix_hit_tokens_total"]
            extended = b.complete(EXTENDED, st.MAX_TOKENS)
            hit = b.wait_metrics(lambda m: m["vllm:kvstack_prefix_hit_tokens_total"] > before)
    tokens = expected.result()
    assert first == tokens[0]
    assert extended == tokens[1]
    # every full page of the prefix came from the lmcache_server (B computed none of it)
    assert hit["vllm:kvstack_prefix_hit_tokens_total"] - before == len(PREFIX) // PAGE * PAGE
