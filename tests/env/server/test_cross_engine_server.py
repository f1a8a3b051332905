"""Cross-engine sharing through `vllm serve` (issue 27): two server processes with PYTHONHASHSEED
unset that share only a `redis-server` on 127.0.0.1 share a prefix, as a user runs them.

LMCache keys a chunk by `pre_caching_hash_algorithm`, whose stock default ("builtin", Python's
`hash()` with a first prefix hash vLLM draws per process unless PYTHONHASHSEED is set) differs in
every process: two servers never hit each other's chunks. kvstack's LMCache patch "token database:
chunk keys from a digest by default" (0012 on 0.32, 0009 on 0.25) keys chunks by `sha256_cbor` of
the token ids. tests/env/lmcache/test_cross_engine_keys.py checks it on the offline engine; this is
the same through the OpenAI server, where vLLM reports the hit to the client
(`usage.prompt_tokens_details.cached_tokens`, with `--enable-prompt-tokens-details`).

Phase A: three servers write, PYTHONHASHSEED unset, no local LMCache tier (LMCACHE_LOCAL_CPU=False,
so hits can only come from redis), 32-token chunks, vLLM's own prefix cache off (so
`cached_tokens` counts LMCache's hits only), greedy completions of token-id prompts through the
`openai` client: tiny llama (dense), the tiny Qwen3-Next with a long-memory GDN state (hybrid:
hybrid_models.py, a wrong or missing state changes its tokens) and a llama with stock's `builtin`
hash set explicitly. Each computes its prompts (0 cached tokens) and is stopped once redis holds
what it stored. Phase B: three new servers read: llama with PYTHONHASHSEED unset (another random
per-process salt), Qwen3-Next with PYTHONHASHSEED=12345, and the `builtin` control with 12345.

- the same prompt: the second server reports cached tokens (llama: 96, three whole chunks of the
  100-token prompt; Qwen3-Next: 96 too, where the second prefill step was cut on a chunk boundary
  and the GDN state was saved) and gives the first server's tokens, which were computed without any hit (the
  offline test compares with an engine without connector);
- the hybrid reader's negative control: a Qwen3-Next reader whose restored states are zeroed hits
  as much and gives other tokens;
- the control: `builtin` on both sides misses (0 cached, the same tokens), or the test could not
  fail; its writer logged LMCache's PYTHONHASHSEED warning, the digest servers did not;
- keys must differ where the KV differs (issue 27, the second half of point 3): a prompt only the
  Qwen3-Next server wrote is a miss on the llama server (the model name is in LMCache's key); the
  same `cache_salt` shares. Another `cache_salt`, or a salt on a prompt stored without one, does
  not share: kvstack's LMCache patch "vLLM adapter: a request's cache_salt and LoRA adapter in its
  chunk keys" (0013 on 0.32, 0010 on 0.25) puts a digest of the salt (and of the LoRA adapter)
  into every chunk key as a tag (stock LMCache leaves both out, and such requests shared a prefix:
  96 cached tokens). The LoRA tag is unit-tested only (tests/env/lmcache/test_request_keys.py):
  the tiny models have no adapters.

The default base only (CI time: about 75 s a base); the other base runs the same keys offline
(tests/env/lmcache/test_cross_engine_keys.py and test_request_keys.py; the patches are the same code
on both). On a host where vLLM cannot run Qwen3-Next the hybrid servers are not started and the
hybrid case is skipped (tests/env/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import pytest

from kvtest import default_base_only
from vllm_server import ROOT, Server, with_fault_site

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from kvstack.testbed import tiny_models  # noqa: E402
from kvstack.testbed.backend_servers import start_or_skip, stop  # noqa: E402

pytestmark = [pytest.mark.env, pytest.mark.slow,
              default_base_only("this base: test_cross_engine_keys.py, test_request_keys.py")]

CHUNK = 32
MAX_TOKENS = 8
KV_TRANSFER = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                         separators=(",", ":"))
COMMON = ["--host", "127.0.0.1", "--port", "8000", "--max-model-len", "512", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
          "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
          "--kv-transfer-config", KV_TRANSFER]
ENGINE = {"llama": ["--dtype", "bfloat16", "--block-size", "32"],
          "qwen3next": ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32"]}


def prompt(salt: int, n: int = 100) -> list[int]:
    return [(i * 37 + salt * 101) % 900 + 3 for i in range(n)]


P = prompt(0)  # both models, both phases; the control's too
P_MODEL = prompt(1)  # written by Qwen3-Next only, read by llama
P_SALT = prompt(2)  # written by llama with cache_salt SALT_A
SALT_A, SALT_B = "tenant-a-7f3c9e", "tenant-b-0d41a2"
HITS = {"llama": 96, "qwen3next": 96}  # see the module docstring
HASHSEED_WARNING = "Centralized cache sharing detected but PYTHONHASHSEED not set"

# (server, PYTHONHASHSEED (None: unset), LMCache hash algorithm (None: kvstack's default))
WRITERS = {"llama": ("llama", None, None), "qwen3next": ("qwen3next", None, None),
           "builtin": ("llama", None, "builtin")}
READERS = {"llama": ("llama", None, None), "qwen3next": ("qwen3next", "12345", None),
           "builtin": ("llama", "12345", "builtin"), "qwen3next-zero": ("qwen3next", None, None)}
# the negative control of the hybrid reader: every hybrid state it restores is zeroed
# (tests/env/lmcache/fault_site/sitecustomize.py, KVSTACK_ZERO_RESTORED_STATE)
ZERO_READERS = {"qwen3next-zero"}
# what each writer sends: (name, prompt, cache_salt)
WRITES = {"llama": [("P", P, None), ("P_SALT", P_SALT, SALT_A)],
          "qwen3next": [("P", P, None), ("P_MODEL", P_MODEL, None)],
          "builtin": [("P", P, None)]}

HYBRID_OK = tiny_models.engine_crash_reason("qwen3next") is None


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server, url = start_or_skip("redis", tmp_path_factory.mktemp("redis"))
    yield url
    stop(server)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "env" / "lmcache"))
    from hybrid_models import long_memory_qwen3next

    root = tmp_path_factory.mktemp("cross-engine-models")
    out = {"llama": tiny_models.make_model("llama", root / "llama")}
    if HYBRID_OK:
        qwen = tiny_models.make_model("qwen3next", root / "qwen3next")
        out["qwen3next"] = long_memory_qwen3next(qwen, root / "qwen3next-long")
    return out


def _server(name: str, model_dir, model: str, seed: str | None, algorithm: str | None,
            redis_url: str, zero_state: bool = False) -> Server:
    env = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "False",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_REMOTE_URL": redis_url,
           "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_DISABLE_BANNER": "1"}
    if algorithm:
        env["LMCACHE_PRE_CACHING_HASH_ALGORITHM"] = algorithm
    s = Server(name, [str(model_dir), *COMMON, *ENGINE[model]], env)
    for key in ("LMCACHE_PRE_CACHING_HASH_ALGORITHM", "LMCACHE_HYBRID_STATE_DIR",
                "LMCACHE_CONFIG_FILE"):
        if key not in env:  # the user's environment must not change what is tested
            s.env.pop(key, None)
    if zero_state:
        with_fault_site(s)
    if seed is None:
        s.env.pop("PYTHONHASHSEED", None)  # BASE_ENV (and the Makefile) set it to 0
    else:
        s.env["PYTHONHASHSEED"] = seed
    return s


@contextlib.contextmanager
def _serving_all(servers: dict[str, Server]):
    """Start the servers together (their start-ups overlap), wait for each, stop all on exit."""
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(300)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _phase(tag: str, spec: dict, models: dict, redis_url: str) -> dict[str, Server]:
    return {key: _server(f"cross-engine-{tag}-{key}", models[model], model, seed, algo, redis_url,
                         zero_state=key in ZERO_READERS)
            for key, (model, seed, algo) in spec.items() if model in models}


def complete(server: Server, p: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """(greedy token ids, the usage's cached prompt tokens) of one completion."""
    extra = {"return_token_ids": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = server.client().completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body=extra)
    details = r.usage.prompt_tokens_details
    assert details is not None, "no prompt_tokens_details (--enable-prompt-tokens-details)"
    return list(r.choices[0].token_ids), details.cached_tokens or 0


def _settle(redis_url: str, timeout_s: float = 20.0) -> int:
    """Until redis's key count has not changed for a second (LMCache stores asynchronously)."""
    import redis as redis_client

    host, port = redis_url.removeprefix("redis://").split(":")
    r = redis_client.Redis(host=host, port=int(port))
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = r.dbsize()
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= 1.0:
            break
        time.sleep(0.2)
    return last


@pytest.fixture(scope="module")
def written(redis, models):
    """Phase A: each writer computes its prompts, then every writer is stopped. Returns
    {writer: {prompt name: (tokens, cached)}} and the writers' logs."""
    servers = _phase("a", WRITERS, models, redis)
    out: dict[str, dict] = {}
    with _serving_all(servers):
        for key, s in servers.items():
            try:
                out[key] = {name: complete(s, p, salt) for name, p, salt in WRITES[key]}
            except Exception as e:  # noqa: BLE001 (the writer's log explains it)
                pytest.fail(f"writer {key}: {e!r}; log {s.log}:\n{s.tail()}")
        keys = _settle(redis)
    assert keys > 0, "nothing reached redis"
    out["logs"] = {key: s.log.read_text(errors="replace") for key, s in servers.items()}
    return out


@pytest.fixture(scope="module")
def readers(written, redis, models):
    """Phase B: new server processes on the same redis (phase A's servers are gone)."""
    with _serving_all(_phase("b", READERS, models, redis)) as servers:
        yield servers


@pytest.fixture
def reader_llama(readers):
    return readers["llama"]


@pytest.fixture
def reader_builtin(readers):
    return readers["builtin"]


@pytest.fixture
def reader(request, readers):
    if request.param not in readers:
        pytest.skip(tiny_models.engine_crash_reason(request.param) or "not started")
    return readers[request.param]


def test_writers_computed_everything(written):
    for key in WRITERS:
        if key in written:
            assert {n: c for n, (_, c) in written[key].items()} == {n: 0 for n, _, _ in WRITES[key]}
    for key in ("llama", "qwen3next"):
        if key in written:
            assert HASHSEED_WARNING not in written["logs"][key]
    # the control's writer: stock's hash with a remote backend and no PYTHONHASHSEED warns
    assert HASHSEED_WARNING in written["logs"]["builtin"]


@pytest.mark.parametrize("reader", ["llama", "qwen3next"], indirect=True)
def test_second_server_reports_cached_tokens_and_gives_the_same_tokens(reader, written):
    model = "qwen3next" if "qwen3next" in reader.name else "llama"
    tokens, cached = complete(reader, P)
    assert cached == HITS[model], (model, cached)
    assert tokens == written[model]["P"][0], model
    log = reader.log.read_text(errors="replace")
    assert HASHSEED_WARNING not in log
    if model == "qwen3next":
        assert "restored hybrid state at 96" in log


@pytest.mark.parametrize("reader", ["qwen3next-zero"], indirect=True)
def test_negative_control_zeroed_hybrid_state_changes_the_tokens(reader, written):
    """The hybrid reader's check can fail: a third Qwen3-Next server (PYTHONHASHSEED unset) whose
    restored GDN states are zeroed hits the same 96 tokens and restores its state there, and gives
    other tokens than the writer's (the long-memory model's output depends on its state). It reads
    P_MODEL, which no other reader asks for, so what it stores cannot reach the other checks."""
    tokens, cached = complete(reader, P_MODEL)
    assert cached == HITS["qwen3next"]
    log = reader.log.read_text(errors="replace")
    assert "restored hybrid state at 96" in log and "zeroed pid=" in log
    assert tokens != written["qwen3next"]["P_MODEL"][0], "a zeroed state must change the tokens"


def test_stock_builtin_hash_misses_across_servers(reader_builtin, written):
    """The control: `builtin` keys made with PYTHONHASHSEED unset (writer) and 12345 (reader)
    differ, so the prompt the digest servers share is a miss here, recomputed to the same tokens."""
    tokens, cached = complete(reader_builtin, P)
    assert cached == 0
    assert tokens == written["builtin"]["P"][0] == written["llama"]["P"][0]


@pytest.mark.skipif(not HYBRID_OK, reason=str(tiny_models.engine_crash_reason("qwen3next")))
def test_another_model_does_not_share(reader_llama, written):
    """A prompt only the Qwen3-Next server stored (its full-attention layer's K/V chunks under the
    same chunk hashes) is a miss on the llama server: LMCache's key holds the model name."""
    assert complete(reader_llama, P_MODEL)[1] == 0


def test_same_cache_salt_shares(reader_llama, written):
    tokens, cached = complete(reader_llama, P_SALT, SALT_A)
    assert cached == HITS["llama"]
    assert tokens == written["llama"]["P_SALT"][0]


def test_another_cache_salt_does_not_share(reader_llama, written):
    """As in vLLM's own prefix cache (where the salt enters the first block's hash): a prompt
    stored under one salt is a miss under another, and a prompt stored without a salt is a miss
    with one. LMCache's CacheEngineKey holds the model name, world size, worker, dtype and the
    request's `lmcache.tag.*` configs, and the chunk hash only the token ids; kvstack's LMCache
    patch adds the tag `lmcache.tag.salt` (a digest of `request.cache_salt`) on the scheduler
    side, for the lookup (get_num_new_matched_tokens) and for the request tracker whose configs
    the worker stores and retrieves with (RequestTracker.from_new_request), which reaches every
    chunk key and the hybrid state keys. Stock LMCache hit both (96 tokens)."""
    other = complete(reader_llama, P_SALT, SALT_B)[1]
    unsalted = complete(reader_llama, P, SALT_B)[1]
    assert (other, unsalted) == (0, 0)
