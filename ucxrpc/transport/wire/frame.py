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
    mac      16 bytes, keyed BLAKE2b over prefix, descriptors, payload
             and the frame's total length

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
or out of band: hashing them ran at ~1 GB/s and doubled the cost of a
message of many small tensors, and no tensor byte is ever executed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from ...errors import FrameError

MAGIC = b"UX"
# 2: the BATCH kind; 3: REMOTE buffers, CMA_OK and CMA_DONE; 4: ack; 5: state;
# 6: WRITTEN buffers and GRANT; 7: a HELLO carries its pipe's generation,
# a data tag its pipe's epoch (auth.py, tags.py)
VERSION = 7
PREFIX = struct.Struct("<2sBBHHIQQ")
DESC = struct.Struct("<QQhBxI")
MAC_LEN = 16
NOT_INLINE = 0xFFFF_FFFF_FFFF_FFFF
ALIGN = 64
STAGED, PACK, PACKED, REMOTE, WRITTEN = 1, 2, 4, 8, 16
BUSY = 1  # the prefix's state: the sender's loop may not poll
_FLAG_SETS = (0, STAGED, PACK, PACK | STAGED, PACKED, REMOTE, WRITTEN)
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


_KINDS = {int(k): k for k in FrameKind}  # a dict lookup is 10x cheaper than FrameKind(n)


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


# The descriptor table read in one numpy call instead of a struct per buffer.
_DESC_DTYPE = np.dtype([("nbytes", "<u8"), ("off", "<u8"), ("device", "<i2"), ("flags", "u1"),
                        ("pad", "V1"), ("arg", "<u4")])
assert _DESC_DTYPE.itemsize == DESC.size


@dataclass(frozen=True)
class Frame:
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


def mac(key: bytes, head: bytes | memoryview, size: int) -> bytes:
    h = hashlib.blake2b(head, key=key, digest_size=MAC_LEN)
    h.update(size.to_bytes(8, "little"))
    return h.digest()


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


def encode(kind: FrameKind, seq: int, payload: bytes | memoryview,
           buffers: Sequence[tuple[int, memoryview | None, int]], key: bytes,
           limits: Limits,
           ways: Sequence[tuple[int, int, int]] | None = None,
           peer_max_frame: int = 1 << 62, seal: bool = True,
           ack: int = 0, busy: bool = False) -> tuple[np.ndarray, list[int]]:
    """Build a frame; returns it and the indices of buffers sent separately.

    ``buffers`` holds (nbytes, host bytes view or None, device) triples; a
    host buffer (device -1) no larger than ``limits.inline_threshold`` is
    copied inline while the inline total stays under ``limits.inline_total``
    and the frame within both sides' ``max_frame_bytes``.
    ``ways``, when given, holds (flags, arg, where) per buffer; a buffer
    with flags set is never inlined, and PACKED, REMOTE and WRITTEN ones are
    not sent at all (a REMOTE one's address rides in its ``where``).
    ``seal=False`` leaves the MAC zero: a message inside a batch, whose
    frame's MAC covers it whole.  ``ack`` and ``busy`` (the state's BUSY):
    see the module's docstring.

    Raises:
        FrameError: the message breaks a limit (named in the message).
    """
    if len(buffers) > limits.max_buffers:
        raise FrameError(f"message has {len(buffers)} buffers; the limit is {limits.max_buffers}")
    nbuf = len(buffers)
    head_len = PREFIX.size + DESC.size * nbuf + len(payload)
    cursor = start = (head_len + ALIGN - 1) & ~(ALIGN - 1)
    offs, separate, inline = [], [], []
    total = 0
    frame_cap = min(limits.max_frame_bytes, peer_max_frame) - MAC_LEN
    small, budget = limits.inline_threshold, min(start + limits.inline_total, frame_cap)
    for i, (n, view, device) in enumerate(buffers):
        if ways is not None and ways[i][0]:
            if ways[i][0] == PACKED:
                offs.append(ways[i][2])
            elif ways[i][0] == REMOTE or ways[i][0] == WRITTEN:
                total += n
                offs.append(ways[i][2])
            else:
                total += n
                offs.append(NOT_INLINE)
                separate.append(i)
            continue
        total += n
        end = (cursor + n + ALIGN - 1) & ~(ALIGN - 1)  # the frame ends aligned
        if view is not None and device < 0 and n <= small and end <= budget:
            offs.append(cursor)
            inline.append((cursor, view))
            cursor = end
        else:
            offs.append(NOT_INLINE)
            separate.append(i)
    size = (cursor if inline else head_len) + MAC_LEN
    if size > limits.max_frame_bytes:
        raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    # A BATCH frame is not a message but holds several, each checked when
    # it was queued (send.py) and again by the receiver (receive.py): the
    # limit is theirs.  Applied to the batch, a callee with a small limit
    # refused its own batch of replies, and the replies in it were lost.
    if size + total > limits.max_message_bytes and kind is not FrameKind.BATCH:
        raise FrameError(f"message of {size + total} bytes exceeds "
                         f"max_message_bytes={limits.max_message_bytes}")
    arr = np.empty(size, dtype=np.uint8)  # ucxx's Array is unsafe with bytearray
    out = arr.data
    PREFIX.pack_into(out, 0, MAGIC, VERSION, kind, nbuf, BUSY if busy else 0, len(payload),
                     seq, ack)
    if 0 < nbuf <= 8:  # as in decode: the numpy table costs ~2-3 µs more for a few
        for i, (b, off) in enumerate(zip(buffers, offs)):
            flags, arg = (ways[i][0], ways[i][1]) if ways is not None else (0, 0)
            DESC.pack_into(out, PREFIX.size + DESC.size * i, b[0], off, b[2], flags, arg)
    elif nbuf:
        table = arr[PREFIX.size:PREFIX.size + DESC.size * nbuf].view(_DESC_DTYPE)
        table["nbytes"] = [b[0] for b in buffers]
        table["off"] = offs
        table["device"] = [b[2] for b in buffers]
        table["pad"] = b""
        table["flags"] = [w[0] for w in ways] if ways is not None else 0
        table["arg"] = [w[1] for w in ways] if ways is not None else 0
    pos = PREFIX.size + DESC.size * nbuf
    out[pos:pos + len(payload)] = payload
    for off, view in inline:
        out[off:off + view.nbytes] = view
    if seal:
        out[size - MAC_LEN:] = mac(key, out[:head_len], size)
    else:
        out[size - MAC_LEN:] = bytes(MAC_LEN)
    return arr, separate


