"""The transport frame (ucxrpc/transport/wire/frame.py): round trips, the
prefix's fields under the MAC, limits, descriptors of every kind, bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ucxrpc.errors import FrameError
from ucxrpc.transport.wire.frame import (BUSY, DESC, MAC_LEN, NOT_INLINE, PREFIX, FrameKind, Limits,
                                         check_limits, decode, encode, mac)

KEY = b"k" * 16


def _bufs(*sizes: int, device: int = -1):
    out = []
    for n in sizes:
        a = np.arange(n, dtype=np.uint8)
        out.append((n, memoryview(a), device))
    return out


def test_frame_round_trip_inlines_small_buffers_only():
    limits = Limits(inline_threshold=1024)
    frame, separate = encode(FrameKind.MESSAGE, 7, b"payload", _bufs(10, 2000, 0), KEY, limits)
    assert separate == [1]
    f = decode(frame, KEY, limits)
    assert (f.kind, f.seq, bytes(f.payload)) == (FrameKind.MESSAGE, 7, b"payload")
    assert [d.nbytes for d in f.buffers] == [10, 2000, 0]
    assert f.buffers[1].where == NOT_INLINE
    d0 = f.buffers[0]
    assert d0.where % 64 == 0
    assert bytes(frame[d0.where:d0.where + 10]) == bytes(range(10))
    assert f.total == frame.nbytes + 2000


def test_the_acknowledgement_rides_in_the_prefix_under_the_mac():
    """Every frame says how far its sender read the receiver's frames by
    address (frame.py's ``ack``); a frame that says nothing says 0."""
    frame, _ = encode(FrameKind.MESSAGE, 9, b"reply", _bufs(10), KEY, Limits(), ack=2**64 - 1)
    assert decode(frame, KEY, Limits()).ack == 2**64 - 1
    plain, _ = encode(FrameKind.CMA_DONE, 10, b"", [], KEY, Limits())
    assert decode(plain, KEY, Limits()).ack == 0
    forged = frame.copy()
    forged[PREFIX.size - 8] ^= 1  # the ack's lowest byte
    with pytest.raises(FrameError, match="MAC mismatch"):
        decode(forged, KEY, Limits())


def test_the_senders_state_rides_in_the_prefix_under_the_mac():
    """Every frame says whether its sender's loop may not poll (frame.py's
    ``state``: BUSY); bits this side does not know are refused."""
    frame, _ = encode(FrameKind.MESSAGE, 3, b"x", [], KEY, Limits(), busy=True)
    assert decode(frame, KEY, Limits()).busy
    assert not decode(encode(FrameKind.MESSAGE, 4, b"x", [], KEY, Limits())[0], KEY, Limits()).busy
    forged = frame.copy()
    forged[6] ^= BUSY  # the state's low byte, after magic, version, kind, nbuf
    with pytest.raises(FrameError, match="MAC mismatch"):
        decode(forged, KEY, Limits())
    unknown, _ = encode(FrameKind.MESSAGE, 5, b"x", [], KEY, Limits())
    unknown[6] = 0x02  # sealed anew: refused for the bit, not the MAC
    head = unknown[:PREFIX.size + len(b"x")]
    unknown[-MAC_LEN:] = np.frombuffer(mac(KEY, head.data, unknown.nbytes), dtype=np.uint8)
    with pytest.raises(FrameError, match="unknown frame state bits 0x0002"):
        decode(unknown, KEY, Limits())


def test_device_buffers_never_inline():
    frame, separate = encode(FrameKind.MESSAGE, 1, b"", [(16, None, 0)], KEY, Limits())
    assert separate == [0]
    assert decode(frame, KEY, Limits()).buffers[0].device == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f[:10], "truncated frame"),
    (lambda f: np.concatenate([np.frombuffer(b"XX", np.uint8), f[2:]]), "bad frame magic"),
    (lambda f: _set(f, 2, 99), "frame version 99 not supported"),
    (lambda f: _set(f, 3, 77), "unknown frame kind 77"),
    (lambda f: _set(f, 30, f[30] ^ 1), "MAC mismatch"),
])
def test_malformed_frames_raise_clear_errors(mutate, message):
    frame, _ = encode(FrameKind.MESSAGE, 3, b"hello", _bufs(8), KEY, Limits())
    with pytest.raises(FrameError, match=message):
        decode(mutate(frame), KEY, Limits())


