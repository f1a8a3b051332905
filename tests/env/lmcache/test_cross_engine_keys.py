"""Cross-engine sharing with default settings (issue 27): two engine processes that share only a
`redis-server` find each other's chunks whatever PYTHONHASHSEED is.

LMCache keys a chunk by `pre_caching_hash_algorithm`, whose stock default ("builtin", Python's
`hash()`) is salted per process unless PYTHONHASHSEED is set: two engines then never hit each
other's chunks. kvstack's LMCache patch "token database: chunk keys from a digest by default"
(0012 on 0.32, 0009 on 0.25) makes the default a digest of the token ids (vLLM's sha256_cbor).

Engine A runs with PYTHONHASHSEED unset and exits; engine B, a new process with no local tier and
its engine KV wiped before each prompt, runs once with the variable unset and once set to another
value: each time its prompt is served from the server (hits) with the tokens of a run without any
connector, on a dense and on a hybrid (GDN) model. The control: the stock default set explicitly
(`LMCACHE_PRE_CACHING_HASH_ALGORITHM=builtin`) must miss, or the test could not fail.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from kvstack.testbed.backend_servers import start_or_skip as _start, stop as _stop  # noqa: E402
from kvtest import on_default_base  # noqa: E402
from test_e2e_cpu import (PROMPT_A, qwen_baseline, qwen_model, run_engine,  # noqa: E402,F401
                          tiny)


def _remote(url: str, **extra) -> dict:
    # no local tier: what B finds can only come from the server
    return {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
            "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive", **extra}


@pytest.fixture
def redis(tmp_path):
    server, url = _start("redis", tmp_path)
    yield url
    _stop(server)


# CI time: the other bases only. On the default base tests/env/server/test_cross_engine_server.py
# checks the same through two `vllm serve` processes (dense, hybrid, the builtin control, two
# models, two salts); this file is the other bases' check of the same keys.
pytestmark = pytest.mark.skipif(on_default_base(), reason="the default base runs these cases through "
                                "vllm serve (tests/env/server/test_cross_engine_server.py)")


@pytest.mark.parametrize("model", ["llama", "qwen3next"])
def test_second_engine_hits_with_pythonhashseed_unset_or_different(model, redis, tiny, qwen_model,
                                                                    tmp_path):
    model_dir = qwen_model if model == "qwen3next" else tiny("llama")
    base = run_engine(model_dir, model, [PROMPT_A], tmp_path / "base")["tokens"][0]
    unset = {"PYTHONHASHSEED": None}
    a = run_engine(model_dir, model, [PROMPT_A], tmp_path / "a", lmcache=True,
                   env=_remote(redis, **unset))
    assert a["hits"] == [0] and a["tokens"] == [base]
    for seed in (None, "12345"):  # B: unset too (another random salt), then another value
        b = run_engine(model_dir, model, [PROMPT_A], tmp_path / f"b-{seed}", lmcache=True,
                       wipe=True, env=_remote(redis, PYTHONHASHSEED=seed))
        assert b["hits"][0] >= 64, (seed, b["hits"], b["warnings"][-5:])
        assert b["tokens"] == [base], seed
        assert not [w for w in b["warnings"] if "PYTHONHASHSEED" in w], b["warnings"]
    if model == "qwen3next":  # negative control: the restored state zeroed changes the tokens
        z = run_engine(model_dir, model, [PROMPT_A], tmp_path / "b-zero", lmcache=True, wipe=True,
                       env=_remote(redis, **unset), extra_args=("--zero-restored-state",))
        assert z["restored"] == b["restored"] and z["restored"][0] > 0, (z["restored"], b["restored"])
        assert z["tokens"] != [base], "a zeroed state must change the tokens"


def test_stock_builtin_hash_misses_across_processes(redis, tiny, tmp_path):
    """The control: Python's hash() (stock's default, set explicitly) misses between two processes
    with PYTHONHASHSEED unset; the same prompt in the same setting with kvstack's default hits."""
    model_dir = tiny("llama")
    builtin = {"PYTHONHASHSEED": None, "LMCACHE_PRE_CACHING_HASH_ALGORITHM": "builtin"}
    run_engine(model_dir, "llama", [PROMPT_A], tmp_path / "a", lmcache=True,
               env=_remote(redis, **builtin))
    b = run_engine(model_dir, "llama", [PROMPT_A], tmp_path / "b", lmcache=True, wipe=True,
                   env=_remote(redis, **builtin))
    assert b["hits"] == [0], b["hits"]
