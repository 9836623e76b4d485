"""The native core (csrc/, ucxrpc._core) as C code: its SipHash against
the reference vectors and a Python one, its reference counting, its
argument checks.  What the frames
mean is tests/transport/wire's and tests/fuzz's to hold."""

from __future__ import annotations

import gc
import os
import sys
import threading

import numpy as np
import pytest

from ucxrpc import _core
from ucxrpc.errors import FrameError
from ucxrpc.transport.wire.frame import FrameKind, Limits, decode, encode, mac

KEY = b"k" * 16

#: SipHash-2-4-128 of the bytes 0, 1, ..., n-1 under the key 0, 1, ..., 15:
#: the reference implementation's published vectors (vectors.h of
#: Aumasson and Bernstein's code), by n.
REFERENCE = {
    8: "3b62a9ba6258f5610f83e264f31497b4",
    9: "264499060ad9baabc47f8b02bb6d71ed",
    15: "5493e99933b0a8117e08ec0f97cfc3d9",
    16: "6ee2a4ca67b054bbfd3315bf85230577",
    17: "473d06e8738db89854c066c47ae47740",
    31: "2939b0183223fafc1723de4f52c43d35",
    32: "7c3956ca5eeafc3e363e9d556546eb68",
    63: "5150d1772f50834a503e069a973fbd7c",
}


def siphash128(key: bytes, msg: bytes) -> bytes:
    """SipHash-2-4-128 in Python, from the paper: the second reference,
    for lengths and keys the published vectors do not cover."""
    m64 = (1 << 64) - 1

    def rotl(x, b):
        return ((x << b) | (x >> (64 - b))) & m64

    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D ^ 0xEE,
         k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & m64; v[1] = rotl(v[1], 13) ^ v[0]; v[0] = rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & m64; v[3] = rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & m64; v[3] = rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & m64; v[1] = rotl(v[1], 17) ^ v[2]; v[2] = rotl(v[2], 32)

    whole = len(msg) - len(msg) % 8
    words = [int.from_bytes(msg[i:i + 8], "little") for i in range(0, whole, 8)]
    words.append(int.from_bytes(msg[whole:], "little") | (len(msg) & 0xFF) << 56)
    for w in words:
        v[3] ^= w
        rounds(2)
        v[0] ^= w
    v[2] ^= 0xEE
    rounds(4)
    first = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    rounds(4)
    return first.to_bytes(8, "little") + (v[0] ^ v[1] ^ v[2] ^ v[3]).to_bytes(8, "little")


@pytest.mark.parametrize("n", sorted(REFERENCE))
def test_the_mac_is_siphash_2_4_128_as_its_reference_vectors_say(n):
    """mac(key, head, size) hashes head and then size's 8 bytes: with the
    vector's last 8 bytes as size it is the vector's message."""
    key, msg = bytes(range(16)), bytes(range(n))
    assert mac(key, msg[:-8], int.from_bytes(msg[-8:], "little")).hex() == REFERENCE[n]
    assert siphash128(key, msg).hex() == REFERENCE[n]


def test_the_mac_equals_the_reference_for_every_length_around_the_word_edges():
    """The size's 8 bytes continue a word the head left unfinished, at
    every offset; large heads go through the GIL-free path."""
    key = os.urandom(16)
    data = os.urandom(3 * 64 + 2)
    for n in list(range(0, len(data) + 1)) + [(1 << 15) - 1, 1 << 15, (1 << 16) + 5]:
        head = data[:n] if n <= len(data) else os.urandom(n)
        for size in (0, n, 2**64 - 1):
            want = siphash128(key, head + size.to_bytes(8, "little"))
            assert mac(key, head, size) == want, (n, size)


@pytest.mark.parametrize("keylen", [0, 15, 17, 32])
def test_a_key_of_another_length_than_16_is_refused_by_name(keylen):
    with pytest.raises(ValueError, match=f"MAC key of {keylen} bytes; the frame MAC "
                                         r"\(SipHash-2-4\) takes 16"):
        mac(b"x" * keylen, b"", 0)


