"""The host tier's page-locked memory (kvstack/streaming/pinned.py), no GPU needed: an arena is
page-aligned and exactly its size, registered once with the CUDA driver and unregistered when
collected; where registering fails, torch's pinned allocator is the fallback, and it says why.
The CUDA runtime is a stand-in here (`FakeCudart`: it records the ranges registered, and torch's
``is_pinned()`` answers from them); on a GPU the same calls are the ones the floor bench made on
an H200. The store: one registration for every layer's pools, no power-of-two pinned allocation."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from kvstack.streaming import pinned
from kvstack.streaming.host_tier import HostStore
from kvstack.streaming.pinned import PAGE_BYTES, HostArena, page_aligned_empty


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister of a CUDA runtime, recording ranges (`result`: what
    a register call returns, 0 = success)."""

    def __init__(self, result: int = 0):
        self.result = result
        self.live: dict[int, int] = {}  # base -> size
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the runtime's name
        self.calls.append(("register", ptr, size))
        if self.result == 0:
            assert ptr not in self.live, "a range registered twice"
            self.live[ptr] = size
        return self.result

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0 if self.live.pop(ptr, None) is not None else 1

    def holds(self, t: torch.Tensor) -> bool:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        return any(base <= a and a + n <= base + size for base, size in self.live.items())


@pytest.fixture
def cudart(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    # torch asks about the storage's base pointer, as the CUDA build does
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr() in rt.live)
    return rt


@pytest.fixture
def fallback(monkeypatch):
    made = []

    def torch_pinned(numel, dtype, zero=False):
        made.append(numel)
        return torch.zeros(numel, dtype=dtype)  # what pin_memory=True would give, unpinned here

    monkeypatch.setattr(pinned, "torch_pinned", torch_pinned)
    return made


@pytest.mark.parametrize("numel,dtype", [(1, torch.bfloat16), (1000, torch.float32),
                                         (3 * PAGE_BYTES + 7, torch.uint8)])
def test_an_arena_is_page_aligned_and_exactly_its_size(numel, dtype):
    a, b = page_aligned_empty(numel, dtype), page_aligned_empty(numel, dtype, zero=True)
    for t in (a, b):
        assert t.data_ptr() % PAGE_BYTES == 0 and t.numel() == numel and t.dtype == dtype
        st = t.untyped_storage()
        # the storage: the tensor's pages and one page of slack, nothing rounded up beyond that
        assert st.nbytes() == -(-numel * t.element_size() // PAGE_BYTES) * PAGE_BYTES + PAGE_BYTES
    assert not b.any()
    for t in (a, b):  # every OS page the tensor touches lies within its own storage
        st = t.untyped_storage()
        end = t.data_ptr() + numel * t.element_size()
        assert st.data_ptr() <= t.data_ptr()
        assert -(-end // PAGE_BYTES) * PAGE_BYTES <= st.data_ptr() + st.nbytes()


def test_a_pinned_arena_is_registered_once_and_unregistered_when_collected(cudart, fallback):
    arena = HostArena(10_000, torch.bfloat16, pin=True)
    assert arena.method == "cudaHostRegister" and arena.error == "" and not fallback
    assert cudart.holds(arena.tensor) and len(cudart.live) == 1
    base = next(iter(cudart.live))
    assert base == arena.tensor.untyped_storage().data_ptr()
    arena.tensor.fill_(1.5)  # plain host memory to the CPU
    del arena
    gc.collect()
    assert cudart.live == {} and cudart.calls[-1] == ("unregister", base)


def _resident(ptr: int, size: int) -> float:
    """The share of the OS pages of [ptr, ptr + size) that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = ptr - ptr % PAGE_BYTES
    n = -(-(ptr + size - start) // PAGE_BYTES)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(start, n * PAGE_BYTES, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / n


def test_every_page_is_touched_before_the_driver_pins_it(cudart, fallback):
    """cudaHostRegister faults untouched pages in one by one, while torch fills with all its
    threads (a 48 GiB tier on an H200 host: 25.9 s registered untouched, 6.8 s filled first): a
    pinned arena's pages are all in memory when it is registered, uninitialised or not. Control:
    the same size allocated without the fill is not in memory (the check can fail)."""
    numel = 32 << 20  # 64 MiB of bf16: above glibc's mmap threshold, fresh pages
    seen = []
    register = cudart.cudaHostRegister

    def recording(ptr, size, flags):
        seen.append(_resident(ptr, size))
        return register(ptr, size, flags)

    cudart.cudaHostRegister = recording
    arena = HostArena(numel, torch.bfloat16, pin=True)
    assert arena.method == "cudaHostRegister" and seen and seen[0] > 0.99, seen
    untouched = page_aligned_empty(numel, torch.bfloat16)
    st = untouched.untyped_storage()
    assert _resident(st.data_ptr(), st.nbytes()) < 0.5


@pytest.mark.parametrize("fault", ["error", "not pinned", "raises"])
def test_where_registering_fails_torchs_pinned_allocator_is_the_fallback(monkeypatch, cudart,
                                                                         fallback, fault):
    """The control: a register call that fails, one that succeeds but leaves the memory not seen
    as pinned (seen on an H200 when only the view's range was registered), and a runtime that
    raises: torch's allocator, the reason said, nothing left registered."""
    if fault == "error":
        cudart.result = 2
    elif fault == "not pinned":
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: False)
    else:
        monkeypatch.setattr(torch.cuda, "cudart", lambda: (_ for _ in ()).throw(
            RuntimeError("no CUDA runtime")))
    arena = HostArena(5000, torch.float32, pin=True)
    assert arena.method == "pin_memory=True" and fallback == [5000]
    assert {"error": "cudaHostRegister error 2", "not pinned": "registered but not seen as pinned",
            "raises": "cudaHostRegister: no CUDA runtime"}[fault] == arena.error
    assert cudart.live == {}


def test_an_unpinned_arena_registers_nothing(cudart, fallback):
    arena = HostArena(100, torch.float32, pin=False, zero=True)
    assert arena.method == "none" and not arena.tensor.any()
    assert cudart.calls == [] and not fallback


def test_the_host_store_pins_every_layer_in_one_registered_arena(cudart, fallback):
    """HostStore on a CUDA host: one registration of exactly its pools (no power-of-two pinned
    allocation), every layer's K and V pool inside it, written and read back. Control: the same
    store unpinned registers nothing."""
    layers = ["a", "b", "c"]
    store = HostStore(layers, num_pages=12, page_tokens=8, num_kv_heads=2, head_size=16,
                      dtype=torch.bfloat16, pin=True)
    assert store.arena.method == "cudaHostRegister" and not fallback
    assert [c[0] for c in cudart.calls] == ["register"]
    assert store.arena.tensor.numel() == len(layers) * 2 * 12 * 8 * 2 * 16  # exactly the pools
    for name in layers:
        assert cudart.holds(store.k[name]) and cudart.holds(store.v[name])
    k, v = torch.randn(20, 2, 16).bfloat16(), torch.randn(20, 2, 16).bfloat16()
    pages = [5, 2, 9]
    store.write("b", pages, 0, k, v)
    rk, rv = store.read("b", pages, 3, 20)
    torch.testing.assert_close(rk, k[3:])
    torch.testing.assert_close(rv, v[3:])
    del store
    gc.collect()
    assert cudart.live == {}
    cudart.calls.clear()
    plain = HostStore(layers, 12, 8, 2, 16, torch.bfloat16, pin=False)
    assert plain.arena.method == "none" and cudart.calls == [] and not fallback
