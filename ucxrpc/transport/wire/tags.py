"""The 64-bit tag every UCX tag message carries: what it is, and whom it
claims to come from (a claim: only a frame's MAC proves the sender)::

    63-62 kind (:class:`TagKind`)
    61-46 sender worker id
    45-0  message frames: the sender's opaque *hint* (the agent's message
          id and kind), readable even when a frame is too large to receive
    45-38 data buffers: the pipe's *epoch*, which the receiver chose in the
          handshake (:mod:`.auth`)
    37-16 data buffers: message sequence number (wraps)
    15-0  data buffers: buffer index

Distinct tags per buffer let concurrent large messages on one pipe proceed
side by side; probes match a kind by its top bits (:data:`KIND_SHIFT`).

A data buffer's tag is all UCX matches it by, so the epoch is what keeps a
pipe's buffers apart from an earlier pipe's between the same two worker ids:
a pipe re-established after an outage, or to a peer that restarted under
the same id, starts its sequence numbers again, and a buffer of the old
pipe still in flight (or waiting in UCX's unexpected queue) must never land
in a receive posted for the new one.  The receiver picks each new pipe's
epoch unlike its recent ones with that peer id (``Transport``), so the two
never match.
"""

from __future__ import annotations

import enum

__all__ = ["CANARY", "DATA", "EPOCHS", "EPOCH_SHIFT", "FRAME", "HANDSHAKE", "HINT_MASK", "ID_MASK",
           "ID_SHIFT", "KIND_SHIFT", "MAX_WORKER_ID", "SEQ_MASK", "TagKind", "data_tag",
           "epoch_base", "epoch_mask", "kind_base", "kind_of", "sender_of"]

KIND_SHIFT = 62
ID_SHIFT = 46
ID_MASK = 0xFFFF
EPOCH_SHIFT = 38
#: How many epochs a data tag tells apart.
EPOCHS = 256
SEQ_MASK = (1 << 22) - 1
MAX_WORKER_ID = ID_MASK
HINT_MASK = (1 << ID_SHIFT) - 1


class TagKind(enum.IntEnum):
    HANDSHAKE = 0  # HELLO, CHALLENGE, PROOF frames
    FRAME = 1      # a message's frame
    DATA = 2       # one out-of-band buffer (or chunk) of a message
    CANARY = 3     # the shared-memory queue check (canary.py)


HANDSHAKE, FRAME, DATA, CANARY = (int(k) for k in TagKind)


def kind_base(kind: int, sender: int) -> int:
    """The tag of ``kind`` from ``sender`` with nothing below the id."""
    return (kind << KIND_SHIFT) | (sender << ID_SHIFT)


def data_tag(sender: int, epoch: int, seq: int, index: int) -> int:
    """The tag of buffer ``index`` of message ``seq`` on a pipe of ``epoch``."""
    return ((DATA << KIND_SHIFT) | (sender << ID_SHIFT) | (epoch << EPOCH_SHIFT)
            | ((seq & SEQ_MASK) << 16) | index)


def epoch_base(sender: int, epoch: int) -> int:
    """The tag of data from ``sender`` on a pipe of ``epoch``, with nothing
    below the epoch: with :func:`epoch_mask`, every such buffer (to drain
    what an ended pipe left in UCX's unexpected queue)."""
    return (DATA << KIND_SHIFT) | (sender << ID_SHIFT) | (epoch << EPOCH_SHIFT)


def epoch_mask() -> int:
    """The bits :func:`epoch_base` sets."""
    return ((1 << 64) - 1) ^ ((1 << EPOCH_SHIFT) - 1)


def sender_of(tag: int) -> int:
    """The worker id a tag claims to come from."""
    return (tag >> ID_SHIFT) & ID_MASK


def kind_of(tag: int) -> int:
    return tag >> KIND_SHIFT
