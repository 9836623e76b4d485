"""Several small messages to one peer in one frame.

A message sent while the pipe's previous frame is still in flight (UCX
holds it: the peer's receive queue is full, or a rendezvous is under way)
waits in the pipe's outbox; the next send that finds nothing in flight, or
the loop when the frame in flight completes, sends everything waiting as
one BATCH frame.  One tag message, one MAC and one probe-and-receive then
serve many messages: a burst of ``rpc_async`` calls, or the replies of
several pool threads at once.  A message that finds nothing in flight goes
alone, at once, as before: batching never delays a message behind an idle
pipe.

Only small messages are batched: every buffer in host memory and inline.
Each is encoded as an ordinary MESSAGE frame, unsealed (the batch's MAC
covers it whole) and with its hint where a frame has its sequence number.

The BATCH frame's payload::

    count u32 | count x (offset u32, length u32) | padding | messages

with each message's frame at ``offset`` from the payload's start, placed so
that it starts 64-byte aligned within the whole frame (its inline buffers
keep the alignment a lone frame gives them).
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from ...errors import FrameError
from .frame import ALIGN, PREFIX

__all__ = ["BASE", "MAX_BYTES", "MAX_ITEM", "MAX_MESSAGES", "cost", "pack", "size", "unpack"]

_COUNT = struct.Struct("<I")
_ENTRY = struct.Struct("<II")
#: A message this big or bigger goes alone (copying it twice costs more
#: than the tag message saved).
MAX_ITEM = 16 << 10
#: A batch is sent once it holds this many messages or bytes.
MAX_MESSAGES = 64
MAX_BYTES = 256 << 10


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


#: What a batch's payload costs besides its messages (an upper bound).
BASE = _COUNT.size + ALIGN


def cost(nbytes: int) -> int:
    """What a message of ``nbytes`` adds to a batch's payload (an upper
    bound: its table entry and its aligned frame)."""
    return _ENTRY.size + _aligned(nbytes)


def size(frames: Sequence[np.ndarray | bytes]) -> int:
    """An upper bound of the payload :func:`pack` makes of ``frames``."""
    return BASE + sum(cost(len(f)) for f in frames)


def pack(frames: Sequence[np.ndarray | bytes]) -> bytes:
    """The BATCH payload carrying ``frames`` (encoded, unsealed messages:
    1-D byte arrays from ``encode``, or bytes from the native core's
    ``Outlet``); the payload is placed at ``PREFIX.size`` in a frame
    without buffers."""
    head = _COUNT.size + _ENTRY.size * len(frames)
    # Offsets from the payload's start, each aligned within the frame.
    pos = _aligned(PREFIX.size + head) - PREFIX.size
    entries = []
    for f in frames:
        entries.append((pos, len(f)))
        pos = _aligned(PREFIX.size + pos + len(f)) - PREFIX.size
    out = bytearray(pos)
    _COUNT.pack_into(out, 0, len(frames))
    for i, entry in enumerate(entries):
        _ENTRY.pack_into(out, _COUNT.size + _ENTRY.size * i, *entry)
    for (off, n), f in zip(entries, frames):
        out[off:off + n] = memoryview(f).cast("B")  # type: ignore[arg-type]  # (an ndarray is one)
    return bytes(out)


def unpack(raw: np.ndarray, payload_start: int, payload_len: int) -> list[np.ndarray]:
    """The messages' frames, as views of ``raw`` (the received BATCH frame).

    Raises:
        FrameError: a table that does not fit the payload.
    """
    data = raw.data.cast("B")
    if payload_len < _COUNT.size:
        raise FrameError(f"batch of {payload_len} bytes has no message count")
    (count,) = _COUNT.unpack_from(data, payload_start)
    if _COUNT.size + _ENTRY.size * count > payload_len:
        raise FrameError(f"batch claims {count} messages in {payload_len} bytes")
    out = []
    for i in range(count):
        off, n = _ENTRY.unpack_from(data, payload_start + _COUNT.size + _ENTRY.size * i)
        if off + n > payload_len:
            raise FrameError(f"batch message {i} claims bytes [{off}, {off + n}) of a "
                             f"{payload_len}-byte batch")
        out.append(raw[payload_start + off:payload_start + off + n])
    return out
