"""Run by test_gather.py in a process of its own with TRITON_INTERPRET=1 (set before triton is
imported): our Triton gather kernel on CPU tensors, as CI can run it. Prints one "OK <check>" line
per check; an assertion error otherwise."""

from __future__ import annotations

import os
import random
import sys

import torch

from kvstack.streaming import gather
from kvstack.streaming.host_tier import HostStore
from kvstack.streaming.transfer import Medium, Transfer


def _runs(rng, src_rows, dst_rows):
    """Runs of 1-9 rows tiling destination rows [0, dst_rows) from random source positions."""
    runs, at = [], 0
    while at < dst_rows:
        n = min(rng.randint(1, 9), dst_rows - at)
        runs.append((rng.randrange(0, src_rows - n + 1), at, n))
        at += n
    return runs


def check_kernel():
    rng = random.Random(0)
    for row_shape, dtype, rows in [((2, 32), torch.float32, 300), ((8, 128), torch.bfloat16, 100),
                                   ((3, 5), torch.float16, 77), ((1, 1), torch.float32, 1)]:
        k_src = torch.randn(512, *row_shape).to(dtype)
        v_src = torch.randn(512, *row_shape).to(dtype)
        runs = _runs(rng, 512, rows)
        index = gather.run_rows(runs)
        got = [torch.zeros(rows + 3, *row_shape, dtype=dtype) for _ in range(2)]
        want = [torch.zeros(rows + 3, *row_shape, dtype=dtype) for _ in range(2)]
        gather.copy_rows_kv(*got, k_src, v_src, index, kernel="triton")
        gather.copy_rows_kv(*want, k_src, v_src, index, kernel="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (row_shape, dtype)
        assert torch.equal(got[0][rows:], torch.zeros(3, *row_shape, dtype=dtype))  # nothing else
        if len(runs) > 1:  # control: two runs' sources swapped give other rows
            (s0, d0, n0), (s1, d1, n1) = runs[0], runs[1]
            bad = [(s1, d0, n0), (s0, d1, n1)] + runs[2:]
            other = [torch.zeros_like(got[0]) for _ in range(2)]
            gather.copy_rows_kv(*other, k_src, v_src, gather.run_rows(bad), kernel="triton")
            assert not torch.equal(other[0], got[0])
    print("OK kernel", flush=True)


def check_usable():
    assert gather.triton_usable(torch.device("cpu"), torch.float32, (2, 32))
    print("OK usable", flush=True)


def check_transfer():
    """A request's windows over scattered pages through Transfer: with the kernel, one gather per
    window, the same K/V as run-by-run copies."""
    P, Hkv, D, pages_n = 4, 2, 16, 60
    store = HostStore(["L"], 128, P, Hkv, D, torch.float32)
    pages = random.Random(1).sample(range(128), pages_n)
    ctx = pages_n * P - 3
    k = torch.randn(ctx, Hkv, D)
    v = torch.randn(ctx, Hkv, D)
    Transfer(Medium(torch.device("cpu"))).write_back(store.k["L"], store.v["L"], pages, 0, k, v)
    m = Medium(torch.device("cpu"))
    m.gather = "triton"
    t = Transfer(m)
    n = 0
    for start, wk, wv in t.windows(store.k["L"], store.v["L"], pages, ctx, 64):
        rows = wk.shape[0]
        assert torch.equal(wk, k[start:start + rows]) and torch.equal(wv, v[start:start + rows])
        n += 1
    assert t.gathers == n == -(-ctx // 64) and t.copies == 0, (t.gathers, n, t.copies)
    print("OK transfer", flush=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name in sys.argv[1:] or ["kernel", "usable", "transfer"]:
        globals()[f"check_{name}"]()