def decode(raw: np.ndarray, key: bytes | None, limits: Limits) -> Frame:
    """Parse and check a received frame.

    ``key=None`` skips the MAC (handshake frames, which carry no secret-derived
    key yet and are parsed field by field, never unpickled).  The message's
    total size is returned in ``Frame.total`` for the caller to check once
    the MAC has proved whom to tell.

    Raises:
        FrameError: bad magic or version, truncated, inconsistent sizes, a
            limit broken, or a MAC mismatch — the message says which.
    """
    data = raw.data.cast("B")
    n = data.nbytes
    if n < PREFIX.size + MAC_LEN:
        raise FrameError(f"truncated frame: {n} bytes is shorter than a frame header")
    magic, version, kind, nbuf, state, plen, seq, ack = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"frame version {version} not supported (this side speaks {VERSION})")
    kind = _KINDS.get(kind)
    if kind is None:
        raise FrameError(f"unknown frame kind {PREFIX.unpack_from(data, 0)[2]}")
    if state & ~BUSY:
        raise FrameError(f"unknown frame state bits {state:#06x}")
    busy = state == BUSY
    if nbuf > limits.max_buffers:
        raise FrameError(f"frame declares {nbuf} buffers; the limit is {limits.max_buffers}")
    head_len = PREFIX.size + DESC.size * nbuf + plen
    if head_len + MAC_LEN > n:
        raise FrameError(f"truncated frame: header declares {head_len + MAC_LEN} bytes, got {n}")
    # In constant time: a byte-by-byte early exit would tell a forger, by
    # timing, how much of a guessed MAC was right.
    if key is not None and not hmac.compare_digest(mac(key, data[:head_len], n),
                                                   bytes(data[n - MAC_LEN:])):
        raise FrameError("frame authentication failed (MAC mismatch)")
    payload = data[head_len - plen:head_len]
    if nbuf <= 8:  # numpy's fixed cost (~8 µs) only pays off for many buffers
        descs = []
        total = n
        flagged = False
        for i in range(nbuf):
            nbytes, off, device, flags, arg = DESC.unpack_from(data, PREFIX.size + DESC.size * i)
            if flags:
                flagged = True
            elif off == NOT_INLINE:
                total += nbytes
            elif off < head_len or off + nbytes > n - MAC_LEN:
                raise FrameError(f"buffer {i} claims inline bytes [{off}, {off + nbytes}) "
                                 f"outside the {n}-byte frame")
            descs.append(BufferDesc(nbytes, off, device, flags, arg))
        if flagged:
            return _with_ways(Frame(kind, seq, payload, tuple(descs), raw, total, ack=ack,
                                    busy=busy))
        return Frame(kind, seq, payload, tuple(descs), raw, total, ack=ack, busy=busy)
    table = np.frombuffer(data, dtype=_DESC_DTYPE, count=nbuf, offset=PREFIX.size)
    sizes, offs, flags = table["nbytes"], table["off"], table["flags"]
    plain = flags == 0
    inline = (offs != NOT_INLINE) & plain
    # Python ints: a lying size near 2**64 must not wrap around in uint64.
    bad = inline & ((offs < head_len) | (offs > n - MAC_LEN) | (sizes > n - MAC_LEN - offs))
    if bad.any():
        i = int(np.argmax(bad))
        off, nbytes = int(offs[i]), int(sizes[i])
        raise FrameError(f"buffer {i} claims inline bytes [{off}, {off + nbytes}) "
                         f"outside the {n}-byte frame")
    total = n + sum(sizes[~inline & plain].tolist())
    table_descs = tuple(map(BufferDesc._make, zip(sizes.tolist(), offs.tolist(),
                                                  table["device"].tolist(), flags.tolist(),
                                                  table["arg"].tolist())))
    frame = Frame(kind, seq, payload, table_descs, raw, total, ack=ack, busy=busy)
    return frame if plain.all() else _with_ways(frame)


