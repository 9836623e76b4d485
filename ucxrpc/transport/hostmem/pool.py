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

import numpy as np
import torch

from ..._core import Pool

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


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class HostPool:
    """Size-classed free lists of page-aligned host buffers.

    The lists are the native core's (csrc/pool.c): a buffer goes out as a
    tensor over an object that lends it its bytes, and back onto its list
    when the last tensor over it dies, on whichever thread that is.  At
    most ``max_cached_bytes`` sit idle; beyond that freed buffers are
    released to the allocator.  Memory for a buffer the pool never had
    comes from :func:`_buffer` (huge pages from :data:`HUGE`).
    """

    def __init__(self, *, min_bytes: int = 1 << 20, max_cached_bytes: int = 2 << 30) -> None:
        self.min_bytes = min_bytes
        self.max_cached_bytes = max_cached_bytes
        self._pool = Pool(make=_buffer, frombuffer=torch.frombuffer, empty=_empty,
                          dtype=torch.uint8, min_bytes=min_bytes,
                          max_cached_bytes=max_cached_bytes, page=PAGE)
        #: ``alloc(nbytes, phase=None)``: a 1-D uint8 CPU tensor of
        #: ``nbytes`` (pooled when large enough).  ``phase``: where in a
        #: page the buffer is to start (its address modulo :data:`PAGE`), to
        #: match the memory a copy reads from: on this project's test
        #: machines (AMD EPYC, glibc 2.36) a copy whose source and
        #: destination sit a few bytes apart in their pages runs at a third
        #: of the speed (16 MiB read out of another process took 2.5-2.7 ms
        #: against 1.05-1.2 with equal phases); phased buffers are pooled
        #: at any size, in classes of their own (a page of room each).
        #: Power-of-two classes above 1 MiB waste at most half, and a
        #: steady stream of equal-size tensors always hits the same class.
        #: (In Python, with a weakref.finalize per buffer, 3.4 µs a buffer
        #: alone and 25-30 µs beside a busy process: issue 52.)
        self.alloc = self._pool.alloc
        #: ``clear()``: let every idle buffer go.
        self.clear = self._pool.clear
        #: ``stats()``: ``cached_bytes``, ``hits`` and ``misses``.
        self.stats = self._pool.stats
