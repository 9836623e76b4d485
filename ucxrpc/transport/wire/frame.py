"""The transport's frame: what one tag message on a pipe carries.

A message is one *frame* (sent on the header tag) followed by one tag
message per out-of-band buffer.  The frame describes every buffer (size,
device, and whether it travels inline inside the frame) so the receiver can
allocate each buffer in its final memory before UCX writes into it.

Layout (little endian)::

    prefix   magic "UX" | version u8 | kind u8 | nbuf u16 | state u16
             | payload_len u32 | seq u64 | ack u64            (28 bytes)
    nbuf x   nbytes u64 | where u64 | device i16 (-1 = cpu) | flags u8
             | pad u8 | arg u32                               (24 bytes each)
    payload  payload_len bytes, opaque to the transport
    inline   small buffers copied in, each 64-byte aligned
    mac      16 bytes, SipHash-2-4-128 keyed with the direction's
             16-byte key over prefix, descriptors, payload and the
             frame's total length

A descriptor's ``flags`` say how a buffer travels (0: one tag message
straight into its final memory, or inline when ``where`` is not NOT_INLINE):

* STAGED: as host chunks of ``arg`` KiB, one tag message each, in order on
  the buffer's tag, because one side's UCX cannot touch device memory; the
  receiver copies each chunk to the device as it lands.
* PACK: the buffer is a pack of many small device buffers, listed after
  every ordinary descriptor and not delivered itself.
* PACKED: the buffer lives in the pack ``arg`` at ``where``; the receiver
  cuts it out (one kernel launch per pack) when the pack arrives.
* REMOTE: a host buffer the receiver reads out of the sender's memory at
  address ``where`` (:mod:`..hostmem.cma`); nothing is sent for it.  Only a pipe
  whose receiver sent CMA_OK carries them.
* WRITTEN: a host buffer its sender already wrote into the receiver's
  memory, into the grant ``arg`` (:mod:`..grants`); nothing is sent for it.

Every frame's ``ack`` says the sender has read (or given up on) the REMOTE
buffers of all the receiver's frames up to that sequence number (0: none
yet), so the other side may let them go.  Reads happen as frames arrive, in
order, so one number acknowledges them all; it rides on whatever frame goes
back (the reply, mostly), and a CMA_DONE frame carries it alone when
nothing else went back for a while.

Every frame's ``state`` says how its sender's loop waits (BUSY: it may not
poll, its core being contended, or it blocks by choice).  A receiver that
does not poll takes a large eager message as a run of wake-ups, one per
batch of shared-memory fragments, so the peer sends such a receiver large
host buffers by address sooner (:data:`..hostmem.cma.BUSY_MIN_BYTES`).

Small buffers travel inline because one tag message costs microseconds in
Python, while copying a few KiB costs nanoseconds.  The MAC covers what is
interpreted (layout and the pickle stream) but not raw tensor bytes, inline
or out of band: hashing them ran at ~1 GB/s (BLAKE2b then; SipHash's
2.6 GB/s since) and doubled the cost of a message of many small tensors,
and no tensor byte is ever executed.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..._core import MAC_KEY_LEN, frame_bind, frame_decode, frame_encode
from ..._core import mac as _mac
from ...errors import FrameError

MAGIC = b"UX"
# 2: the BATCH kind; 3: REMOTE buffers, CMA_OK and CMA_DONE; 4: ack; 5: state;
# 6: WRITTEN buffers and GRANT; 7: a HELLO carries its pipe's generation,
# a data tag its pipe's epoch (auth.py, tags.py); 8: the MAC is SipHash-2-4-128
VERSION = 8
PREFIX = struct.Struct("<2sBBHHIQQ")
DESC = struct.Struct("<QQhBxI")
MAC_LEN = 16
KEY_LEN = MAC_KEY_LEN  # the MAC's key: SipHash-2-4 takes 128 bits (csrc/siphash.h)
NOT_INLINE = 0xFFFF_FFFF_FFFF_FFFF
ALIGN = 64
STAGED, PACK, PACKED, REMOTE, WRITTEN = 1, 2, 4, 8, 16
BUSY = 1  # the prefix's state: the sender's loop may not poll
MIN_CHUNK_KIB = 64  # bounds the receives one staged buffer can ask for


class FrameKind(enum.IntEnum):
    MESSAGE = 0
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    # 4 and 5 were liveness frames (PING, PONG) of earlier frame versions: a
    # peer's death is the kernel's word now (lifeline.py); a frame of either
    # kind is refused as any unknown kind.
    # Several small messages in one frame (batch.py): queued to a pipe
    # while its previous frame was still in flight.
    BATCH = 6
    # Reading by address (cma.py), authenticated like MESSAGE, with empty
    # payloads: the receiver may read this side's buffers; an ack sent
    # alone (the prefix's, as every frame's).
    CMA_OK = 7
    CMA_DONE = 8
    # Memory the receiver lends its peer to write large buffers into
    # (grants.py), authenticated like MESSAGE; the payload lists it.
    GRANT = 9



@dataclass(frozen=True)
class Limits:
    """Bounds every frame is checked against before anything is allocated.

    Attributes:
        max_buffers: buffers per message (the tag format allows 65535).
        max_frame_bytes: size of one frame (payload plus inline buffers).
        max_message_bytes: frame plus all out-of-band buffers.
        inline_threshold: buffers up to this size are copied into the frame.
        inline_total: at most this many bytes are inlined per message.
    """

    max_buffers: int = 65535
    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 40
    inline_threshold: int = 64 << 10
    inline_total: int = 4 << 20


class BufferDesc(NamedTuple):
    """One buffer of a message (a tuple: frames may carry thousands)."""

    nbytes: int
    # Where the bytes are, as the flags say: the offset in this frame
    # (inline), NOT_INLINE (a separate message), the offset in its pack
    # (PACKED), or the sender's address (REMOTE: read by address).
    where: int
    device: int  # -1 for host memory, else the CUDA device index
    flags: int = 0
    arg: int = 0  # STAGED: chunk size in KiB; PACKED: the pack's index

    @property
    def inline(self) -> bool:
        return self.where != NOT_INLINE and not self.flags



class Frame(NamedTuple):
    """A decoded frame (a tuple: the native core builds one per message
    without calling Python)."""

    kind: FrameKind
    seq: int
    payload: memoryview
    buffers: tuple[BufferDesc, ...]
    raw: np.ndarray  # the received bytes; inline buffers are views of it
    total: int = 0   # frame plus out-of-band bytes; checked by the receiver
    delivered: int = -1  # buffers handed up (PACK buffers, last, are not); -1: all
    ack: int = 0  # the receiver's frames whose REMOTE buffers the sender is done with
    busy: bool = False  # the sender's loop may not poll (the state's BUSY)

    @property
    def nbuf(self) -> int:
        return len(self.buffers) if self.delivered < 0 else self.delivered


def check_limits(payload_len: int, nbuf: int, nbytes: int, limits: Limits,
                 peer_max_frame: int = 1 << 62, peer: str = "") -> None:
    """Refuse a message that no encoding of it could send, before it is
    encoded or queued: ``nbuf`` buffers of ``nbytes`` in all after a payload
    of ``payload_len``, to a receiver taking frames of ``peer_max_frame``.

    Inlining never pushes a frame over either limit (:func:`encode` sends
    such buffers separately), so the frame's header decides.

    Raises:
        FrameError: the limit broken, named (the receiver's as such, with
        ``peer``, its name).
    """
    if nbuf > limits.max_buffers:
        raise FrameError(f"message has {nbuf} buffers; the limit is {limits.max_buffers}")
    size = PREFIX.size + DESC.size * nbuf + payload_len + MAC_LEN
    if size > limits.max_frame_bytes:
        raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    if size > peer_max_frame:
        raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={peer_max_frame} "
                         f"of the receiver ({peer})")
    if size + nbytes > limits.max_message_bytes:
        raise FrameError(f"message of {size + nbytes} bytes exceeds "
                         f"max_message_bytes={limits.max_message_bytes}")


# The codec is the native core's (csrc/frame.c), its only implementation;
# it builds the types above, handed to it here.
frame_bind(Frame, BufferDesc, tuple(FrameKind), FrameError, np.empty, np.uint8)

encode: Callable[..., tuple[np.ndarray, list[int]]] = frame_encode
"""encode(kind, seq, payload, buffers, key, limits, ways=None,
peer_max_frame=1 << 62, seal=True, ack=0, busy=False) -> (frame, separate)

