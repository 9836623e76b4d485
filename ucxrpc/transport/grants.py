"""Grants: memory a receiver lends its peer to write large buffers into.

Reading by address (:mod:`.hostmem.cma`) makes the kernel pin the *sender's* pages
one at a time.  A user's tensor sits on 4 KiB pages, while ucxrpc's receive
buffers sit on huge ones (:mod:`.hostmem.pool`), so the sender writing into the
receiver's buffer copies twice as fast as the receiver reading the
sender's: 16 MiB in two halves 0.68 against 1.42 ms, 4 MiB 0.15 against
0.30 (benchmarks/runs/AA.md).  A writer has to know where to write
before its frame goes, though, or the message pays a round trip.  So a
receiver that read a large buffer of a peer's lends it, in a GRANT frame,
a buffer of that size class for the next one (:meth:`Grants.lend`), and
lends another each time one is used.  A sender holding a grant of the right
class writes its buffer into it (:func:`.hostmem.cma.write`, below the GIL, before
the frame leaves) and names the grant in the buffer's descriptor (WRITTEN,
:mod:`.wire.frame`); the receiver hands that memory up as the buffer
(:meth:`Grants.take`).  Neither side copies anything more, and the sender
need not hold its buffer until the receiver says it read it.

Safety:

* A grant goes only to a peer that proved it can reach this process's
  memory (it read our token and sent CMA_OK: the kernel checks reading and
  writing alike), and only in authenticated frames.  Each is used once: a
  descriptor naming a grant not lent, or already used, fails its message.
* Lent memory is the peer's to write until a frame names it.  A pipe that
  breaks keeps its grants out of the pool until the transport closes
  (:meth:`Grants.retire`): a peer taken for dead that still writes must not
  write into a buffer handed to someone else.
* Bounded: size classes from :data:`MIN_BYTES` (below it, reading by
  address in the native core costs less than the write saves) to
  :data:`MAX_BYTES`, one grant per class and pipe, and at most
  :data:`TOTAL_BYTES` lent by a worker at a time.

Threads: :meth:`lend`, :meth:`take` and :meth:`on_frame` run on the loop;
senders pick grants (:func:`pick`) under the pipe's lock, which guards a
pipe's grants both ways.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from typing import Callable

import torch

from ..errors import FrameError
from .hostmem.cma import SPLIT_BYTES
from .wire.frame import BufferDesc, Frame, FrameKind
from .pipe import Pipe

__all__ = ["MAX_BYTES", "MIN_BYTES", "TOTAL_BYTES", "Grants", "pick", "size_class"]

logger = logging.getLogger(__name__)

#: Smallest grant.  Receive buffers get huge pages from HUGE (2 MiB), and
#: writing into them is faster than reading a user's tensor on small
#: pages: on the project's Intel VM 4 MiB 300 against 351 µs, 16 MiB 1,172
#: against 1,437.  But a grant costs a GRANT frame per message, and its
#: messages take the Python path on both sides, where a buffer read by
#: address below this size is sent and read in the native core
#: (csrc/send.c, csrc/receive.c): from 2 MiB to 8 MiB that won, 4 MiB
#: beside a busy process one-way 6.7 -> 7.4-7.7 GB/s and round trip 6.8-7.4
#: -> 8.1-8.3, 2 MiB quiet one-way 8.4 -> 9.4, quiet 4 MiB within 5% (Run
#: BF).  From here the receiver would read in two halves on two threads
#: (cma.SPLIT_BYTES) and the write saves more than the frame costs.
MIN_BYTES = 8 << 20
#: Largest grant: one lent and never used holds its memory while the pipe
#: lives, so classes above this are read by address as before.
MAX_BYTES = 64 << 20
#: Most memory one worker lends at a time, to all its peers.
TOTAL_BYTES = 256 << 20
#: How long after lending memory for a buffer that its writer copies in two
#: halves (on two threads, :data:`.hostmem.cma.SPLIT_BYTES`) this side's loop does not
#: poll for messages: a polling thread would take a core that copy runs on
#: (16 MiB one-way on a quiet host: the write took 1.0-1.1 ms with the
#: receiver polling, 0.6 alone).  The loop's own poll window (engine.SPIN_S):
#: a peer that stopped sending large buffers soon has it polled for again.
SPLIT_QUIET_S = 0.01
_ENTRY = struct.Struct("<IQQ")  # grant id, bytes, address
_MAX_ENTRIES = 32
# Grants of one class kept from a peer (it lends one at a time): a peer
# that lends more cannot make us hold an unbounded list.
_KEPT_PER_CLASS = 4

#: ``(pipe, payload, buffers, kind)``: the transport's send of a frame.
Send = Callable[[Pipe, bytes, list[torch.Tensor], FrameKind], None]


def size_class(nbytes: int) -> int:
    """The grant size that takes a buffer of ``nbytes`` (a power of two,
    as the pool's classes: a stream of equal sizes uses one class)."""
    return 1 << (nbytes - 1).bit_length()


def pick(pipe: Pipe, nbytes: int) -> tuple[int, int] | None:
    """A grant of ``pipe``'s peer for a buffer of ``nbytes``, as (id,
    address), taken so that no other message uses it; None if it lent us
    none of that class (under the pipe's lock)."""
    free = pipe.grants.granted.get(size_class(nbytes))
    return free.pop() if free else None


class Grants:
    """One transport's grants, lent to peers and taken back as buffers.

    Args:
        alloc: ``(nbytes, phase)`` → host memory (the receive pool's, on
            huge pages from :data:`.hostmem.pool.HUGE`).
        send: sends a frame on a pipe (the GRANT frames).
    """

    def __init__(self, *, alloc: Callable[[int, int], torch.Tensor], send: Send) -> None:
        self._alloc = alloc
        self._send = send
        self._ids = itertools.count(1)
        # lent_bytes changes on the loop and on whichever thread breaks a pipe.
        self._lock = threading.Lock()
        self.lent_bytes = 0  # lent now, to all peers
        self.lent = 0        # grants lent, ever
        self.used = 0        # buffers peers wrote into them
        self.used_bytes = 0
        self._retired: list[torch.Tensor] = []
        #: Until when a peer may write into our memory in two halves; 0: not
        #: since it was last looked at (:meth:`split_write_due`).  The loop
        #: tests it before that call: a test, not a call, a turn (issue 52).
        self.split_until = 0.0

    def lend(self, pipe: Pipe, sizes: list[tuple[int, int]]) -> None:
        """The peer sent us buffers of these ``(nbytes, phase)`` (phase:
        the address in its page of its own buffer, which a copy runs
        fastest matching): lend it memory for the next of each class it
        lacks, in one GRANT frame."""
        if not pipe.cma.read_by_peer:  # it never showed it can reach our memory
            return
        entries = []
        with pipe.lock:
            for nbytes, phase in sizes:
                cls = size_class(nbytes)
                if (nbytes < MIN_BYTES or cls > MAX_BYTES
                        or any(b.numel() == cls for b in pipe.grants.lent.values())):
                    continue
                with self._lock:
                    if self.lent_bytes + cls > TOTAL_BYTES:
                        continue
                    self.lent_bytes += cls
                try:
                    buf = self._alloc(cls, phase)
                except Exception as exc:  # out of memory: it reads by address as before
                    self._give_back(cls)
                    logger.debug("no %d-byte grant for %s: %s", cls, pipe.name, exc)
                    continue
                gid = next(self._ids)
                pipe.grants.lent[gid] = buf
                if cls >= SPLIT_BYTES:
                    self.split_until = time.monotonic() + SPLIT_QUIET_S
                entries.append(_ENTRY.pack(gid, cls, buf.data_ptr()))
        if not entries:
            return
        try:
            self._send(pipe, b"".join(entries), [], FrameKind.GRANT)
        except Exception as exc:  # the pipe broke meanwhile: retire() has them
            logger.debug("GRANT to %s not sent: %s", pipe.name, exc)
            return
        self.lent += len(entries)

    def split_write_due(self) -> bool:
        """Whether a peer may be writing into our memory in two halves now
        (we lent it memory for such a write within :data:`SPLIT_QUIET_S`):
        polling would then slow its copy down."""
        if not self.split_until:
            return False
        if time.monotonic() < self.split_until:
            return True
        self.split_until = 0.0
        return False

    def take(self, pipe: Pipe, i: int, d: BufferDesc) -> torch.Tensor:
        """Buffer ``i`` of a message from ``pipe``, which its sender wrote
        into our grant ``d.arg``: that memory, as the buffer.

        Raises:
            FrameError: we lent no such grant, it was used already, or the
                buffer is larger than the grant.
        """
        with pipe.lock:
            buf = pipe.grants.lent.pop(d.arg, None)
        if buf is None:
            raise FrameError(f"{pipe.name} says it wrote buffer {i} into grant {d.arg}, which "
                             "this worker did not lend it or saw used already")
        self._give_back(buf.numel())
        if d.nbytes > buf.numel():
            raise FrameError(f"{pipe.name} says it wrote {d.nbytes} bytes (buffer {i}) into a "
                             f"{buf.numel()}-byte grant")
        self.used += 1
        self.used_bytes += d.nbytes
        # A storage of its own, of exactly its size, as every received
        # buffer has: a view of the whole grant would travel on whole
        # (torch sends a view's storage), a reply of 4 MiB as 8.
        return torch.from_numpy(buf.numpy()[:d.nbytes])

    def on_frame(self, pipe: Pipe, frame: Frame) -> None:
        """A GRANT frame from ``pipe``'s peer: its memory for our next large
        buffers, if we can reach it (we read its token)."""
        data = bytes(frame.payload)
        count, rest = divmod(len(data), _ENTRY.size)
        if rest or not 0 < count <= _MAX_ENTRIES:
            raise FrameError(f"a GRANT frame from {pipe.name} has a {len(data)}-byte payload; "
                             f"it carries 1 to {_MAX_ENTRIES} entries of {_ENTRY.size} bytes")
        entries = [_ENTRY.unpack_from(data, k * _ENTRY.size) for k in range(count)]
        for gid, nbytes, address in entries:
            if nbytes != size_class(nbytes) or not MIN_BYTES <= nbytes <= MAX_BYTES or not address:
                raise FrameError(f"{pipe.name} lent a {nbytes}-byte grant at {address:#x}: "
                                 f"grants are powers of two from {MIN_BYTES} to {MAX_BYTES} "
                                 "bytes")
        if not pipe.cma.reads:
            logger.debug("grants from %s left unused: we do not reach its memory", pipe.name)
            return
        with pipe.lock:
            for gid, nbytes, address in entries:
                free = pipe.grants.granted.setdefault(nbytes, [])
                if len(free) < _KEPT_PER_CLASS:
                    free.append((gid, address))

    def retire(self, pipe: Pipe) -> None:
        """``pipe`` broke (under its lock): what it lent stays out of use
        until the transport closes, and what it was lent is forgotten."""
        lent = list(pipe.grants.lent.values())
        pipe.grants.lent.clear()
        pipe.grants.granted.clear()
        self._give_back(sum(b.numel() for b in lent))
        self._retired.extend(lent)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.lent_bytes -= nbytes

    def stats(self) -> dict[str, int]:
        return {"grants_lent": self.lent, "grants_used": self.used,
                "bytes_written_by_peers": self.used_bytes,
                "grant_bytes_lent": self.lent_bytes,
                "grant_bytes_retired": sum(b.numel() for b in self._retired)}
