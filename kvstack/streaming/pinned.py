"""Host memory a GPU copies from directly (page-locked), allocated once, exactly its size.

torch's pinned allocator (``pin_memory=True``, the CachingHostAllocator) rounds every allocation
up to the next power of two: a 20 GiB host tier pins 32 GiB (vllm#56410, sglang#36562). A
`HostArena` is instead one page-aligned allocation of exactly its size, registered with the CUDA
driver (``cudaHostRegister``), so that copies from it run asynchronously on a copy stream as from
pinned memory; where registering fails it falls back to torch's pinned allocator and says so
(``method``, ``error``), and without ``pin`` it is plain memory. The host tier's pools
(host_tier.HostStore: one arena for all streaming layers of a store) and the floor bench's pools
(bench/streaming_gpu.py) are allocated here: one implementation, the one the bench ran on an H200.

Imports only torch: the floor bench uses it on a bare machine.
"""

from __future__ import annotations

import os
import weakref

import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cuda_err(r) -> int:
    """A cudart call's result as an int (torch's binding returns an enum or an int)."""
    try:
        return int(r)
    except TypeError:
        return int(getattr(r, "value", 1))


def clear_cuda_error() -> None:
    """A failed cudaHostRegister/Unregister leaves its code as the CUDA runtime's last error, which
    torch then raises at an unrelated later call (seen on an H200: "part or all of the requested
    memory range is already mapped" at a ``torch.empty``). torch's ``cudart()`` binding has no
    cudaGetLastError, so read it off through the libcudart torch has loaded."""
    try:
        import ctypes
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart.so" in ln}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # noqa: BLE001 - best effort; torch reports whatever is left
        pass


def unregister(ptrs: list[int]) -> None:
    """Unregister pinned ranges before their memory goes back to the allocator: a range left
    registered is refused when the same addresses are registered again (AlreadyRegistered)."""
    for ptr in ptrs:
        try:
            if cuda_err(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
                clear_cuda_error()
        except Exception:  # noqa: BLE001
            clear_cuda_error()
    ptrs.clear()


def page_aligned_empty(numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements that starts on an OS page and owns every page it touches
    (its storage has a page of slack), so registering it never overlaps another registration."""
    n = numel * torch.empty((), dtype=dtype).element_size()
    alloc = torch.zeros if zero else torch.empty
    raw = alloc(-(-n // PAGE_BYTES) * PAGE_BYTES + PAGE_BYTES, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE_BYTES
    return raw[off:off + n].view(dtype)


def torch_pinned(numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """torch's pinned allocator (the fallback: rounded up to a power of two)."""
    alloc = torch.zeros if zero else torch.empty
    return alloc(numel, dtype=dtype, pin_memory=True)


class HostArena:
    """`numel` elements of `dtype` in host memory (``tensor``, 1-D), allocated once:

    - ``pin=False``: plain memory (``method`` "none");
    - ``pin=True``: page-aligned and registered with ``cudaHostRegister`` (its whole storage:
      torch's ``is_pinned()`` asks about the storage's base pointer), ``method``
      "cudaHostRegister"; where that fails (``error`` says why) torch's pinned allocator,
      "pin_memory=True".

    Registered memory is unregistered when the arena is collected: keep the arena as long as its
    tensor (or a view of it) is in use. ``zero``: zero-filled (else uninitialised; a pinned arena
    is always zero-filled, see below)."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, zero: bool = False):
        self.method, self.error = "none", ""
        self._registered: list[int] = []
        weakref.finalize(self, unregister, self._registered)
        if not pin:
            alloc = torch.zeros if zero else torch.empty
            self.tensor = alloc(numel, dtype=dtype)
            return
        # every page touched before the driver pins it: torch fills with all its threads, while
        # cudaHostRegister faults untouched pages in one by one (the floor bench's 48 GiB tier on
        # an H200 host, 2026-11-30: 25.9 s registered untouched, 6.8 s zero-filled first)
        t = page_aligned_empty(numel, dtype, zero=True)
        try:
            st = t.untyped_storage()
            base, size = st.data_ptr(), st.nbytes()
            r = cuda_err(torch.cuda.cudart().cudaHostRegister(base, size, 0))
            if r == 0:
                self._registered.append(base)
                if t.is_pinned():
                    self.tensor, self.method = t, "cudaHostRegister"
                    return
                self.error = "registered but not seen as pinned"
                unregister([self._registered.pop()])
            else:
                self.error = f"cudaHostRegister error {r}"
                clear_cuda_error()
        except Exception as e:  # noqa: BLE001 - fall back to torch's pinned allocator
            self.error = f"cudaHostRegister: {e}"
            clear_cuda_error()
        del t
        self.tensor, self.method = torch_pinned(numel, dtype, zero), "pin_memory=True"
