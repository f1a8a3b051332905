"""pytest-xdist workers of `make test`'s parallel pass: each keeps to its own share of the cores.

`make test` runs the tests not marked `serial` on one worker per core (`TEST_JOBS`). A worker calls
`pin_xdist_worker()` at start-up (tests/conftest.py), before any test imports torch or vLLM: it sets
the worker's CPU affinity to its share, which every process it starts inherits (engines, `vllm serve`,
their engine cores), and vLLM's CPU worker binds its OpenMP threads to the allowed cores
(`os.sched_getaffinity`). So two engines of two workers never spin on the same core.
"""

from __future__ import annotations

import os


def worker_share(cores: list[int], worker: int, count: int) -> list[int]:
    """The cores of worker `worker` of `count`: consecutive, the last takes the remainder."""
    per = len(cores) // count
    return cores[worker * per:(worker + 1) * per] if worker < count - 1 else cores[worker * per:]


def pin_xdist_worker(environ: dict[str, str] | None = None) -> list[int] | None:
    """In an xdist worker (`PYTEST_XDIST_WORKER` gwN of `PYTEST_XDIST_WORKER_COUNT` >= 2, at least as
    many cores as workers): keep this process to its share of the cores and set `OMP_NUM_THREADS`
    to its size; returns the share (None where nothing was changed)."""
    env = os.environ if environ is None else environ
    worker = env.get("PYTEST_XDIST_WORKER", "")
    count = int(env.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    share = worker_share(cores, int(worker[2:]) % count, count)
    os.sched_setaffinity(0, share)
    env["OMP_NUM_THREADS"] = str(len(share))
    return share
