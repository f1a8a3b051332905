"""Hybrid models across engine processes that share nothing but an LMCache backend (issue 16).

The K/V of a prefix and the hybrid (GDN) state at the same position both live in LMCache's
storage, so a second engine *process* that shares only the backend restores both. Each backend is
a real server on 127.0.0.1 that the test starts and stops: `lmcache_server` (LMCache's own) and
`redis-server` (Debian's package, installed by the test when missing). Engine A computes a prompt
and exits; engine B, a new process with no local tier, restores K/V + state from the server and gives the
tokens of a run without any connector; engine C loses the server mid-run (the server's process
group is killed between its two prompts) and must recompute with the same tokens and a warning.
Negative control (redis): B's run with the restored states zeroed must give other tokens.

A concurrent batch (issue 29): engine A prefills three 96-token prompts as one batch (one
generate call, one step for all three), saving each request's state at 96 from the batch's step;
engine B, a new process sharing only the backend (local disk; redis), serves each prompt extended
by 8 tokens from 96 restored tokens with the tokens of the same prompt run alone (an engine with
LMCache and a fresh backend: the same step partition, 0 -> 96 -> 104, so equal tokens mean an
exact restore); with the restored states zeroed the tokens change.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from kvstack.testbed.backend_servers import start_or_skip as _start, stop as _stop  # noqa: E402
from kvtest import default_base_only  # noqa: E402
from test_e2e_cpu import (PROMPT_A, PROMPT_EXT, QWEN_STEPS, _disk_env, qwen_baseline,  # noqa: E402,F401
                          qwen_model, run_engine, tiny)

BATCH = [[(i * 37 + k * 101) % 900 + 3 for i in range(96)] for k in range(3)]  # three chunks each
BATCH_EXT = [p + [5 + k, 6, 7, 8] * 2 for k, p in enumerate(BATCH)]  # 8 tokens past the state at 96
BATCH_STEPS = ("--max-num-batched-tokens", "512")  # the three prefills in one step


@pytest.mark.parametrize("backend", [
    pytest.param("lmcache_server", marks=default_base_only(
        "the other bases restore through redis here, and lmcache_server carries their hybrid state in "
        "test_lmcache_server.py (remote) and test_backend_stall.py")),
    "redis"])
def test_second_engine_process_restores_kv_and_state_from_the_backend(backend, qwen_model, tmp_path,
                                                                       qwen_baseline):
    model = qwen_model  # the long-memory GDN copy (hybrid_models.py): a wrong state shows
    server, url = _start(backend, tmp_path)
    try:
        # No local tier in any engine: what a later process finds can only come from the server.
        remote = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
                  "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}
        a = run_engine(model, "qwen3next", [PROMPT_A], tmp_path / "a", lmcache=True, env=remote,
                       extra_args=QWEN_STEPS)
        assert a["hits"] == [0] and a["tokens"] == [qwen_baseline["A"]]

        # B: a new process; its engine KV is wiped before each prompt, so every hit is a load.
        b = run_engine(model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path / "b", lmcache=True,
                       wipe=True, env=remote, extra_args=QWEN_STEPS)
        assert b["hits"] == [96, 96] and b["restored"] == [96, 96], b
        assert b["tokens"] == [qwen_baseline["A"], qwen_baseline["EXT"]]

        if backend == "redis":
            # Negative control (one backend is enough: the restore path after the fetch is the
            # same): B's run with every restored state zeroed gives other tokens, so the equal
            # tokens above say the restored state is right, not merely that the model ignores it.
            z = run_engine(model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path / "z", lmcache=True,
                           wipe=True, env=remote, extra_args=[*QWEN_STEPS, "--zero-restored-state"])
            # (B saved its second prompt's state at 128 too: this new process restores it)
            assert z["restored"][0] == 96 and z["restored"][1] >= 96, z
            assert z["tokens"] != [qwen_baseline["A"], qwen_baseline["EXT"]], z

        # C: the server dies between its two prompts: the second is recomputed, same tokens.
        c = run_engine(model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path / "c", lmcache=True,
                       wipe=True, env=remote, extra_args=[*QWEN_STEPS, "--kill-pgid", str(server.pid)])
        assert server.wait(timeout=30) is not None
        assert c["restored"][0] == 96 and c["restored"][1] == 0, c
        assert c["tokens"] == [qwen_baseline["A"], qwen_baseline["EXT"]]
        assert c["warnings"], "expected a warning about the lost LMCache backend"
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def batch_reference(qwen_model, tmp_path_factory):
    """Each extended prompt alone in an engine with LMCache and an empty backend (no hit): its
    prefill runs 0 -> 96 (the checkpoint cut) -> 104, as a restore from 96 does."""
    tmp = tmp_path_factory.mktemp("batch-reference")
    out = run_engine(qwen_model, "qwen3next", BATCH_EXT, tmp, lmcache=True,
                     env={"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"},
                     extra_args=BATCH_STEPS)
    assert out["hits"] == [0, 0, 0], out["hits"]
    return out["tokens"]


@pytest.mark.parametrize("backend", [
    pytest.param("disk", marks=default_base_only(
        "the other bases run the batch through redis here, and a new process restoring from local "
        "disk in test_e2e_cpu.py")),
    "redis"])
def test_new_process_restores_states_a_concurrent_batch_saved(backend, qwen_model, tmp_path,
                                                              batch_reference):
    server = None
    if backend == "redis":
        server, url = _start("redis", tmp_path)
        env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
               "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}
    else:
        env = _disk_env(tmp_path / "disk")
    try:
        a = run_engine(qwen_model, "qwen3next", BATCH, tmp_path / "a", lmcache=True, env=env,
                       extra_args=(*BATCH_STEPS, "--batch"))
        assert sorted(a["saved"][0]) == [96, 96, 96], a["saved"]  # one state per request, at 96
        if backend == "disk":
            shutil.copytree(tmp_path / "disk", tmp_path / "disk-zero")
        b = run_engine(qwen_model, "qwen3next", BATCH_EXT, tmp_path / "b", lmcache=True, env=env,
                       extra_args=BATCH_STEPS)
        assert b["hits"] == [96, 96, 96] and b["restored"] == [96, 96, 96], (b["hits"], b["restored"])
        assert b["tokens"] == batch_reference
        zero_env = _disk_env(tmp_path / "disk-zero") if backend == "disk" else env
        z = run_engine(qwen_model, "qwen3next", BATCH_EXT, tmp_path / "z", lmcache=True, env=zero_env,
                       extra_args=(*BATCH_STEPS, "--zero-restored-state"))
        assert z["restored"] == [96, 96, 96], z["restored"]
        assert z["tokens"] != batch_reference, "a zeroed state must change the tokens"
    finally:
        if server is not None:
            _stop(server)