def _set(a: np.ndarray, i: int, v: int) -> np.ndarray:
    b = a.copy()
    b[i] = v
    return b


@pytest.mark.parametrize("count", [1, 20])  # the per-struct and the numpy coders
def test_wheres_outside_the_frame_are_refused(count):
    frame, _ = encode(FrameKind.MESSAGE, 3, b"p", _bufs(*([8] * count)), KEY, Limits())
    off = PREFIX.size + DESC.size * (count - 1) + 8  # the last descriptor's where field
    bad = frame.copy()
    bad[off:off + 8] = np.frombuffer((10**6).to_bytes(8, "little"), np.uint8)
    with pytest.raises(FrameError, match=f"buffer {count - 1} claims inline bytes"):
        decode(bad, None, Limits())
    assert len(decode(frame, None, Limits()).buffers) == count


def test_unknown_kind_and_lying_sizes_without_mac():
    frame, _ = encode(FrameKind.MESSAGE, 3, b"hello", [], KEY, Limits())
    with pytest.raises(FrameError, match="unknown frame kind 77"):
        decode(_set(frame, 3, 77), None, Limits())
    with pytest.raises(FrameError, match="truncated frame: header declares"):
        decode(_set(frame, 8, 200), None, Limits())  # payload_len says 200+


def test_limits_checked_on_both_sides():
    with pytest.raises(FrameError, match="3 buffers; the limit is 2"):
        encode(FrameKind.MESSAGE, 1, b"", _bufs(1, 1, 1), KEY, Limits(max_buffers=2))
    with pytest.raises(FrameError, match="exceeds max_message_bytes=100"):
        encode(FrameKind.MESSAGE, 1, b"", [(1000, None, 0)], KEY, Limits(max_message_bytes=100))
    with pytest.raises(FrameError, match="exceeds max_frame_bytes=64"):
        encode(FrameKind.MESSAGE, 1, b"x" * 100, [], KEY, Limits(max_frame_bytes=64))
    frame, _ = encode(FrameKind.MESSAGE, 1, b"", _bufs(1, 1, 1), KEY, Limits())
    with pytest.raises(FrameError, match="declares 3 buffers; the limit is 2"):
        decode(frame, KEY, Limits(max_buffers=2))


def test_inlining_stays_within_the_receivers_frame_limit():
    """Small buffers that would push the frame over the receiver's limit go
    separately, so only the header can make a frame too big for it."""
    limits = Limits(inline_threshold=1024)
    frame, separate = encode(FrameKind.MESSAGE, 1, b"p", _bufs(*[1000] * 6), KEY, limits,
                             peer_max_frame=2500)
    assert frame.nbytes <= 2500
    assert 0 < len(separate) < 6
    f = decode(frame, KEY, Limits(max_frame_bytes=2500))
    assert [d.nbytes for d in f.buffers] == [1000] * 6


@pytest.mark.parametrize("args, message", [
    ((10, 3, 0, Limits(max_buffers=2)), "message has 3 buffers; the limit is 2"),
    ((5000, 0, 0, Limits(max_frame_bytes=4096)), "exceeds max_frame_bytes=4096$"),
    ((5000, 0, 0, Limits(), 4096, "worker3"),
     "exceeds max_frame_bytes=4096 of the receiver \\(worker3\\)"),
    ((10, 1, 1 << 20, Limits(max_message_bytes=1 << 20)),
     "message of 1048654 bytes exceeds max_message_bytes=1048576"),
])
def test_limits_checked_before_encoding(args, message):
    with pytest.raises(FrameError, match=message):
        check_limits(*args)
    check_limits(10, 1, 100, Limits(), 4096, "worker3")  # within every limit


def test_random_bytes_never_decode():
    for n in (0, 5, 19, 64, 500):
        with pytest.raises(FrameError):
            decode(np.frombuffer(os.urandom(n), np.uint8), KEY, Limits())


