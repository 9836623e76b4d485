"""The native core's ``Outlet`` (csrc/send.c; transport/send.py's send of a
message without buffers, or with inline ones or ones by address only) as
C code: the frame it
makes is ``encode``'s, byte for byte, and so is what it puts in an outbox
(``Sender._queue_small``'s); what it declines it leaves untouched; the pipe's lock and
the thread's guard are given back on every path; reference counts stay
balanced.  What the frames mean on a live pipe is tests/transport's and
tests/fuzz's to hold (every message without buffers there goes through
it)."""

from __future__ import annotations

import gc
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
import torch

from ucxrpc import _core
from ucxrpc.errors import FrameError
from ucxrpc.transport.pipe import OutState, Pipe
from ucxrpc.transport.ucx.ucp import DONE
from ucxrpc.transport.wire import batch
from ucxrpc.transport.wire.frame import REMOTE, FrameKind, Limits, decode, encode
from ucxrpc.transport.wire.tags import HINT_MASK

KEY = b"k" * 16
BASE = 7 << 56


class _Request:
    def __init__(self, done: bool, error: BaseException | None = None) -> None:
        self.done = done
        self._error = error

    def error(self) -> BaseException | None:
        return self._error


class _Endpoint:
    """What a pipe's endpoint is to the outlet: ``send_frame(frame, tag)``."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int]] = []
        self.answer: Any = DONE
        self.refuse: BaseException | None = None

    def send_frame(self, frame: bytes, tag: int) -> Any:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append((frame, tag))
        return self.answer


class _Strategy:
    blocked_until = 0.0


class _Rig:
    def __init__(self, limits: Limits = Limits(), inline_max: int = 64 << 10,
                 batching: bool = True,
                 by_address: tuple[int, int, int] | None = None) -> None:
        self.pipe = Pipe(1, "worker1", b"")
        self.pipe.ep = self.ep = _Endpoint()  # type: ignore[assignment]
        self.pipe.out.state = OutState.OPEN
        self.pipe.auth.out_key = KEY
        self.pipe.cma.read_through = 5
        self.inflight: deque = deque()
        self.woken = 0
        self.failures: list[tuple[Pipe, BaseException]] = []
        self.strategy = _Strategy()
        self.flushed: list[list[bytes]] = []
        self.holding: set[Pipe] = set()
        self.outlet = _core.Outlet(
            pipes={1: self.pipe}, limits=limits, strategy=self.strategy,
            inflight=self.inflight, wake=self._wake,
            failed=lambda pipe, exc: self.failures.append((pipe, exc)),
            open=OutState.OPEN, done=DONE, tensor=torch.Tensor, uint8=torch.uint8,
            flush=self._flush, frame_base=BASE, hint_mask=HINT_MASK,
            message_kind=FrameKind.MESSAGE, inline_max=inline_max,
            batch=(batch.MAX_ITEM, batch.MAX_MESSAGES, batch.MAX_BYTES, batch.BASE)
            if batching else None, by_address=by_address, holding=self.holding)

    def _flush(self, pipe: Pipe) -> None:
        """Sender.flush's bookkeeping (the BATCH frame's sending aside)."""
        assert pipe.lock.locked()
        self.flushed.append(list(pipe.out.outbox))
        pipe.out.outbox, pipe.out.outbox_bytes = [], 0

    def _wake(self) -> None:
        self.woken += 1


def test_the_frame_is_encodes_byte_for_byte_with_the_pipes_sequence_ack_and_busy_flag():
    rig = _Rig()
    rig.strategy.blocked_until = time.monotonic() + 60  # the loop may not poll
    assert rig.outlet.send(1, 42 | (1 << 60), b"head:", b"body") is True
    (frame, tag), = rig.ep.sent
    assert tag == BASE | 42  # the hint masked
    want, _ = encode(FrameKind.MESSAGE, 1, b"head:body", [], KEY, Limits(), ack=5, busy=True)
    assert frame == want.tobytes()
    got = decode(np.frombuffer(frame, dtype=np.uint8), KEY, Limits())
    assert (got.seq, bytes(got.payload), got.ack, got.busy) == (1, b"head:body", 5, True)
    out = rig.pipe.out
    assert (out.seq, out.sent, out.last_frame, rig.pipe.cma.ack_sent) == (1, 1, None, 5)
    assert (rig.outlet.sent, rig.outlet.declined) == (1, 0)


def _bytes(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64).to(torch.uint8)


def test_buffers_that_all_go_inline_make_encodes_frame_byte_for_byte():
    rig = _Rig()
    bufs = [_bytes(5), _bytes(0), _bytes(3000, 7), _bytes(64 << 10, 1)]
    assert rig.outlet.send(1, 42, b"head:", b"body", bufs) is True
    (frame, tag), = rig.ep.sent
    views = [(b.numel(), b.numpy().data, -1) for b in bufs]
    want, separate = encode(FrameKind.MESSAGE, 1, b"head:body", views, KEY, Limits(), ack=5)
    assert separate == [] and frame == want.tobytes() and tag == BASE | 42
    got = decode(np.frombuffer(frame, dtype=np.uint8), KEY, Limits())
    assert [bytes(frame[d.where:d.where + d.nbytes]) for d in got.buffers] == \
        [bytes(b.numpy()) for b in bufs]
    assert (rig.pipe.out.seq, rig.pipe.out.sent, rig.outlet.sent) == (1, 1, 1)


@pytest.mark.parametrize("why", ["over inline_max", "over the limits' inline_threshold",
                                 "over inline_total", "over the peer's max frame", "not bytes",
                                 "not contiguous",
                                 "a subclass", "a gather", "none taken"])
def test_buffers_that_would_not_all_go_inline_are_declined_untouched(why):
    rig = _Rig(Limits(inline_threshold=8192, inline_total=16384),
               inline_max={"none taken": 0, "over inline_max": 6000}.get(why, 10000))
    bufs: list = [_bytes(100), _bytes(4000)]
    if why == "over inline_max":
        bufs.append(_bytes(7000))
    elif why == "over the limits' inline_threshold":
        bufs.append(_bytes(9000))
    elif why == "over inline_total":
        bufs += [_bytes(8000), _bytes(8000)]
    elif why == "over the peer's max frame":
        rig.pipe.out.peer_max_frame = 4096
    elif why == "not bytes":
        bufs.append(torch.zeros(4, dtype=torch.float32))
    elif why == "not contiguous":
        bufs.append(_bytes(64)[::2])
    elif why == "a subclass":
        bufs.append(torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False))
    elif why == "a gather":
        bufs.append(object())
    assert rig.outlet.send(1, 0, b"h", b"b", bufs) is False
    assert (rig.pipe.out.seq, rig.pipe.out.sent, rig.ep.sent) == (0, 0, [])
    assert not rig.pipe.lock.locked() and not _core.turning()
    assert (rig.outlet.sent, rig.outlet.declined) == (0, 1)
    # An empty list is no buffers at all.
    assert rig.outlet.send(1, 0, b"h", b"b", []) is True


def test_a_message_over_max_message_with_its_inline_buffers_is_a_frame_error():
    rig = _Rig(Limits(max_message_bytes=6000))
    with pytest.raises(FrameError, match="message of .* exceeds max_message_bytes=6000"):
        rig.outlet.send(1, 0, b"h", b"b", [_bytes(3000)])  # counted as encode() counts it
    assert not rig.pipe.lock.locked() and not _core.turning() and rig.pipe.out.seq == 0


def _behind(rig: _Rig) -> _Request:
    rig.pipe.out.last_frame = req = _Request(done=False)  # type: ignore[assignment]
    return req


def test_a_message_behind_a_frame_in_flight_goes_into_the_outbox_as_queue_small_puts_it():
    rig = _Rig()
    _behind(rig)
    bufs = [_bytes(5), _bytes(3000, 7)]
    assert rig.outlet.send(1, 42 | (1 << 60), b"head:", b"body", bufs) is True
    (inner,) = rig.pipe.out.outbox
    views = [(b.numel(), b.numpy().data, -1) for b in bufs]
    want, _ = encode(FrameKind.MESSAGE, 42, b"head:body", views, b"", Limits(), seal=False)
    assert inner == want.tobytes()  # unsealed, its hint (masked) where a seq goes
    assert rig.pipe.out.outbox_bytes == batch.BASE + batch.cost(len(inner))
    assert (rig.pipe.out.seq, rig.pipe.out.sent, rig.ep.sent, rig.flushed) == (0, 0, [], [])
    assert (rig.outlet.sent, rig.outlet.queued, rig.outlet.declined) == (0, 1, 0)
    assert not rig.pipe.lock.locked() and not _core.turning()


def test_the_outbox_is_sent_when_full_of_messages_or_bytes_or_nothing_is_in_flight():
    rig = _Rig()
    _behind(rig)
    for i in range(batch.MAX_MESSAGES):
        assert rig.outlet.send(1, i, b"", b"m")
    assert [len(f) for f in rig.flushed] == [batch.MAX_MESSAGES] and not rig.pipe.out.outbox
    # Bytes: a batch to this peer holds at most its max frame (less 256).
    rig.pipe.out.peer_max_frame = 256 + batch.BASE + 3 * batch.cost(len(_frame_of(b"x" * 900)))
    rig.flushed.clear()
    for _ in range(4):
        assert rig.outlet.send(1, 0, b"", b"x" * 900)
    assert [len(f) for f in rig.flushed] == [3] and len(rig.pipe.out.outbox) == 1
    # An outbox waiting with nothing in flight goes with the next message.
    rig.pipe.out.last_frame = None
    assert rig.outlet.send(1, 0, b"", b"y")
    assert [len(f) for f in rig.flushed] == [3, 2] and not rig.pipe.out.outbox
    assert rig.outlet.queued == batch.MAX_MESSAGES + 5 and rig.ep.sent == []


def test_queue_is_the_same_rule_for_a_pipe_the_caller_holds():
    rig = _Rig()
    _behind(rig)
    with rig.pipe.lock:
        assert rig.outlet.queue(rig.pipe, 7, b"h", b"b", [_bytes(5)]) is True
        assert rig.outlet.queue(rig.pipe, 7, b"h", b"b" * batch.MAX_ITEM, []) is False
    views = [(5, _bytes(5).numpy().data, -1)]
    want, _ = encode(FrameKind.MESSAGE, 7, b"hb", views, b"", Limits(), seal=False)
    assert rig.pipe.out.outbox == [want.tobytes()] and rig.outlet.queued == 1
    unbatched = _Rig(batching=False)
    _behind(unbatched)
    with unbatched.pipe.lock:
        assert unbatched.outlet.queue(unbatched.pipe, 7, b"h", b"b", []) is False
    assert unbatched.pipe.out.outbox == []


def _frame_of(body: bytes) -> bytes:
    return encode(FrameKind.MESSAGE, 0, body, [], b"", Limits(), seal=False)[0].tobytes()


@pytest.mark.parametrize("why", ["over MAX_ITEM", "buffers over MAX_ITEM", "not inline",
                                 "over the peer's max frame", "no batching"])
def test_what_may_not_wait_in_an_outbox_is_declined_untouched(why):
    rig = _Rig(batching=why != "no batching")
    _behind(rig)
    rig.pipe.out.outbox.append(b"earlier")
    rig.pipe.out.outbox_bytes = 100
    head, body, bufs = b"h", b"b", [_bytes(10)]
    if why == "over MAX_ITEM":
        body = b"b" * batch.MAX_ITEM
    elif why == "buffers over MAX_ITEM":
        bufs = [_bytes(batch.MAX_ITEM // 2), _bytes(batch.MAX_ITEM // 2)]
    elif why == "not inline":
        bufs = [torch.zeros(4)]
    elif why == "over the peer's max frame":
        rig.pipe.out.peer_max_frame = 300
        body = b"b" * 100
    assert rig.outlet.send(1, 0, head, body, bufs) is False
    assert rig.pipe.out.outbox == [b"earlier"] and rig.pipe.out.outbox_bytes == 100
    assert (rig.flushed, rig.ep.sent, rig.outlet.queued, rig.outlet.declined) == ([], [], 0, 1)
    assert not rig.pipe.lock.locked() and not _core.turning()


def test_a_frame_left_in_flight_is_the_pipes_last_and_the_loops_to_watch():
    rig = _Rig()
    rig.ep.answer = req = _Request(done=False)
    assert rig.outlet.send(1, 0, b"", b"x")
    assert rig.pipe.out.last_frame is req
    assert list(rig.inflight) == [(req, rig.pipe)] and rig.woken == 1
    # Small messages now wait behind it, in the outbox.
    assert rig.outlet.send(1, 0, b"", b"y") is True
    assert rig.pipe.out.seq == 1 and len(rig.ep.sent) == 1 and len(rig.pipe.out.outbox) == 1


def test_a_send_that_failed_at_once_breaks_the_pipe_through_failed():
    rig = _Rig()
    err = ConnectionError("endpoint failed")
    rig.ep.answer = _Request(done=True, error=err)
    assert rig.outlet.send(1, 0, b"", b"x")
    assert rig.failures == [(rig.pipe, err)] and rig.pipe.out.last_frame is None
    assert not rig.inflight


@pytest.mark.parametrize("why", ["no pipe", "not open", "outbox", "in flight"])
def test_what_it_declines_it_leaves_as_it_was(why):
    rig = _Rig(batching=False)  # (what waits in an outbox: the tests above)
    peer = 1
    if why == "no pipe":
        peer = 2
    elif why == "not open":
        rig.pipe.out.state = OutState.HELLO_SENT
    elif why == "outbox":
        rig.pipe.out.outbox.append(np.zeros(4, dtype=np.uint8))
    else:
        rig.pipe.out.last_frame = _Request(done=False)  # type: ignore[assignment]
    assert rig.outlet.send(peer, 0, b"h", b"b") is False
    assert (rig.pipe.out.seq, rig.pipe.out.sent, rig.ep.sent) == (0, 0, [])
    assert not rig.pipe.lock.locked() and not _core.turning()
    assert rig.outlet.declined == 1


def test_a_frame_over_a_limit_is_a_frame_error_and_the_lock_and_guard_are_given_back():
    rig = _Rig(Limits(max_frame_bytes=256))
    with pytest.raises(FrameError, match="frame of .* exceeds max_frame_bytes=256"):
        rig.outlet.send(1, 0, b"h", b"b" * 300)
    rig.pipe.out.peer_max_frame = 100
    with pytest.raises(FrameError, match=r"max_frame_bytes=100 of the receiver \(worker1\)"):
        rig.outlet.send(1, 0, b"h", b"b" * 80)
    assert not rig.pipe.lock.locked() and not _core.turning()
    assert rig.pipe.out.seq == 0 and rig.ep.sent == []
    rig.ep.refuse = ConnectionResetError("closed")
    with pytest.raises(ConnectionResetError):
        rig.outlet.send(1, 0, b"h", b"b")
    assert not rig.pipe.lock.locked() and not _core.turning()


def test_frame_is_the_same_frame_for_a_pipe_the_caller_holds():
    rig = _Rig()
    with rig.pipe.lock:
        rig.outlet.frame(rig.pipe, FrameKind.CMA_OK, 3, b"payload", b"")
    (frame, tag), = rig.ep.sent
    want, _ = encode(FrameKind.CMA_OK, 1, b"payload", [], KEY, Limits(), ack=5)
    assert frame == want.tobytes() and tag == BASE | 3


def test_every_path_keeps_reference_counts_balanced():
    rig = _Rig(Limits(max_frame_bytes=4096))
    head, body, big = b"head", b"body" * 10, b"x" * 5000
    inflight = _Request(done=False)
    failed = _Request(done=True, error=ConnectionError("failed at once"))
    refused = ConnectionResetError("closed")
    small, large = [_bytes(64), _bytes(100)], [_bytes(100), _bytes(5000)]
    watched = [rig.pipe, head, body, big, inflight, failed, refused, DONE, OutState.OPEN,
               *small, *large]

    def rounds(n: int) -> None:
        for _ in range(n):
            rig.pipe.out.last_frame = None
            rig.ep.answer = DONE
            assert rig.outlet.send(1, 9, head, body)
            assert not rig.outlet.send(2, 9, head, body)
            rig.pipe.out.last_frame = None
            assert rig.outlet.send(1, 9, head, body, small)
            assert not rig.outlet.send(1, 9, head, body, large)
            assert not rig.outlet.send(2, 9, head, body, small)
            rig.ep.answer = inflight
            assert rig.outlet.send(1, 9, head, body)
            assert rig.outlet.send(1, 9, head, body)  # behind it: into the outbox
            assert not rig.outlet.send(1, 9, head, body, large)  # not to wait there
            rig.pipe.out.outbox.clear()
            rig.pipe.out.outbox_bytes = 0
            rig.pipe.out.last_frame = None
            rig.ep.answer = failed
            assert rig.outlet.send(1, 9, head, body)
            with pytest.raises(FrameError):
                rig.outlet.send(1, 9, head, big)
            rig.ep.refuse = refused
            with pytest.raises(ConnectionResetError):
                rig.outlet.send(1, 9, head, body)
            rig.ep.refuse = None
            rig.ep.sent.clear()
            rig.inflight.clear()
            rig.failures.clear()

    rounds(3)
    refused.__traceback__ = None
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    rounds(500)
    refused.__traceback__ = None
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before


@pytest.mark.parametrize("call, message", [
    (lambda o: o.send(1, 0, b""), r"send\(\) takes 4 or 5 arguments"),
    (lambda o: o.send(1, 0, b"", b"", ()), "buffers must be a list"),
    (lambda o: o.send(1, -1, b"", b""), "can't convert negative"),
    (lambda o: o.send(1, 0, "text", b""), "bytes-like"),
    (lambda o: o.frame(None, 0, 0, b""), r"frame\(\) takes 5 arguments"),
])
def test_bad_arguments_are_named(call, message):
    rig = _Rig()
    with pytest.raises((TypeError, OverflowError), match=message):
        call(rig.outlet)
    assert not rig.pipe.lock.locked() and not _core.turning()


def test_the_constructor_names_what_is_missing():
    with pytest.raises(TypeError, match="missing argument 'pipes'"):
        _core.Outlet()
    with pytest.raises(TypeError, match="keyword arguments only"):
        _core.Outlet({})


def test_track_watches_a_frame_sent_elsewhere_by_the_same_rule():
    rig = _Rig()
    req = _Request(done=False)
    rig.outlet.track(rig.pipe, req)  # (a frame Sender.send sent with its buffers)
    assert rig.pipe.out.last_frame is req and list(rig.inflight) == [(req, rig.pipe)]
    assert rig.woken == 1
    err = ConnectionError("failed at once")
    rig.outlet.track(rig.pipe, _Request(done=True, error=err))
    assert rig.pipe.out.last_frame is None and rig.failures == [(rig.pipe, err)]
    rig.outlet.track(rig.pipe, DONE)
    assert rig.pipe.out.last_frame is None and len(rig.inflight) == 1
    with pytest.raises(TypeError, match=r"track\(\) takes 2 arguments"):
        rig.outlet.track(rig.pipe)


# By address (hostmem/cma.py): (read_min, read_busy_min, read_max), as the
# Sender passes cma.MIN_BYTES, cma.BUSY_MIN_BYTES and the grants' least.
_READS = (1 << 20, 256 << 10, 2 << 20)


def _reading_rig(busy: bool = True) -> _Rig:
    rig = _Rig(by_address=_READS)
    rig.pipe.cma.read_by_peer = True
    if busy:
        rig.strategy.blocked_until = time.monotonic() + 60  # this loop may not poll
    return rig


@pytest.mark.parametrize("busy", ["this loop", "the peer's", "neither"])
def test_a_buffer_by_address_goes_as_its_address_in_encodes_frame_and_is_held(busy):
    """Sender.send's frame for it (encode with a REMOTE way), byte for byte;
    the tensor held for the peer under the frame's sequence number before
    the frame went, the pipe among those holding."""
    rig = _reading_rig(busy == "this loop")
    rig.pipe.inbound.peer_busy = busy == "the peer's"
    small, large = _bytes(100), _bytes((256 << 10) if busy != "neither" else 1 << 20, 3)
    assert rig.outlet.send(1, 42, b"head:", b"body", [small, large]) is True
    (frame, tag), = rig.ep.sent
    want, separate = encode(FrameKind.MESSAGE, 1, b"head:body",
                            [(100, small.numpy().data, -1), (large.numel(), None, -1)], KEY,
                            Limits(), [(0, 0, 0), (REMOTE, 0, large.data_ptr())], ack=5,
                            busy=busy == "this loop")
    assert separate == [] and frame == want.tobytes() and tag == BASE | 42
    got = decode(np.frombuffer(frame, dtype=np.uint8), KEY, Limits())
    assert [(d.flags, d.where) for d in got.buffers][1] == (REMOTE, large.data_ptr())
    assert list(rig.pipe.cma.held) == [1] and rig.pipe.cma.held[1][0] is large
    assert rig.holding == {rig.pipe} and rig.outlet.read_buffers == 1
    assert (rig.pipe.out.seq, rig.outlet.sent, rig.outlet.declined) == (1, 1, 0)


@pytest.mark.parametrize("why", ["the peer does not read us", "under read_min, nobody busy",
                                 "from read_max", "under read_busy_min", "behind a frame",
                                 "no by_address"])
def test_a_buffer_that_is_not_to_go_by_address_now_is_declined_untouched(why):
    rig = _Rig() if why == "no by_address" else _reading_rig(busy=why != "under read_min, "
                                                                      "nobody busy")
    size = {"under read_min, nobody busy": (1 << 20) - 1, "from read_max": 2 << 20,
            "under read_busy_min": (256 << 10) - 1}.get(why, 300 << 10)
    if why == "the peer does not read us":
        rig.pipe.cma.read_by_peer = False
    elif why == "behind a frame":
        rig.pipe.out.last_frame = _Request(False)  # type: ignore[assignment]
    assert rig.outlet.send(1, 42, b"h", b"b", [_bytes(size)]) is False
    assert rig.ep.sent == [] and rig.pipe.out.outbox == [] and rig.pipe.out.seq == 0
    assert rig.pipe.cma.held == {} and rig.holding == set() and rig.outlet.declined == 1
    assert not rig.pipe.lock.locked()
