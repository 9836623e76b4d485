"""The native core's ``Inlet`` (csrc/receive.c; transport/receive.py's
``Receiver.taken``) as C code: which frames it hands to the agent itself
(plain messages, ones whose buffers are all inline or read by address,
and batches of plain ones) and which it hands back, unchanged,
to the Python; a bad frame judged, a
failing handler logged and the turn going on, a BaseException queueing
what was not looked at; reference counts balanced.  What the frames mean
on a live pipe is tests/transport's and tests/fuzz's to hold (every frame
taken there goes through it)."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest
import torch

from ucxrpc import _core
from ucxrpc.errors import AuthenticationError, FrameError
from ucxrpc.transport.pipe import Pipe
from ucxrpc.transport.receive import _inline_view
from ucxrpc.transport.wire import batch
from ucxrpc.transport.ucx.ucp import DONE
from ucxrpc.transport.wire.frame import REMOTE, FrameKind, Limits, encode
from ucxrpc.transport.wire.tags import (FRAME, HANDSHAKE, HINT_MASK, ID_MASK, ID_SHIFT,
                                        KIND_SHIFT, kind_base)

KEY = b"k" * 16


def _frame(seq: int, payload: bytes = b"hello", kind: FrameKind = FrameKind.MESSAGE,
           key: bytes = KEY, **kw: Any) -> np.ndarray:
    return encode(kind, seq, payload, [], key, Limits(), **kw)[0]


class _Receiver:
    """What the Inlet reads off its receiver, and hands back to it."""

    def __init__(self, limits: Limits = Limits(), max_message: int | None = None,
                 inline_view: Any = _inline_view, by_address: tuple | None = None) -> None:
        self.frames: list = []
        self.got: list[tuple[int, bytes, list]] = []
        self.queued: list[tuple] = []
        self.decoded: list[tuple] = []
        self.judged: list[tuple[Pipe, BaseException]] = []
        self.failed: list[tuple[Pipe, BaseException]] = []
        self.raise_in_handler: BaseException | None = None
        self.pipe = Pipe(3, "worker3", b"")
        self.pipe.auth.in_key = KEY
        self.inlet = _core.Inlet(
            receiver=self, pipes={3: self.pipe}, limits=limits,
            queue=lambda *a: self.queued.append(a), decoded=lambda *a: self.decoded.append(a),
            judged_bad=lambda pipe, exc: self.judged.append((pipe, exc)),
            handler_failed=lambda pipe, exc: self.failed.append((pipe, exc)),
            bad=(AuthenticationError, FrameError), message=FrameKind.MESSAGE,
            batch=FrameKind.BATCH, done=DONE, inline_view=inline_view,
            id_shift=ID_SHIFT, id_mask=ID_MASK, kind_shift=KIND_SHIFT, handshake=HANDSHAKE,
            hint_mask=HINT_MASK, max_frame=limits.max_frame_bytes,
            max_message=limits.max_message_bytes if max_message is None else max_message,
            by_address=by_address)

    def handled_here(self, seq: int, busy: bool, messages: int) -> None:
        """Every message went to the handler from the C, the pipe moved on."""
        inbound = self.pipe.inbound
        assert (inbound.seq, inbound.peer_busy, inbound.received) == (seq, busy, messages)
        assert (self.inlet.handled, self.inlet.passed) == (messages, 0)
        assert not (self.queued or self.decoded or self.judged)

    def _on_message(self, peer: int, payload: memoryview, buffers: list) -> None:
        if self.raise_in_handler is not None:
            raise self.raise_in_handler
        self.got.append((peer, bytes(payload), buffers))


def _batch(seq: int, payloads: list[bytes], buffers: int = -1, apart: bool = False,
           **kw: Any) -> np.ndarray:
    """A BATCH frame of messages, as a sender's outbox makes it (each
    message unsealed, its hint where its sequence number goes); message
    ``buffers`` carries a buffer of 0, 1, 2, 3: inline, or ``apart`` (no
    sender batches such a message)."""
    inner = []
    for i, p in enumerate(payloads):
        data = np.arange(4, dtype=np.uint8)
        views = [(4, None if apart else data.data, -1)] if i == buffers else []
        inner.append(encode(FrameKind.MESSAGE, 40 + i, p, views, b"", Limits(), seal=False)[0])
    return _frame(seq, batch.pack(inner), kind=FrameKind.BATCH, **kw)


def _tag(sender: int = 3, hint: int = 17) -> int:
    return kind_base(FRAME, sender) | hint


def test_a_plain_message_goes_to_the_handler_and_moves_the_pipe_on():
    rx = _Receiver()
    frame = _frame(1, busy=True)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    assert rx.got == [(3, b"hello", [])]
    rx.handled_here(seq=1, busy=True, messages=1)


@pytest.mark.parametrize("why", ["no pipe", "unauthenticated", "over max_frame", "handshake",
                                 "still arriving", "earlier frames wait"])
def test_a_frame_not_to_be_handled_at_once_is_queued_for_the_python(why):
    rx = _Receiver(Limits(max_frame_bytes=4096))
    frame = _frame(1)
    tag, length, req = _tag(), frame.nbytes, DONE
    if why == "no pipe":
        tag = _tag(sender=9)
    elif why == "unauthenticated":
        rx.pipe.auth.in_key = None
    elif why == "over max_frame":
        length = 5000
    elif why == "handshake":
        tag = (HANDSHAKE << KIND_SHIFT) | (3 << ID_SHIFT)
    elif why == "still arriving":
        req = object()
    else:
        rx.frames.append("an earlier turn's")
    rx.inlet.taken([(tag, length, req, frame)])
    (queued,) = rx.queued
    assert queued[:4] == (tag, length, req, frame)
    assert queued[4] == (tag >> ID_SHIFT) & ID_MASK
    assert queued[5] is (None if why == "no pipe" else rx.pipe)
    assert rx.got == [] and rx.pipe.inbound.seq == 0


@pytest.mark.parametrize("why", ["replay", "ack", "batch", "torn batch", "a buffer apart",
                                 "a device buffer", "inline and apart", "inline and too big",
                                 "too big", "ended"])
def test_a_frame_with_something_to_say_goes_to_the_python_decoded_and_unchanged(why):
    # (the Inlet's own max_message under the limits' for "too big")
    rx = _Receiver(Limits(max_message_bytes=1 << 20), max_message=64 if "big" in why else None)
    frame = _frame(5)
    if why == "replay":
        rx.pipe.inbound.seq = 5
    elif why == "ack":
        frame = _frame(5, ack=2)
    elif why == "batch":  # one of its messages has a buffer not inline
        frame = _batch(5, [b"a", b"b"], buffers=1, apart=True)
    elif why == "torn batch":  # its table claims more than it holds
        frame = _frame(5, kind=FrameKind.BATCH)
    elif why in ("a buffer apart", "a device buffer", "inline and apart"):
        t = np.arange(8, dtype=np.uint8)
        views = {"a buffer apart": [(8, None, -1)], "a device buffer": [(8, None, 0)],
                 "inline and apart": [(8, t.data, -1), (8, None, -1)]}[why]
        frame = encode(FrameKind.MESSAGE, 5, b"p", views, KEY, Limits())[0]
    elif why in ("too big", "inline and too big"):
        views = [(8, np.zeros(8, dtype=np.uint8).data, -1)] if why != "too big" else []
        # 144 bytes, or 8 bytes of payload and a buffer: over the 64 below
        frame = encode(FrameKind.MESSAGE, 5, b"x" * (100 if why == "too big" else 8), views,
                       KEY, Limits())[0]
    else:
        rx.pipe.inbound.abandoned = True
    rx.inlet.taken([(_tag(hint=33), frame.nbytes, DONE, frame)])
    (decoded,) = rx.decoded
    pipe, got, f, hint = decoded
    assert pipe is rx.pipe and got is frame and f.seq == 5 and hint == 33
    assert rx.got == [] and rx.pipe.inbound.received == 0
    assert rx.pipe.inbound.seq == (5 if why == "replay" else 0)


def test_a_message_whose_buffers_are_all_inline_goes_to_the_handler_with_views_of_its_frame():
    rx = _Receiver()
    a, b = np.arange(16, dtype=np.uint8), np.full(3000, 7, dtype=np.uint8)
    frame, separate = encode(FrameKind.MESSAGE, 1, b"two", [(16, a.data, -1), (3000, b.data, -1)],
                             KEY, Limits(), busy=True)
    assert separate == []
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame), (_tag(), 0, DONE, _frame(2))])
    (peer, payload, bufs), plain = rx.got
    assert (peer, payload, plain) == (3, b"two", (3, b"hello", []))
    assert [t.tolist() for t in bufs] == [a.tolist(), b.tolist()]
    start, end = frame.ctypes.data, frame.ctypes.data + frame.nbytes
    assert all(t.dtype == torch.uint8 and start <= t.data_ptr() < end
               for t in bufs)  # views of the frame received, not copies
    rx.handled_here(seq=2, busy=False, messages=2)


def test_a_failing_inline_view_ends_the_call_with_nothing_moved_on():
    def broken(frame: Any, where: int, nbytes: int) -> Any:
        raise MemoryError("no room for a view")

    rx = _Receiver(inline_view=broken)
    frame = encode(FrameKind.MESSAGE, 1, b"p", [(8, np.zeros(8, np.uint8).data, -1)], KEY,
                   Limits())[0]
    after = _frame(2)
    with pytest.raises(MemoryError, match="no room"):
        rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame), (_tag(), after.nbytes, DONE, after)])
    assert rx.got == [] and rx.pipe.inbound.seq == 0 and rx.pipe.inbound.received == 0
    assert [q[3] is after for q in rx.queued] == [True]  # the rest kept, as ever


def test_a_batch_of_plain_messages_goes_to_the_handler_message_by_message():
    rx = _Receiver()
    frame = _batch(4, [b"one", b"two", b"three"], busy=True)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame), (_tag(), 0, DONE, _frame(5))])
    assert rx.got == [(3, b"one", []), (3, b"two", []), (3, b"three", []), (3, b"hello", [])]
    rx.handled_here(seq=5, busy=False, messages=4)


def test_a_batch_with_inline_buffers_goes_to_the_handler_with_views_of_its_frame():
    rx = _Receiver()
    frame = _batch(4, [b"one", b"two", b"three"], buffers=1)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    assert [(p, len(b)) for _, p, b in rx.got] == [(b"one", 0), (b"two", 1), (b"three", 0)]
    (view,) = rx.got[1][2]
    assert view.tolist() == [0, 1, 2, 3]
    assert frame.ctypes.data <= view.data_ptr() < frame.ctypes.data + frame.nbytes
    assert (rx.inlet.handled, rx.inlet.passed, rx.pipe.inbound.received) == (3, 0, 3)
    assert not (rx.queued or rx.decoded or rx.judged)


def test_a_batch_goes_on_past_a_failing_handler_and_stops_where_the_pipe_ended():
    rx = _Receiver()
    calls = []

    def handler(peer: int, payload: memoryview, buffers: list) -> None:
        calls.append(bytes(payload))
        if payload == b"b":
            raise ValueError("the agent failed")
        if payload == b"c":
            rx.pipe.inbound.abandoned = True  # as a pipe that broke meanwhile

    rx._on_message = handler  # type: ignore[method-assign]
    frame = _batch(1, [b"a", b"b", b"c", b"d"])
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    assert calls == [b"a", b"b", b"c"]  # "d" dropped: its pipe ended (as _hand_on drops it)
    assert [type(e) for _, e in rx.failed] == [ValueError]
    assert rx.pipe.inbound.received == 3 and rx.pipe.inbound.seq == 1


def test_a_frame_that_fails_its_mac_is_judged_and_the_next_is_handled():
    rx = _Receiver()
    bad, good = _frame(1, key=b"x" * 16), _frame(2)
    rx.inlet.taken([(_tag(), bad.nbytes, DONE, bad), (_tag(), good.nbytes, DONE, good)])
    ((pipe, exc),) = rx.judged
    assert pipe is rx.pipe and isinstance(exc, FrameError) and "MAC" in str(exc)
    assert [m[1] for m in rx.got] == [b"hello"] and rx.pipe.inbound.seq == 2


def test_a_handler_that_raises_is_logged_and_the_turn_goes_on():
    rx = _Receiver()
    rx.raise_in_handler = ValueError("the agent failed")
    frames = [_frame(1), _frame(2)]
    rx.inlet.taken([(_tag(), f.nbytes, DONE, f) for f in frames])
    assert [type(e) for _, e in rx.failed] == [ValueError, ValueError]
    assert rx.failed[0][1].__traceback__ is not None  # logged with where it was raised
    assert rx.pipe.inbound.received == 2


def test_a_base_exception_from_a_handler_ends_the_call_with_the_rest_queued():
    rx = _Receiver()
    rx.raise_in_handler = KeyboardInterrupt()
    frames = [_frame(1), _frame(2), _frame(3)]
    with pytest.raises(KeyboardInterrupt):
        rx.inlet.taken([(_tag(), f.nbytes, DONE, f) for f in frames])
    assert [q[3] is f for q, f in zip(rx.queued, frames[1:])] == [True, True]
    assert rx.pipe.inbound.seq == 1


def test_every_path_keeps_reference_counts_balanced():
    rx = _Receiver(Limits(max_frame_bytes=4096))
    plain, bad, torn = _frame(1), _frame(1, key=b"x" * 16), _frame(1, kind=FrameKind.BATCH)
    plains, mixed = _batch(1, [b"a", b"b"]), _batch(1, [b"a", b"b"], buffers=1)
    apart = _batch(1, [b"a", b"b"], buffers=0, apart=True)
    inline = encode(FrameKind.MESSAGE, 1, b"p", [(8, np.zeros(8, np.uint8).data, -1)], KEY,
                    Limits())[0]
    failure = ValueError("the agent failed")
    watched = [rx.pipe, plain, bad, torn, plains, mixed, apart, inline, failure, DONE]

    def rounds(n: int) -> None:
        for _ in range(n):
            rx.pipe.inbound.seq = 0
            rx.inlet.taken([(_tag(), plain.nbytes, DONE, plain),
                            (_tag(), bad.nbytes, DONE, bad),
                            (_tag(), torn.nbytes, DONE, torn),
                            (_tag(sender=9), plain.nbytes, DONE, plain)])
            for frame in (plains, mixed, apart, inline):
                rx.pipe.inbound.seq = 0
                rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
            rx.pipe.inbound.seq = 0
            rx.raise_in_handler = failure
            rx.inlet.taken([(_tag(), plains.nbytes, DONE, plains)])
            rx.raise_in_handler = None
            rx.pipe.inbound.seq = 0
            rx.raise_in_handler = failure
            rx.inlet.taken([(_tag(), plain.nbytes, DONE, plain)])
            rx.raise_in_handler = KeyboardInterrupt()
            rx.pipe.inbound.seq = 0
            with pytest.raises(KeyboardInterrupt):
                rx.inlet.taken([(_tag(), plain.nbytes, DONE, plain),
                                (_tag(), plain.nbytes, DONE, plain)])
            rx.raise_in_handler = None
            failure.__traceback__ = None
            for lst in (rx.got, rx.queued, rx.decoded, rx.judged, rx.failed):
                lst.clear()

    rounds(3)
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    rounds(300)
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before


def test_bad_arguments_are_named():
    rx = _Receiver()
    with pytest.raises(TypeError, match="a list of taken frames"):
        rx.inlet.taken(())
    with pytest.raises(TypeError, match=r"\(tag, length, req, got\)"):
        rx.inlet.taken([(1, 2)])
    with pytest.raises(TypeError, match="missing argument 'receiver'"):
        _core.Inlet()


# ------------------------------------------------------------ by address
#
# The peer is this process: process_vm_readv reads our own memory by our
# PID as it reads a sibling's (where the kernel refuses even that, these
# skip: hostmem/cma.py's probe says why).

_PAGE = 4096


class _Reads:
    """What the Inlet's by_address hands to: ByAddress.on_ack, the receive
    pool's alloc, ByAddress.due."""

    def __init__(self) -> None:
        self.acks: list[tuple[Pipe, int]] = []
        self.allocs: list[tuple[int, int]] = []
        self.due: dict = {}
        self.ack_raises: BaseException | None = None
        self.alloc_raises: BaseException | None = None

    def on_ack(self, pipe: Pipe, ack: int) -> None:
        if self.ack_raises is not None:
            raise self.ack_raises
        self.acks.append((pipe, ack))
        pipe.cma.acked = ack

    def alloc(self, nbytes: int, phase: int) -> torch.Tensor:
        if self.alloc_raises is not None:
            raise self.alloc_raises
        self.allocs.append((nbytes, phase))
        room = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        skip = (phase - room.data_ptr()) % _PAGE
        return room[skip:skip + nbytes]