Build a frame (a uint8 numpy array); ``separate`` lists the indices of the
buffers sent as their own tag messages.

``buffers`` holds (nbytes, host bytes view or None, device) triples; a
host buffer (device -1) no larger than ``limits.inline_threshold`` is
copied inline while the inline total stays under ``limits.inline_total``
and the frame within both sides' ``max_frame_bytes``.
``ways``, when given, holds (flags, arg, where) per buffer; a buffer
with flags set is never inlined, and PACKED, REMOTE and WRITTEN ones are
not sent at all (a REMOTE one's address rides in its ``where``).
``seal=False`` leaves the MAC zero: a message inside a batch, whose
frame's MAC covers it whole.  ``ack`` and ``busy`` (the state's BUSY):
see the module's docstring.  A BATCH frame is not held to
``max_message_bytes``: the messages in it are, each.

Raises:
    FrameError: the message breaks a limit (named in the message).
"""

decode: Callable[[np.ndarray, "bytes | None", Limits], Frame] = frame_decode
"""decode(raw, key, limits) -> Frame

Parse and check a received frame.  ``key=None`` skips the MAC (handshake
frames, which carry no secret-derived key yet and are parsed field by
field, never unpickled).  The message's total size is returned in
``Frame.total`` for the caller to check once the MAC has proved whom to
tell; the payload is a view of ``raw``, as are inline buffers (their
``where``).  The MAC is compared in constant time.

Raises:
    FrameError: bad magic or version, truncated, inconsistent sizes,
        unknown flags, a limit broken, or a MAC mismatch (the message says
        which).
"""

mac: Callable[[bytes, "bytes | memoryview", int], bytes] = _mac
"""mac(key, head, size) -> the MAC_LEN-byte SipHash-2-4-128 of ``head``
followed by ``size`` (8 bytes, little endian), keyed with :data:`KEY_LEN`
bytes (a pipe direction's ``auth.session_key``).

SipHash is a pseudorandom function designed to be a MAC for short inputs
(its paper, section 1): a forgery needs the key, which is never sent, is
drawn afresh by every handshake (fresh nonces on both sides) and is not
reused by another direction or generation.  It replaced a keyed BLAKE2b
that ran at ~0.9 GB/s on the project's VM, ~4.6 µs a side for a 4 KiB
tensor inside the pickle stream (Run AU)."""


def peek_kind(raw: np.ndarray) -> int | None:
    """The kind byte of a frame not yet decoded (None if too short)."""
    return int(raw[3]) if raw.nbytes > 3 else None


def peek_seq(raw: np.ndarray) -> int | None:
    """Best-effort sequence number of a possibly broken frame, for logs."""
    try:
        return int(PREFIX.unpack_from(raw.data, 0)[6])
    except struct.error:
        return None
