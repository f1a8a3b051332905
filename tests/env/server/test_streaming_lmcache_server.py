"""`vllm serve` with kvstack's StreamingConnector and LMCacheConnectorV1 in one engine through vLLM's
MultiConnector (issue 17), as docs/streaming-usage.md shows it: the tiny llama's layer 1 streams from the host tier,
layer 0 keeps its device KV cache and LMCache's local CPU backend stores it; a prefix hit is joint
(every connector loads the same prefix). Driven by the `openai` client: the tokens of offline
`LLM.generate` without connectors, and the joint hits on /metrics (vLLM's external prefix cache
counters and the host tier's). The negative control (zeroing what LMCache restores) and the cut load
are in tests/env/streaming/test_with_lmcache.py, on both bases.
"""

from __future__ import annotations

import json
import sys

import pytest

from kvtest import default_base_only
from vllm_server import ENGINE_RUN, ROOT, OfflineRun, Server, serving

sys.path.insert(0, str(ENGINE_RUN.parent))
from engine_run import with_streaming_config  # noqa: E402

# CI time: runs on the default base; both bases run the same engine offline (test_with_lmcache.py).
pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.streaming_hooks,
              default_base_only("this base: tests/env/streaming/test_with_lmcache.py")]

MODEL = "build/tiny-models/llama"
KV_TRANSFER = with_streaming_config(r"layers\.1\.", 32)
SERVE = [MODEL, "--host", "127.0.0.1", "--port", "8000",
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "512",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching",
         "--kv-transfer-config", json.dumps(KV_TRANSFER, separators=(",", ":"))]
ENV = {"LMCACHE_CHUNK_SIZE": "64", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}
MAX_TOKENS = 8
A = [3 + (i * 7 + 3) % 1000 for i in range(200)]
B = [11 + (i * 5 + 1) % 997 for i in range(200)]
EXT = A + [5 + (i * 11) % 900 for i in range(60)]
PROMPTS = [A, B, A, EXT]


@pytest.fixture(scope="module")
def reference():
    from kvstack.testbed.tiny_models import make_model

    make_model("llama", ROOT / MODEL)
    run = OfflineRun("llama-offline-with-lmcache", "llama", MODEL, PROMPTS, max_tokens=MAX_TOKENS,
                     max_model_len=512, max_num_batched_tokens=64)
    yield run
    run.stop()


def test_joint_prefix_hits_serve_the_tokens_of_offline_generate(reference):
    with serving(Server("llama-streaming-lmcache", SERVE, ENV)) as server:
        assert "MultiConnector: joint prefix hits" in server.log.read_text()
        client = server.client()
        before = server.metrics()
        tokens = [server.complete(p, MAX_TOKENS, client) for p in PROMPTS]
        # A and B miss; A again and EXT hit A's first 192 tokens (three 64-token chunks) in both
        after = server.wait_metrics(lambda m: m["vllm:kvstack_prefix_hit_tokens_total"]
                                    >= before["vllm:kvstack_prefix_hit_tokens_total"] + 384)
    assert tokens == reference.result()
    for name in ("vllm:kvstack_prefix_hit_tokens_total", "vllm:external_prefix_cache_hits_total"):
        assert after[name] - before[name] == 384, name
