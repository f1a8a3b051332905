"""`vllm serve` with LMCacheConnectorV1 on the tiny Qwen3-Next (hybrid: 3 gated delta-net layers +
1 full attention), on loopback, driven by the `openai` client and `vllm bench serve`. Two LMCache
backends, one server each (the commands of docs/hybrid-lmcache-usage.md, test_readme_commands.py):

- ``local-cpu``: LMCache's local CPU backend (LMCACHE_LOCAL_CPU=True);
- ``remote``: no local tier, chunks go to an `lmcache_server` on 127.0.0.1 (LMCACHE_REMOTE_URL).

LMCache hits are visible on /metrics through vLLM's own counters: the scheduler records every
connector's ``get_num_new_matched_tokens`` result as ``vllm:external_prefix_cache_hits`` (tokens)
out of ``vllm:external_prefix_cache_queries``; no LMCache-specific metric is needed for that.

The random tiny Qwen3-Next forgets its recurrent state within a token: a wrong restored state would
not change its tokens, so its servers make no claim about a restore's tokens (their repeat test
checks the hit on /metrics; their other prompts share no prefix and restore nothing). The tokens of a
restore are checked on two more servers, one per backend, of the same model with a long-memory GDN
state (kvstack.testbed.long_memory), 32-token steps like the offline reference (one chunk per step:
bf16 near-ties of that model could flip a token across different step partitions): the repeat
restores the state at 96 with the reference's tokens; the negative control, on the same server,
zeroes every restored state while a flag file exists (tests/env/lmcache/fault_site/sitecustomize.py,
KVSTACK_ZERO_RESTORED_STATE): its repeat hits as much and gives other tokens, and once the flag is
gone the next repeat is exact again.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtest import default_base_only
from vllm_server import (
    LMCACHE_PORT,
    ROOT,
    OfflineRun,
    Server,
    bench_serve,
    free_port,
    lmcache_server,
    serving,
    with_fault_site,
)

pytestmark = [pytest.mark.env, pytest.mark.slow]

MODEL = "build/tiny-models/qwen3next"
LONG_MODEL = "build/tiny-models/qwen3next-long-memory"
MAX_LEN = 512
KV_TRANSFER = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
SERVE = [MODEL, "--host", "127.0.0.1", "--port", "8000",
         "--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--max-model-len", "512",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching",
         "--kv-transfer-config", json.dumps(KV_TRANSFER, separators=(",", ":"))]
ENV = {
    "local-cpu": {"LMCACHE_CHUNK_SIZE": "32", "LMCACHE_LOCAL_CPU": "True",
                  "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"},
    # LMCache still allocates its CPU buffer (default 5 GB) as the staging area: keep it at 1.
    "remote": {"LMCACHE_CHUNK_SIZE": "32", "LMCACHE_LOCAL_CPU": "False",
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{LMCACHE_PORT}",
               "LMCACHE_REMOTE_SERDE": "naive"},
}
LMCACHE_SERVER = ["lmcache_server", "127.0.0.1", LMCACHE_PORT]
# the long-memory servers: same arguments, the long-memory model, one 32-token chunk per step
LONG_SERVE = [LONG_MODEL if a == MODEL else "32" if i and SERVE[i - 1] == "--max-num-batched-tokens"
              else a for i, a in enumerate(SERVE)]
ENV["long-local-cpu"] = ENV["local-cpu"]
ENV["long-remote"] = ENV["remote"]
# 200 random prompts of 210-390 tokens, 4 at a time.
BENCH = ["--host", "127.0.0.1", "--port", "8000", "--model", MODEL,
         "--dataset-name", "random", "--random-input-len", "300", "--random-range-ratio", "0.3",
         "--random-output-len", "4", "--ignore-eos", "--temperature", "0",
         "--num-prompts", "200", "--max-concurrency", "4", "--seed", "0", "--disable-tqdm",
         "--save-result", "--result-dir", "build/server-tests",
         "--result-filename", "qwen3next-lmcache-bench.json"]
MAX_TOKENS = 8
CHUNK = 32


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 101) % 900 + 3 for i in range(n)]


GREEDY = {f"p{n}": prompt(n, i) for i, n in enumerate([100, 37, 260, 300])}
MIXED = {f"mixed{i}-{n}": prompt(n, 10 + i)
         for i, n in enumerate([100, 480, 33, 200, 64, 350, 7, 150])}
# the same lengths, other prompts: sent together they restore nothing (the one-by-one run stored MIXED)
TOGETHER = {f"together{i}-{n}": prompt(n, 60 + i)
            for i, n in enumerate([100, 480, 33, 200, 64, 350, 7, 150])}
AFTER_400 = {"after400": prompt(120, 30)}
# A fresh prompt per backend: its first request is a miss, its repeat an LMCache hit.
REPEAT = {"repeat-local-cpu": prompt(100, 40), "repeat-remote": prompt(100, 41)}
PROMPTS = {**GREEDY, **MIXED, **TOGETHER, **AFTER_400, **REPEAT}
LONG_PROMPTS = {"repeat-long-local-cpu": prompt(100, 42), "zeroed-long-local-cpu": prompt(100, 43),
                "repeat-long-remote": prompt(100, 44), "zeroed-long-remote": prompt(100, 45)}


@pytest.fixture(scope="module")
def reference():
    """Offline `LLM.generate`, same engine arguments, no KV connector."""
    from kvstack.testbed.tiny_models import make_model

    make_model("qwen3next", ROOT / MODEL)
    run = OfflineRun("qwen3next-offline", "qwen3next", MODEL, list(PROMPTS.values()),
                     max_tokens=MAX_TOKENS, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def long_reference():
    """The same for the long-memory model, 32-token steps."""
    from kvstack.testbed.long_memory import long_memory_qwen3next
    from kvstack.testbed.tiny_models import make_model

    long_memory_qwen3next(make_model("qwen3next", ROOT / MODEL), ROOT / LONG_MODEL)
    run = OfflineRun("qwen3next-long-offline", "qwen3next", LONG_MODEL, list(LONG_PROMPTS.values()),
                     max_tokens=MAX_TOKENS, max_model_len=MAX_LEN, max_num_batched_tokens=CHUNK)
    yield dict(zip(LONG_PROMPTS, run.result()))
    run.stop()


@pytest.fixture(scope="module")
def long_server(request, long_reference, tmp_path_factory):
    """A long-memory server; its restored states are zeroed while long_server.zero_flag exists."""
    backend = request.param
    flag = tmp_path_factory.mktemp("zero") / "zero.flag"
    with contextlib.ExitStack() as stack:
        ports = {}
        if backend == "long-remote":
            ports = {LMCACHE_PORT: free_port()}
            stack.enter_context(lmcache_server(ports[LMCACHE_PORT]))
        s = with_fault_site(Server(f"qwen3next-lmcache-{backend}", LONG_SERVE, ENV[backend], ports=ports),
                            str(flag))
        stack.enter_context(serving(s))
        s.backend, s.zero_flag = backend, flag
        yield s


BOTH = pytest.mark.parametrize("server", ["local-cpu", "remote"], indirect=True)
LONG_BOTH = pytest.mark.parametrize("long_server", ["long-local-cpu", "long-remote"], indirect=True)


@pytest.fixture(scope="module")
def server(request, reference):
    backend = request.param
    if backend == "remote":
        port = free_port()
        with lmcache_server(port):
            with serving(Server(f"qwen3next-lmcache-{backend}", SERVE, ENV[backend],
                                ports={LMCACHE_PORT: port})) as s:
                s.backend = backend
                yield s
    else:
        with serving(Server(f"qwen3next-lmcache-{backend}", SERVE, ENV[backend])) as s:
            s.backend = backend
            yield s


@pytest.fixture(scope="module")
def expected(reference):
    return dict(zip(PROMPTS, reference.result()))


def _hits(server) -> float:
    return server.metrics()["vllm:external_prefix_cache_hits_total"]


@BOTH
def test_greedy_completions_equal_offline_generate(server, expected):
    client = server.client()
    before = _hits(server)
    for name, p in GREEDY.items():
        assert server.complete(p, MAX_TOKENS, client) == expected[name], name
    assert _hits(server) == before  # computed, nothing restored (a restore's tokens: LONG_BOTH)


@BOTH
def test_repeat_is_an_lmcache_hit_on_metrics(server, expected):
    """100-token prompt, 64-token steps, 32-token chunks: the repeat restores K/V and the hybrid
    state at 96 tokens (the second prefill step, 64 -> 100, is cut at the chunk boundary 96 where
    the state is saved: vLLM 0010 / LMCache 0018) and recomputes the rest; vLLM's own counters on
    /metrics show the hit. The repeat's tokens are the long-memory servers' check (below): this
    model's would not change with a wrong state."""
    name = f"repeat-{server.backend}"
    p = REPEAT[name]
    client = server.client()
    before = server.metrics()
    assert server.complete(p, MAX_TOKENS, client) == expected[name]  # a miss: computed
    time.sleep(1.0)  # LMCache stores asynchronously (the remote backend over the network)
    server.complete(p, MAX_TOKENS, client)
    after = server.wait_metrics(lambda m: m["vllm:external_prefix_cache_hits_total"]
                                > before["vllm:external_prefix_cache_hits_total"])
    assert after["vllm:external_prefix_cache_hits_total"] - before[
        "vllm:external_prefix_cache_hits_total"] == 96
    assert after["vllm:external_prefix_cache_queries_total"] - before[
        "vllm:external_prefix_cache_queries_total"] == 2 * len(p)
    assert "restored hybrid state at 96" in server.log.read_text()


