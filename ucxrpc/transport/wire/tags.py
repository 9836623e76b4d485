"""The 64-bit tag every UCX tag message carries: what it is, and whom it
claims to come from (a claim: only a frame's MAC proves the sender)::

    63-62 kind (:class:`TagKind`)
    61-46 sender worker id
    45-0  message frames: the sender's opaque *hint* (the agent's message
          id and kind), readable even when a frame is too large to receive
    45-16 data buffers: message sequence number
    15-0  data buffers: buffer index

Distinct tags per buffer let concurrent large messages on one pipe proceed
side by side; probes match a kind with :data:`KIND_MASK`.
"""

from __future__ import annotations

import enum

__all__ = ["CANARY", "DATA", "FRAME", "HANDSHAKE", "HINT_MASK", "ID_MASK", "ID_SHIFT",
           "KIND_SHIFT", "MAX_WORKER_ID", "SEQ_MASK", "TagKind", "data_tag", "kind_base",
           "kind_of", "sender_of"]

KIND_SHIFT = 62
ID_SHIFT = 46
ID_MASK = 0xFFFF
SEQ_MASK = (1 << 30) - 1
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


def data_tag(sender: int, seq: int, index: int) -> int:
    return (DATA << KIND_SHIFT) | (sender << ID_SHIFT) | ((seq & SEQ_MASK) << 16) | index


def sender_of(tag: int) -> int:
    """The worker id a tag claims to come from."""
    return (tag >> ID_SHIFT) & ID_MASK


def kind_of(tag: int) -> int:
    return tag >> KIND_SHIFT
