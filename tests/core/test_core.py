"""The native core (csrc/, ucxrpc._core) as C code: its BLAKE2b against
hashlib's, its reference counting, its argument checks.  What the frames
mean is tests/transport/wire's and tests/fuzz's to hold."""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading

import numpy as np
import pytest

from ucxrpc import _core
from ucxrpc.errors import FrameError
from ucxrpc.transport.wire.frame import FrameKind, Limits, decode, encode, mac

KEY = b"k" * 32


@pytest.mark.parametrize("keylen", [0, 1, 32, 63, 64])
def test_blake2b_equals_hashlib_for_every_length_around_the_block_edges(keylen):
    """RFC 7693 written out: a block is 128 bytes, the key one block of its
    own, the last block compressed with the final flag; every length up to
    three blocks, plus large ones, must give hashlib's digest."""
    key = os.urandom(keylen)
    data = os.urandom(3 * 128 + 2)
    for n in list(range(0, len(data) + 1)) + [1 << 13, (1 << 16) + 5]:
        head = data[:n] if n <= len(data) else os.urandom(n)
        for size in (0, n, 2**64 - 1):
            want = hashlib.blake2b(head, key=key, digest_size=16)
            want.update(size.to_bytes(8, "little"))
            assert mac(key, head, size) == want.digest(), (keylen, n, size)


def test_a_key_longer_than_blake2b_takes_is_refused_by_name():
    with pytest.raises(ValueError, match="MAC key of 65 bytes; at most 64"):
        mac(b"x" * 65, b"", 0)


def test_large_macs_let_other_threads_run():
    """Over 8 KiB the GIL is released while hashing, as hashlib does: the
    result must be the same whichever thread hashes, many at once."""
    head = os.urandom(1 << 20)
    want = hashlib.blake2b(head, key=KEY, digest_size=16)
    want.update((7).to_bytes(8, "little"))
    got = []
    threads = [threading.Thread(target=lambda: got.append(mac(KEY, head, 7))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want.digest()] * 4


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
            decode(frame, b"wrong key", limits)
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