def _reading(read_max: int = 2 << 20) -> tuple[_Receiver, _Reads]:
    import os
    from ucxrpc.transport.hostmem import cma
    if cma.offer() is None or cma.probe(os.getpid(), cma.parse(cma.offer())) is not None:
        pytest.skip("this kernel does not let a process read itself by address")
    reads = _Reads()
    rx = _Receiver(by_address=(reads.on_ack, reads.alloc, reads.due, read_max, _PAGE))
    rx.pipe.cma.reads = True
    rx.pipe.cma.pid = os.getpid()
    return rx, reads


def _remote_frame(seq: int, source: np.ndarray, inline: np.ndarray | None = None,
                  address: int | None = None, ack: int = 0) -> np.ndarray:
    views = [] if inline is None else [(inline.nbytes, inline.data, -1)]
    ways = [] if inline is None else [(0, 0, 0)]
    views.append((source.nbytes, None, -1))
    ways.append((REMOTE, 0, source.ctypes.data if address is None else address))
    return encode(FrameKind.MESSAGE, seq, b"msg", views, KEY, Limits(), ways, ack=ack)[0]


def test_a_message_with_a_buffer_by_address_is_read_here_and_handed_on():
    rx, reads = _reading()
    source = (np.arange(300 << 10) % 251).astype(np.uint8)[5:]  # not on a page boundary
    small = np.arange(16, dtype=np.uint8)
    frame = _remote_frame(1, source, small, ack=0)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    ((peer, payload, (view, read)),) = rx.got
    assert (peer, payload) == (3, b"msg") and view.tolist() == small.tolist()
    assert np.array_equal(read.numpy(), source)  # copied, not a view of the source
    assert read.data_ptr() != source.ctypes.data
    assert reads.allocs == [(source.nbytes, source.ctypes.data % _PAGE)]  # the sender's phase
    assert read.data_ptr() % _PAGE == source.ctypes.data % _PAGE
    # The word that we read it: due, unless a frame carries it first.
    assert rx.pipe.cma.read_through == 1 and list(reads.due) == [rx.pipe]
    assert rx.inlet.read_bytes == source.nbytes
    rx.handled_here(seq=1, busy=False, messages=1)


