"""`vllm serve` with kvstack's StreamingConnector on the tiny Llama-4, on loopback, driven by the
`openai` client and `vllm bench serve`, at a device KV budget smaller than every long prompt.

The budget: 32 blocks of 32 tokens (1024 tokens) shared by the 4 KV cache groups. Native vLLM
would need one block per 32 tokens of the NoPE layer for each request; with the connector that
layer's history is in the host tier and each group needs only room for one 128-token step
(4 x (128/32 + 1) = 20 blocks). The server commands are docs/streaming-usage.md's (test_readme_commands.py).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtest import default_base_only
from vllm_server import ROOT, OfflineRun, Server, bench_serve, serving

pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.streaming_hooks]

MODEL = "build/tiny-models/llama4"
BLOCKS, BLOCK = 32, 32
MAX_LEN = 2048
KV_TRANSFER = {"kv_connector": "StreamingConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "kvstack.streaming",
               "kv_connector_extra_config": {"window_tokens": 256, "host_tier_gib": 0.01}}
ENV = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
SERVE = [MODEL, "--host", "127.0.0.1", "--port", "8000",
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "2048",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching", "--num-gpu-blocks-override", "32",
         "--kv-transfer-config", json.dumps(KV_TRANSFER, separators=(",", ":"))]
# 200 random prompts of 1040-1560 tokens (all beyond the 1024-token device budget), 4 at a time.
BENCH = ["--host", "127.0.0.1", "--port", "8000", "--model", MODEL,
         "--dataset-name", "random", "--random-input-len", "1300", "--random-range-ratio", "0.2",
         "--random-output-len", "4", "--ignore-eos", "--temperature", "0",
         "--num-prompts", "200", "--max-concurrency", "4", "--seed", "0", "--disable-tqdm",
         "--save-result", "--result-dir", "build/server-tests",
         "--result-filename", "llama4-streaming-bench.json"]
PAGE_BYTES = 32 * 2 * 2 * 32 * 2  # page tokens x (K, V) x KV heads x head_dim x bf16, one layer
MAX_TOKENS = 8


def prompt(n: int, salt: int) -> list[int]:
    rng = random.Random(1000 + salt)
    return [rng.randrange(3, 1000) for _ in range(n)]


GREEDY = {f"long{n}": prompt(n, i) for i, n in enumerate([1100, 1500, 1900])}
MIXED = {f"mixed{i}-{n}": prompt(n, 10 + i)
         for i, n in enumerate([40, 1900, 300, 1300, 90, 1100, 700, 1600])}
AFTER_400 = {"after400": prompt(1200, 30)}
REUSE = {"reuse": prompt(1500, 40)}
PROMPTS = {**GREEDY, **MIXED, **AFTER_400, **REUSE}


@pytest.fixture(scope="module")
def reference():
    """Offline `LLM.generate`, same engine arguments, no connector and enough device KV."""
    from kvstack.testbed.tiny_models import make_model

    make_model("llama4", ROOT / MODEL)
    run = OfflineRun("llama4-offline", "llama4", MODEL, list(PROMPTS.values()),
                     max_tokens=MAX_TOKENS, max_model_len=MAX_LEN, max_num_batched_tokens=128)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def server(reference):
    with serving(Server("llama4-streaming", SERVE, ENV)) as s:  # starts while the reference runs
        yield s


@pytest.fixture(scope="module")
def expected(reference, server):
    return dict(zip(PROMPTS, reference.result()))


def test_greedy_completions_equal_offline_generate(server, expected):
    log = server.log.read_text()
    assert f"num_gpu_blocks_override={BLOCKS}" in log
    client = server.client()
    for name, p in GREEDY.items():
        assert len(p) > BLOCKS * BLOCK  # longer than the whole device KV budget
        assert server.complete(p, MAX_TOKENS, client) == expected[name], name


def test_concurrent_requests_equal_one_at_a_time(server, expected):
    client = server.client()
    one_by_one = {name: server.complete(p, MAX_TOKENS, client) for name, p in MIXED.items()}
    with ThreadPoolExecutor(len(MIXED)) as pool:
        futures = {name: pool.submit(server.complete, p, MAX_TOKENS, client)
                   for name, p in MIXED.items()}
        together = {name: f.result() for name, f in futures.items()}
    assert together == one_by_one
    assert one_by_one == {name: expected[name] for name in MIXED}


def test_prompt_over_max_model_len_is_400_and_server_keeps_serving(server, expected):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        server.complete(prompt(MAX_LEN + 10, 50), MAX_TOKENS, client)
    assert err.value.status_code == 400
    assert "maximum context length is 2048" in str(err.value)
    assert server.complete(AFTER_400["after400"], MAX_TOKENS, client) == expected["after400"]


def test_connector_metrics_on_prometheus(server, expected):
    """Host-tier gauges and counters on /metrics: a repeated 1500-token prompt reuses 46 pages
    (1472 tokens) from the host tier; vLLM's external-prefix-cache counter sees the same hit."""
    client = server.client()
    before = server.metrics()
    assert before["vllm:kvstack_host_tier_pages"] == int(0.01 * 2**30) // PAGE_BYTES
    p = REUSE["reuse"]
    assert server.complete(p, MAX_TOKENS, client) == expected["reuse"]
    assert server.complete(p, MAX_TOKENS, client) == expected["reuse"]
    hit = (len(p) - 1) // 32 * 32

    def settled(m):
        return m["vllm:kvstack_prefix_hit_tokens_total"] >= before[
            "vllm:kvstack_prefix_hit_tokens_total"] + hit

    after = server.wait_metrics(settled)
    delta = {k: after[k] - before[k] for k in after if k in before}
    assert delta["vllm:kvstack_prefix_hit_tokens_total"] == hit
    assert delta["vllm:kvstack_prefix_hit_requests_total"] == 1
    assert delta["vllm:external_prefix_cache_hits_total"] == hit
    assert after["vllm:kvstack_host_tier_full_failed_requests_total"] == 0
    assert after["vllm:kvstack_host_tier_pages_in_use"] == 0  # nothing running: nothing held
    assert after["vllm:kvstack_host_tier_requests"] == 0
    assert after["vllm:kvstack_host_tier_pages_cached"] >= len(p) // 32  # kept for reuse


