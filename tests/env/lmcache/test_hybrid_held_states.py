"""States held between a hybrid request's lookup and its load (LMCache 0005, issue 29): bounded by
count and by bytes, oldest dropped first, and safe to hold from the lookup server's thread while
the scheduler takes them."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402


def _store(max_held: int = 256, max_bytes: int = 1 << 30):
    from lmcache.integration.vllm.hybrid_state import HybridStateStore

    store = HybridStateStore(engine=None, model_id="m")
    store.MAX_HELD, store.MAX_HELD_BYTES = max_held, max_bytes
    return store


def _state(kib: int) -> dict:
    return {"layers.0": [torch.zeros(kib * 256, dtype=torch.float32)]}  # kib KiB


def test_held_states_bounded_by_bytes_oldest_dropped():
    store = _store(max_bytes=10 << 10)  # 10 KiB
    for i in range(4):
        store.hold(f"r{i}", 64, _state(4))  # 4 KiB each: the third pushes r0 out, the fourth r1
    assert store.held_stats() == {"held_requests": 2, "held_bytes": 8 << 10, "held_dropped": 2}
    assert store.take("r3", list(range(64))) is not None  # held: no fetch (no engine here)
    assert store.held_stats()["held_bytes"] == 4 << 10
    store.hold("r2", 64, _state(1))  # held again: replaces its old state and its bytes
    assert store.held_stats() == {"held_requests": 1, "held_bytes": 1 << 10, "held_dropped": 2}


def test_held_states_bounded_by_count():
    store = _store(max_held=3)
    for i in range(5):
        store.hold(f"r{i}", 32, _state(1))
    st = store.held_stats()
    assert st["held_requests"] == 3 and st["held_dropped"] == 2 and st["held_bytes"] == 3 << 10


def test_hold_and_take_from_two_threads_leak_nothing():
    store = _store(max_held=10_000)
    n = 2000
    taken = []

    def holder():
        for i in range(n):
            store.hold(f"r{i}", 32, _state(1))

    def taker():
        i = 0
        while i < n:
            got = store._pop_held(f"r{i}")
            if got is not None:
                taken.append(i)
                i += 1

    threads = [threading.Thread(target=holder), threading.Thread(target=taker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert taken == list(range(n))
    assert store.held_stats() == {"held_requests": 0, "held_bytes": 0, "held_dropped": 0}