def _repeat(server, p):
    """(first tokens, repeat tokens, LMCache hit tokens of the two)."""
    client = server.client()
    before = server.metrics()
    first = server.complete(p, MAX_TOKENS, client)
    time.sleep(1.0)  # LMCache stores asynchronously
    again = server.complete(p, MAX_TOKENS, client)
    after = server.wait_metrics(lambda m: m["vllm:external_prefix_cache_hits_total"]
                                > before["vllm:external_prefix_cache_hits_total"])
    return first, again, after["vllm:external_prefix_cache_hits_total"] - before[
        "vllm:external_prefix_cache_hits_total"]


@LONG_BOTH
def test_long_memory_repeat_restores_the_state_exactly(long_server, long_reference):
    """The model whose tokens depend on its state: the repeat restores the state at 96 and gives
    the offline reference's tokens."""
    first, again, hit = _repeat(long_server, LONG_PROMPTS[f"repeat-{long_server.backend}"])
    assert first == again == long_reference[f"repeat-{long_server.backend}"]
    assert hit == 96
    assert "restored hybrid state at 96" in long_server.log.read_text()


@LONG_BOTH
def test_negative_control_zeroed_state_changes_the_repeat(long_server, long_reference):
    """The check above can fail: with every restored state zeroed (the flag file on, same server)
    the repeat still hits 96 tokens and restores its state there, and its tokens differ from the
    reference (the first request, which restores nothing, equals it); with the flag gone the next
    repeat is exact again."""
    name = f"zeroed-{long_server.backend}"
    long_server.zero_flag.write_text("on")
    try:
        first, again, hit = _repeat(long_server, LONG_PROMPTS[name])
    finally:
        long_server.zero_flag.unlink()
    assert first == long_reference[name]
    assert hit == 96
    assert "zeroed pid=" in long_server.log.read_text()
    assert again != long_reference[name], "a zeroed state must change the tokens"
    assert long_server.complete(LONG_PROMPTS[name], MAX_TOKENS) == long_reference[name]