# ------------------------------------------------- staged and packed buffers

from ucxrpc.transport.wire.frame import PACK, PACKED, REMOTE, STAGED  # noqa: E402


@pytest.mark.parametrize("extra", [0, 12])  # the per-struct and the numpy coders
def test_staged_and_packed_descriptors_round_trip(extra):
    pack = 3 + extra  # packs come after every ordinary buffer
    bufs = ([(5 << 20, None, 0), (100, None, 0), (28, None, 0)] + _bufs(*([8] * extra))
            + [(192, None, 0)])
    ways = ([(STAGED, 4096, 0), (PACKED, pack, 0), (PACKED, pack, 128)]
            + [(0, 0, 0)] * extra + [(PACK | STAGED, 64, 0)])
    frame, separate = encode(FrameKind.MESSAGE, 1, b"p", bufs, KEY, Limits(), ways)
    assert separate == [0, pack]  # packed members are never sent themselves
    f = decode(frame, KEY, Limits())
    assert f.nbuf == f.delivered == pack
    assert f.buffers[0].flags == STAGED and f.buffers[0].arg == 4096 and not f.buffers[0].inline
    assert [(d.flags, d.arg, d.where) for d in f.buffers[1:3]] == \
        [(PACKED, pack, 0), (PACKED, pack, 128)]
    assert all(d.inline for d in f.buffers[3:pack])
    assert f.total == frame.nbytes + (5 << 20) + 192


@pytest.mark.parametrize("ways, sizes, message", [
    ([(32, 0, 0)], [10], "buffer 0 has unknown flags 0x20"),
    ([(REMOTE | STAGED, 64, 0)], [10], "buffer 0 has unknown flags 0x9"),
    ([(STAGED, 4, 0)], [10], "staged in chunks of 4 KiB; the minimum is 64 KiB"),
    ([(PACK, 0, 0), (0, 0, 0)], [10, 10], "buffer 1: packs must come after every other buffer"),
    ([(PACKED, 0, 0)], [10], "buffer 0 claims to sit in buffer 0, which is not a pack"),
    ([(PACKED, 1, 60), (PACK, 0, 0)], [10, 64], r"buffer 0 claims bytes \[60, 70\)"),
])
@pytest.mark.parametrize("extra", [0, 12])
def test_malformed_staged_and_packed_descriptors_are_refused(ways, sizes, message, extra):
    if extra:  # the numpy decoder: ordinary buffers first, then the case
        ways = [(0, 0, 0)] * extra + [(f, a + extra if f == PACKED else a, o)
                                      for f, a, o in ways]
        sizes = [8] * extra + sizes
        message = message.replace("buffer 0 ", f"buffer {extra} ").replace(
            "buffer 1:", f"buffer {extra + 1}:").replace("in buffer 0,", f"in buffer {extra},")
    bufs = [(n, memoryview(np.zeros(n, np.uint8)) if not w[0] else None, 0 if w[0] else -1)
            for n, w in zip(sizes, ways)]
    frame, _ = encode(FrameKind.MESSAGE, 1, b"p", bufs, KEY, Limits(), ways)
    with pytest.raises(FrameError, match=message):
        decode(frame, KEY, Limits())


def test_remote_descriptors_round_trip_and_host_memory_only():
    limits = Limits()
    views = [(10, None, -1), (1 << 22, None, -1)]
    frame, separate = encode(FrameKind.MESSAGE, 1, b"p", views, b"k" * 16, limits,
                             [(0, 0, 0), (REMOTE, 0, 0x7F00_1234_5678)])
    assert separate == [0]  # a REMOTE buffer sends nothing
    got = decode(frame, b"k" * 16, limits)
    assert got.buffers[1].flags == REMOTE and got.buffers[1].where == 0x7F00_1234_5678
    assert got.total == frame.nbytes + 10 + (1 << 22)
    bad, _ = encode(FrameKind.MESSAGE, 1, b"p", [(1 << 22, None, 0)], b"k" * 16, limits,
                    [(REMOTE, 0, 4096)])
    with pytest.raises(FrameError, match="read by address from device 0"):
        decode(bad, b"k" * 16, limits)