def test_large_macs_let_other_threads_run():
    """From 32 KiB the GIL is released while hashing, as hashlib does: the
    result must be the same whichever thread hashes, many at once."""
    head = os.urandom(1 << 20)
    want = siphash128(KEY, head + (7).to_bytes(8, "little"))
    got = []
    threads = [threading.Thread(target=lambda: got.append(mac(KEY, head, 7))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4


def test_encode_and_decode_keep_reference_counts_balanced():
    """Every object the core touches leaves with the count it came with,
    whether the call succeeds or raises."""
    limits = Limits(inline_threshold=1024)
    payload = b"p" * 100
    data = [np.arange(n, dtype=np.uint8) for n in (10, 2000, 0)]
    bufs = [(a.nbytes, memoryview(a), -1) for a in data]
    frame, _ = encode(FrameKind.MESSAGE, 1, payload, bufs, KEY, limits)
    watched = [payload, limits, KEY, frame, FrameKind.MESSAGE] + [b[1] for b in bufs]
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(2000):
        out, separate = encode(FrameKind.MESSAGE, 1, payload, bufs, KEY, limits, ack=3, busy=True)
        f = decode(frame, KEY, limits)
        del out, separate, f
        with pytest.raises(FrameError):
            decode(frame, b"wrong key, 16 b.", limits)
        with pytest.raises(FrameError):
            encode(FrameKind.MESSAGE, 1, payload, bufs, KEY, Limits(max_buffers=2))
    decode(frame, KEY, limits)  # the core keeps the last Limits it read, as before the loop
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before


def test_a_decoded_frames_payload_keeps_the_received_bytes_alive():
    frame, _ = encode(FrameKind.MESSAGE, 5, b"still here", [], KEY, Limits())
    payload = decode(frame, KEY, Limits()).payload
    del frame
    gc.collect()
    assert bytes(payload) == b"still here"


@pytest.mark.parametrize("call, message", [
    (lambda: encode(FrameKind.MESSAGE, 1, b""), "missing required argument 'buffers'"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [], KEY, Limits(), bogus=1),
     "unexpected keyword argument 'bogus'"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [], KEY, Limits(), None, seal=True, ways=None),
     "multiple values for argument 'ways'"),
    (lambda: encode(FrameKind.MESSAGE, -1, b"", [], KEY, Limits()), "seq must be an int"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [(1, None)], KEY, Limits()),
     "buffer 0 must be a 3-tuple"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [(5, memoryview(b"abc"), -1)], KEY, Limits()),
     "buffer 0: its view holds 3 bytes, its descriptor says 5"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [(1, None, -1)], KEY, Limits(), ways=[]),
     "ways must be a list or tuple, one per buffer"),
    (lambda: encode(FrameKind.MESSAGE, 1, b"", [], KEY, Limits(max_frame_bytes=-1)),
     "Limits.max_frame_bytes must be a non-negative int"),
    (lambda: decode(b"", KEY), "decode\\(\\) takes 3 arguments"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises((TypeError, ValueError, OverflowError), match=message):
        call()


def test_the_codec_serves_frames_of_every_buffer_count_it_can_describe():
    """The descriptor table of 65535 buffers (a frame's most) round trips;
    one more is refused before anything is built."""
    limits = Limits()
    bufs = [(i, None, 0) for i in range(65535)]
    frame, separate = encode(FrameKind.MESSAGE, 1, b"", bufs, KEY, limits)
    assert len(separate) == 65535
    f = decode(frame, KEY, limits)
    assert [d.nbytes for d in f.buffers[-3:]] == [65532, 65533, 65534]
    with pytest.raises(FrameError, match="65536 buffers"):
        encode(FrameKind.MESSAGE, 1, b"", bufs + [(1, None, 0)], KEY,
               Limits(max_buffers=1 << 20))


def test_the_core_is_the_only_codec():
    """One implementation: frame.py's encode and decode are the core's."""
    from ucxrpc.transport.wire import frame as module
    assert module.encode is _core.frame_encode
    assert module.decode is _core.frame_decode
    assert module.mac is _core.mac


def test_the_linger_timer_fires_once_and_disarms():
    # The progress thread's linger timer (csrc/timer.c): one expiry after
    # the time given, none once disarmed; bad arguments named.
    import select

    fd = _core.timer_new()
    try:
        poll = select.epoll()
        poll.register(fd, select.EPOLLIN)
        _core.timer_arm(fd, 0.01)
        assert poll.poll(10)  # it fired
        assert int.from_bytes(os.read(fd, 8), sys.byteorder) == 1
        _core.timer_arm(fd, 0.01)
        _core.timer_arm(fd, 0.0)  # disarmed before it fires
        assert not poll.poll(0.05)
        poll.close()
        with pytest.raises(ValueError, match="seconds must be >= 0"):
            _core.timer_arm(fd, -1.0)
        with pytest.raises(TypeError, match="takes 2 arguments"):
            _core.timer_arm(fd)  # type: ignore[call-arg]
    finally:
        os.close(fd)
