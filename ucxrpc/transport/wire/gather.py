"""A host buffer sent from several tensors, without joining them first.

A message's small host tensors travel as one buffer (``ucxrpc.serialization.bundle``).
Joined with ``torch.cat``, their bytes were copied twice on the way out:
once by the cat (plus ~0.3 µs of torch per tensor), then again by UCX into
its shared-memory fragments.  A :class:`Gather` lists the tensors instead,
and UCX is handed their addresses as one I/O vector (``UCP_DATATYPE_IOV``):
it copies each straight into its fragments, and the receiver gets one
contiguous buffer as before, so the wire does not change.  The 100 × 4 KiB
dict echo took ~7% less time and ~9% less CPU (benchmarks/runs/AB.md).

Only a plain UCX send takes the parts.  Wherever the buffer must be one
block of memory (inline in a frame, read by address, staged, a call to
oneself) the sender makes it one with :meth:`Gather.joined`, the same
bytes in a tensor of its own.  Either way the bytes are read when the
message is sent, not when it was pickled.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Buffer", "Gather"]

_CPU = torch.device("cpu")


class Gather:
    """``parts`` (contiguous 1-D host tensors of one dtype, none lazily
    negated or conjugated, each at ``addresses[i]`` and ``sizes[i]`` bytes
    long, ``nbytes`` in all) sent as one buffer of their bytes back to back.

    Where the transport reads a buffer's size and device, it reads them as
    a 1-D uint8 host tensor's (``numel()``, ``is_cuda``, ``device``,
    ``get_device()``).
    """

    __slots__ = ("parts", "nbytes", "iov")
    is_cuda = False
    device = _CPU

    def __init__(self, parts: list[torch.Tensor], addresses: list[int], sizes: list[int],
                 nbytes: int) -> None:
        self.parts = parts
        self.nbytes = nbytes  # sum(sizes), which the caller knows already
        # ucp_dt_iov_t: (address, length) pairs, read by UCX until the send
        # completes (the request keeps this object alive).
        self.iov = np.empty(2 * len(parts), dtype=np.uint64)
        self.iov[0::2] = addresses
        self.iov[1::2] = sizes

    def numel(self) -> int:
        """Its size in bytes, as a uint8 buffer's ``numel()``."""
        return self.nbytes

    def get_device(self) -> int:
        """-1: host memory, as a host tensor's ``get_device()``."""
        return -1

    def joined(self) -> torch.Tensor:
        """A uint8 tensor of its own holding the parts' bytes, back to back
        (bytes only: the cat records no autograd step for a part that
        requires grad)."""
        with torch.no_grad():
            return torch.cat(self.parts).view(torch.uint8)

    def __repr__(self) -> str:
        return f"Gather({len(self.parts)} parts, {self.nbytes} bytes)"


#: What a message's buffer may be on the way out.
Buffer = torch.Tensor | Gather