@BOTH
def test_concurrent_requests_equal_one_at_a_time(server, expected):
    """Eight prompts one at a time, then eight others of the same lengths at once: each gives the
    offline reference's tokens, and none restores anything (a restore's tokens: LONG_BOTH)."""
    client = server.client()
    before = _hits(server)
    one_by_one = {name: server.complete(p, MAX_TOKENS, client) for name, p in MIXED.items()}
    with ThreadPoolExecutor(len(TOGETHER)) as pool:
        futures = {name: pool.submit(server.complete, p, MAX_TOKENS, client)
                   for name, p in TOGETHER.items()}
        together = {name: f.result() for name, f in futures.items()}
    assert one_by_one == {name: expected[name] for name in MIXED}
    assert together == {name: expected[name] for name in TOGETHER}
    assert _hits(server) == before


@BOTH
def test_prompt_over_max_model_len_is_400_and_server_keeps_serving(server, expected):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        server.complete(prompt(MAX_LEN + 1, 50), MAX_TOKENS, client)
    assert err.value.status_code == 400
    assert "maximum context length is 512" in str(err.value)
    assert server.complete(AFTER_400["after400"], MAX_TOKENS, client) == expected["after400"]


@default_base_only("the 200-request load and leak check; this base's server runs every other test of this "
                   "file (offline tokens, concurrency, repeat hits, the restored state with its control)")
@pytest.mark.parametrize("server", ["local-cpu"], indirect=True)  # the costly one: one backend
def test_bench_serve_no_failures_and_flat_memory(server):
    """200 requests, 4 at a time, none failed; resident memory of the server's process tree
    within 5% of its value after a warm-up of the same size and shape (another seed)."""
    warm = list(BENCH)
    warm[warm.index("--seed") + 1] = "1"
    warm[warm.index("--result-filename") + 1] = f"qwen3next-{server.backend}-warmup.json"
    w = bench_serve(server, warm)
    assert w["failed"] == 0 and w["completed"] == 200
    rss_warm = server.rss_bytes()
    r = bench_serve(server, BENCH)
    assert r["failed"] == 0, r
    assert r["completed"] == 200
    rss_after = server.rss_bytes()
    print(f"{server.backend}: server RSS after warm-up {rss_warm / 2**20:.0f} MiB, after the "
          f"bench {rss_after / 2**20:.0f} MiB")
    assert abs(rss_after - rss_warm) <= 0.05 * rss_warm, (rss_warm, rss_after)
