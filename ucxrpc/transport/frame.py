"""The transport's frame: what one tag message on a pipe carries.

A message is one *frame* (sent on the header tag) followed by one tag
message per out-of-band buffer.  The frame describes every buffer (size,
device, and whether it travels inline inside the frame) so the receiver can
allocate each buffer in its final memory before UCX writes into it.

Layout (little endian)::

    prefix   magic "UX" | version u8 | kind u8 | nbuf u16 | reserved u16
             | payload_len u32 | seq u64                      (20 bytes)
    nbuf x   nbytes u64 | inline_offset u64 (NOT_INLINE if separate)
             | device i16 (-1 = cpu) | pad 6                  (24 bytes each)
    payload  payload_len bytes, opaque to the transport
    inline   small buffers copied in, each 64-byte aligned
    mac      16 bytes, keyed BLAKE2b over prefix, descriptors, payload
             and the frame's total length

Small buffers travel inline because one tag message costs microseconds in
Python, while copying a few KiB costs nanoseconds.  The MAC covers what is
interpreted (layout and the pickle stream) but not raw tensor bytes, inline
or out of band: hashing them ran at ~1 GB/s and doubled the cost of a
message of many small tensors, and no tensor byte is ever executed.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import FrameError

MAGIC = b"UX"
VERSION = 1
PREFIX = struct.Struct("<2sBBHHIQ")
DESC = struct.Struct("<QQh6x")
MAC_LEN = 16
NOT_INLINE = 0xFFFF_FFFF_FFFF_FFFF
ALIGN = 64


class Kind(enum.IntEnum):
    MESSAGE = 0
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    PING = 4      # authenticated like MESSAGE; asks for a PONG
    PONG = 5


_KINDS = {int(k): k for k in Kind}  # a dict lookup is 10x cheaper than Kind(n)


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
    inline_offset: int
    device: int  # -1 for host memory, else the CUDA device index

    @property
    def inline(self) -> bool:
        return self.inline_offset != NOT_INLINE


# The descriptor table read in one numpy call instead of a struct per buffer.
_DESC_DTYPE = np.dtype([("nbytes", "<u8"), ("off", "<u8"), ("device", "<i2"), ("pad", "V6")])
assert _DESC_DTYPE.itemsize == DESC.size


@dataclass(frozen=True)
class Frame:
    kind: Kind
    seq: int
    payload: memoryview
    buffers: tuple[BufferDesc, ...]
    raw: np.ndarray  # the received bytes; inline buffers are views of it
    total: int = 0   # frame plus out-of-band bytes; checked by the receiver


def mac(key: bytes, head: bytes | memoryview, size: int) -> bytes:
    h = hashlib.blake2b(head, key=key, digest_size=MAC_LEN)
    h.update(size.to_bytes(8, "little"))
    return h.digest()


def encode(kind: Kind, seq: int, payload: bytes | memoryview,
           buffers: Sequence[tuple[int, memoryview | None, int]], key: bytes,
           limits: Limits) -> tuple[np.ndarray, list[int]]:
    """Build a frame; returns it and the indices of buffers sent separately.

    ``buffers`` holds (nbytes, host bytes view or None, device) triples; a
    host buffer (device -1) no larger than ``limits.inline_threshold`` is
    copied inline while the inline total stays under ``limits.inline_total``.

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
    small, budget = limits.inline_threshold, start + limits.inline_total
    for i, (n, view, device) in enumerate(buffers):
        total += n
        if view is not None and device < 0 and n <= small and cursor + n <= budget:
            offs.append(cursor)
            inline.append((cursor, view))
            cursor = (cursor + n + ALIGN - 1) & ~(ALIGN - 1)
        else:
            offs.append(NOT_INLINE)
            separate.append(i)
    size = (cursor if inline else head_len) + MAC_LEN
    if size > limits.max_frame_bytes:
        raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    if size + total > limits.max_message_bytes:
        raise FrameError(f"message of {size + total} bytes exceeds "
                         f"max_message_bytes={limits.max_message_bytes}")
    arr = np.empty(size, dtype=np.uint8)  # ucxx's Array is unsafe with bytearray
    out = arr.data
    PREFIX.pack_into(out, 0, MAGIC, VERSION, kind, nbuf, 0, len(payload), seq)
    if nbuf:
        table = arr[PREFIX.size:PREFIX.size + DESC.size * nbuf].view(_DESC_DTYPE)
        table["nbytes"] = [b[0] for b in buffers]
        table["off"] = offs
        table["device"] = [b[2] for b in buffers]
        table["pad"] = b""
    pos = PREFIX.size + DESC.size * nbuf
    out[pos:pos + len(payload)] = payload
    for off, view in inline:
        out[off:off + view.nbytes] = view
    out[size - MAC_LEN:] = mac(key, out[:head_len], size)
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
    magic, version, kind, nbuf, _, plen, seq = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"frame version {version} not supported (this side speaks {VERSION})")
    kind = _KINDS.get(kind)
    if kind is None:
        raise FrameError(f"unknown frame kind {PREFIX.unpack_from(data, 0)[2]}")
    if nbuf > limits.max_buffers:
        raise FrameError(f"frame declares {nbuf} buffers; the limit is {limits.max_buffers}")
    head_len = PREFIX.size + DESC.size * nbuf + plen
    if head_len + MAC_LEN > n:
        raise FrameError(f"truncated frame: header declares {head_len + MAC_LEN} bytes, got {n}")
    if key is not None and mac(key, data[:head_len], n) != bytes(data[n - MAC_LEN:]):
        raise FrameError("frame authentication failed (MAC mismatch)")
    payload = data[head_len - plen:head_len]
    if nbuf <= 8:  # numpy's fixed cost (~8 µs) only pays off for many buffers
        descs = []
        total = n
        for i in range(nbuf):
            nbytes, off, device = DESC.unpack_from(data, PREFIX.size + DESC.size * i)
            if off == NOT_INLINE:
                total += nbytes
            elif off < head_len or off + nbytes > n - MAC_LEN:
                raise FrameError(f"buffer {i} claims inline bytes [{off}, {off + nbytes}) "
                                 f"outside the {n}-byte frame")
            descs.append(BufferDesc(nbytes, off, device))
        return Frame(kind, seq, payload, tuple(descs), raw, total)
    table = np.frombuffer(data, dtype=_DESC_DTYPE, count=nbuf, offset=PREFIX.size)
    sizes, offs = table["nbytes"], table["off"]
    inline = offs != NOT_INLINE
    # Python ints: a lying size near 2**64 must not wrap around in uint64.
    bad = inline & ((offs < head_len) | (offs > n - MAC_LEN) | (sizes > n - MAC_LEN - offs))
    if bad.any():
        i = int(np.argmax(bad))
        off, nbytes = int(offs[i]), int(sizes[i])
        raise FrameError(f"buffer {i} claims inline bytes [{off}, {off + nbytes}) "
                         f"outside the {n}-byte frame")
    total = n + sum(sizes[~inline].tolist())
    table_descs = tuple(map(BufferDesc._make, zip(sizes.tolist(), offs.tolist(),
                                                  table["device"].tolist())))
    return Frame(kind, seq, payload, table_descs, raw, total)


def peek_seq(raw: np.ndarray) -> int | None:
    """Best-effort sequence number of a possibly broken frame, for logs."""
    try:
        return int(PREFIX.unpack_from(raw.data, 0)[6])
    except struct.error:
        return None
