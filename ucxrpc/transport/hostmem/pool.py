"""Reusable host receive buffers.

A freshly allocated large buffer is page-fault bound (docs/ucx-notes.md, pitfall 3:
about 2.5 GB/s here, where memcpy runs at 17+ GB/s), which is what holds
torch's agent near 1-2 GB/s for large tensors.  Buffers of at least
``min_bytes`` come from per-size-class free lists instead; a buffer goes back
to its list when the last tensor viewing it dies, so received tensors stay
ordinary tensors for the user.  Reused buffers also stay registered in UCX's
registration cache.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

PAGE = 4096
#: A transparent huge page (x86-64, and arm64 with 4 KiB pages).  Buffers
#: from this size are backed by huge pages where the kernel allows it: a
#: peer reading one by address (cma.py) pins it a huge page at a time
#: instead of 4 KiB at a time, and received tensors are often what goes
#: back (a reply, a relay).  16 MiB read out of another process in one
#: call: 0.92-0.97 ms from huge pages, 2.5-3.1 ms from small ones; in two
#: halves 0.57-0.69 against 1.3-1.6 ms (benchmarks/runs/Y.md).
HUGE = 2 << 20


def _buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh host memory, on huge pages from :data:`HUGE`
    where the kernel has them (``transparent_hugepage`` set to ``always``
    or ``madvise``; elsewhere the advice is ignored)."""
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, dtype=np.uint8)
    # A private mapping with room to start on a huge-page boundary: only
    # whole aligned huge pages can be huge.  The array keeps the mapping
    # alive; untouched room costs address space only.
    try:
        room = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        # No mapping to be had (vm.max_map_count, say): the allocator's
        # memory, or its MemoryError naming the size, as before huge pages.
        return np.empty(nbytes, dtype=np.uint8)
    whole = np.frombuffer(room, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE
    try:
        room.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)  # before the first touch
    except OSError:  # a kernel without transparent huge pages: small pages
        pass
    return whole[skip:skip + nbytes]


class HostPool:
    """Size-classed free lists of page-aligned host buffers.

    Thread-safe: buffers return from whichever thread drops the last view.
    At most ``max_cached_bytes`` sit idle; beyond that freed buffers are
    released to the allocator.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, max_cached_bytes: int = 2 << 30) -> None:
        self.min_bytes = min_bytes
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size_class(n: int) -> int:
        # Power-of-two classes above 1 MiB waste at most half, and a steady
        # stream of equal-size tensors always hits the same class.
        return 1 << (n - 1).bit_length()

    def alloc(self, nbytes: int, phase: int | None = None) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of ``nbytes`` (pooled when large enough).

        ``phase``: where in a page the buffer is to start (its address
        modulo :data:`PAGE`), to match the memory a copy reads from.  On
        this project's test machines (AMD EPYC, glibc 2.36) a copy whose
        source and destination sit a few bytes apart in their pages runs at
        a third of the speed: 16 MiB read out of another process took
        2.5-2.7 ms against 1.05-1.2 with equal phases.
        """
        if nbytes < self.min_bytes and phase is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        # A phased buffer needs a page of room; its own classes, so that
        # plain ones keep exactly their power of two.
        cls = self._size_class(nbytes) + (0 if phase is None else PAGE)
        with self._lock:
            free = self._free.get(cls)
            base = free.pop() if free else None
            if base is not None:
                self._cached -= cls
                self.hits += 1
            else:
                self.misses += 1
        if base is None:
            base = _buffer(cls)
        skip = 0 if phase is None else (phase - base.ctypes.data) % PAGE
        view = base[skip:skip + nbytes]
        weakref.finalize(view, self._release, base)
        return torch.from_numpy(view)

    def _release(self, base: np.ndarray) -> None:
        cls = base.nbytes
        with self._lock:
            if self._cached + cls > self.max_cached_bytes:
                return
            self._free.setdefault(cls, []).append(base)
            self._cached += cls

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cached_bytes": self._cached, "hits": self.hits, "misses": self.misses}