def test_an_acknowledgement_lets_our_buffers_go_and_the_message_is_handled_here():
    rx, reads = _reading()
    rx.pipe.cma.ack_sent = 7  # (our word on its buffers went already)
    frame = _frame(1, ack=4)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    assert reads.acks == [(rx.pipe, 4)] and rx.got == [(3, b"hello", [])]
    assert reads.due == {}
    rx.handled_here(seq=1, busy=False, messages=1)
    # One it has heard already is not told again.
    again = _frame(2, ack=4)
    rx.inlet.taken([(_tag(), again.nbytes, DONE, again)])
    assert reads.acks == [(rx.pipe, 4)]


def test_an_acknowledgement_by_address_refuses_is_the_frames_error():
    rx, reads = _reading()
    reads.ack_raises = FrameError("worker3 acknowledged our frame 9, but we sent 0")
    frame = _frame(1, ack=9)
    rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
    assert rx.judged == [(rx.pipe, reads.ack_raises)] and rx.got == []


@pytest.mark.parametrize("why", ["the read fails", "the allocation fails", "we never read it",
                                 "from read_max", "no by_address"])
def test_a_buffer_by_address_that_cannot_be_read_here_goes_to_the_python_unchanged(why):
    rx, reads = _reading(read_max=(300 << 10) if why == "from read_max" else 2 << 20)
    if why == "no by_address":
        rx = _Receiver()
    source = np.ones(300 << 10, dtype=np.uint8)
    address = None
    if why == "the read fails":
        address = 4096  # nothing is mapped there: EFAULT
    elif why == "the allocation fails":
        reads.alloc_raises = MemoryError("no room")
    elif why == "we never read it":
        rx.pipe.cma.reads = False
    frame = _remote_frame(5, source, address=address)
    rx.inlet.taken([(_tag(hint=33), frame.nbytes, DONE, frame)])
    (decoded,) = rx.decoded
    assert decoded[0] is rx.pipe and decoded[1] is frame and decoded[3] == 33
    assert rx.got == [] and rx.pipe.inbound.seq == 0 and rx.pipe.cma.read_through == 0
    assert reads.due == {} and rx.inlet.read_bytes == 0


def test_reading_by_address_keeps_reference_counts_balanced():
    rx, reads = _reading()
    source = np.ones(300 << 10, dtype=np.uint8)
    good, bad = _remote_frame(1, source, ack=1), _remote_frame(1, source, address=4096)
    failure = FrameError("refused")
    watched = [rx.pipe, good, bad, failure, DONE]

    def rounds(n: int) -> None:
        for _ in range(n):
            for frame, raises in ((good, None), (bad, None), (good, failure)):
                rx.pipe.inbound.seq = rx.pipe.cma.acked = 0
                reads.ack_raises = raises
                rx.inlet.taken([(_tag(), frame.nbytes, DONE, frame)])
            failure.__traceback__ = None
            reads.due.clear()
            for lst in (rx.got, rx.decoded, rx.judged, reads.acks, reads.allocs):
                lst.clear()

    rounds(3)
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    rounds(200)
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before