def _with_ways(frame: Frame) -> Frame:
    """Check the descriptors of staged and packed buffers; count their bytes."""
    descs = frame.buffers
    total = frame.total
    first_pack = next((i for i, d in enumerate(descs) if d.flags & PACK), len(descs))
    for i, d in enumerate(descs):
        if d.flags not in _FLAG_SETS:
            raise FrameError(f"buffer {i} has unknown flags {d.flags:#x}")
        if bool(d.flags & PACK) != (i >= first_pack):
            raise FrameError(f"buffer {i}: packs must come after every other buffer")
        if d.flags & STAGED and d.arg < MIN_CHUNK_KIB:
            raise FrameError(f"buffer {i} is staged in chunks of {d.arg} KiB; the minimum is "
                             f"{MIN_CHUNK_KIB} KiB")
        if d.flags & (STAGED | PACK) or d.flags == REMOTE or d.flags == WRITTEN:
            total += d.nbytes
            if d.flags == REMOTE and d.device != -1:
                raise FrameError(f"buffer {i} is to be read by address from device "
                                 f"{d.device}; only host memory can be")
            if d.flags == WRITTEN and d.device != -1:
                raise FrameError(f"buffer {i} was written into host memory here, but its "
                                 f"descriptor names device {d.device}")
        elif d.flags == PACKED:
            if not first_pack <= d.arg < len(descs):
                raise FrameError(f"buffer {i} claims to sit in buffer {d.arg}, which is not a pack")
            pack = descs[d.arg]
            if d.where + d.nbytes > pack.nbytes or d.device != pack.device:
                raise FrameError(f"buffer {i} claims bytes [{d.where}, "
                                 f"{d.where + d.nbytes}) on device {d.device} of a "
                                 f"{pack.nbytes}-byte pack on device {pack.device}")
    return Frame(frame.kind, frame.seq, frame.payload, descs, frame.raw, total, first_pack,
                 frame.ack, frame.busy)


def peek_kind(raw: np.ndarray) -> int | None:
    """The kind byte of a frame not yet decoded (None if too short)."""
    return int(raw[3]) if raw.nbytes > 3 else None


def peek_seq(raw: np.ndarray) -> int | None:
    """Best-effort sequence number of a possibly broken frame, for logs."""
    try:
        return int(PREFIX.unpack_from(raw.data, 0)[6])
    except struct.error:
        return None