@default_base_only("the 200-request load and leak check of kvstack's connector, the same code on every "
                   "base; this base's server runs every other test of this file")
def test_bench_serve_no_failures_and_flat_memory(server):
    """200 requests, 4 at a time, none failed; the server's resident memory after them is within
    5% of its value after a warm-up of the same size and shape (another seed). A shorter warm-up
    is not enough: the engine process grows for the first ~300 such requests (kernel and
    allocator caches for new shapes: +105, +35, +6 MiB over three rounds of 200), then stays."""
    warm = list(BENCH)
    warm[warm.index("--seed") + 1] = "1"
    warm[warm.index("--result-filename") + 1] = "llama4-streaming-warmup.json"
    w = bench_serve(server, warm)
    assert w["failed"] == 0 and w["completed"] == 200
    rss_warm = server.rss_bytes()
    before = server.metrics()

    r = bench_serve(server, BENCH)
    assert r["failed"] == 0, r
    assert r["completed"] == 200
    assert r["total_input_tokens"] > 200 * BLOCKS * BLOCK  # the prompts do not fit the device
    rss_after = server.rss_bytes()
    print(f"server RSS after warm-up {rss_warm / 2**20:.0f} MiB, after the bench "
          f"{rss_after / 2**20:.0f} MiB")
    assert abs(rss_after - rss_warm) <= 0.05 * rss_warm, (rss_warm, rss_after)

    after = server.wait_metrics(lambda m: m["vllm:kvstack_host_tier_requests"] == 0)
    assert after["vllm:kvstack_host_tier_pages_in_use"] == 0  # no page leaked
    assert after["vllm:kvstack_host_tier_full_failed_requests_total"] == 0
    done = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert done >= 200
