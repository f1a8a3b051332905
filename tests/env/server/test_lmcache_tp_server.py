"""`vllm serve` with LMCacheConnectorV1 on a hybrid model under tensor parallelism 2 (issue 29,
point 2): the long-memory tiny Qwen3-Next of test_lmcache_server.py (its tokens depend on the
restored GDN state), LMCache's local CPU backend, 32-token chunks and steps, ``--tensor-parallel-size
2 --distributed-executor-backend mp``, each rank on its own core (``VLLM_CPU_OMP_THREADS_BIND``).

Each rank has its own LMCache engine: it stores the K/V chunks of its own KV heads and the state of
its own GDN heads under keys that name its rank (the hybrid state key is the chunk key's, so rank
and world size are in it). The lookup (and its early fetch of the state) runs on one worker; the
other rank fetches its state at load time (docs/hybrid-lmcache.md). The checks:

- a repeat of a 100-token prompt hits 96 tokens, both ranks restore their state at 96, and the
  repeat's tokens equal the first request's (computed without any hit, the same TP 2 engine and
  step partition, so equal tokens mean an exact restore);
- negative control, on the same server: with the states zeroed on restore
  (tests/env/lmcache/fault_site/sitecustomize.py, KVSTACK_ZERO_RESTORED_STATE naming a flag file
  that exists only during the control) a repeat of another prompt hits as much and gives other
  tokens; with the flag removed, the next repeat is exact again.

The default base only (CI time); serial: the two ranks bind one core each.
"""

from __future__ import annotations

import time

import pytest

import test_lmcache_server as lm
from kvtest import default_base_only
from vllm_server import ROOT, Server, serving, with_fault_site

pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.serial,
              default_base_only("this base's hybrid LMCache at TP 1: test_lmcache_server.py")]

SERVE = [lm.LONG_SERVE[0], "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
         *lm.LONG_SERVE[1:]]
P = lm.prompt(100, 44)
Q = lm.prompt(100, 45)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvstack.testbed.long_memory import long_memory_qwen3next
    from kvstack.testbed.tiny_models import make_model

    long_memory_qwen3next(make_model("qwen3next", ROOT / lm.MODEL), ROOT / lm.LONG_MODEL)
    flag = tmp_path_factory.mktemp("zero") / "zero.flag"
    s = with_fault_site(Server("qwen3next-lmcache-tp2", SERVE,
                               {**lm.ENV["long-local-cpu"], "VLLM_CPU_OMP_THREADS_BIND": "0|1"}), str(flag))
    with serving(s, timeout_s=420) as srv:
        srv.zero_flag = flag
        yield srv


def test_tp2_repeat_restores_every_rank_state_exactly(server):
    first, again, hit = lm._repeat(server, P)
    assert hit == 96
    assert again == first
    log = server.log.read_text(errors="replace")
    assert log.count("restored hybrid state at 96") == 2, "each of the two ranks restores its state"
    assert "zeroed pid=" not in log


def test_tp2_negative_control_zeroed_state_changes_the_tokens(server):
    client = server.client()
    first = server.complete(Q, lm.MAX_TOKENS, client)
    time.sleep(1.0)
    server.zero_flag.write_text("on")
    try:
        zeroed = server.complete(Q, lm.MAX_TOKENS, client)
    finally:
        server.zero_flag.unlink()
    assert "zeroed pid=" in server.log.read_text(errors="replace")
    assert zeroed != first, "a zeroed state must change the tokens"
    assert server.complete(Q, lm.MAX_TOKENS, client) == first  # flag gone: exact again
