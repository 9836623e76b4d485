"""A message through the ways a host buffer travels, on the fake network
(tests/transport/fakenet.py): inline in its frame, and separately under a
data tag whose receive the frame posts; several small messages queued while
a frame is in flight go as one BATCH.  Real processes cover the ways the
fake cannot (by address: test_by_address.py; written: test_grants.py;
staged and packed: tests/rpc/test_staging.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.transport.fakenet import Pair, Request, fake_net, pair  # noqa: F401  (fixtures)
from ucxrpc.transport.wire import tags
from ucxrpc.transport.wire.frame import FrameKind


def _keep_buffers(pair: Pair) -> list[tuple[bytes, list[torch.Tensor]]]:
    got: list[tuple[bytes, list[torch.Tensor]]] = []
    pair.w1.tr._rx._on_message = lambda peer, payload, bufs: got.append((bytes(payload),
                                                                         list(bufs)))
    return got


def _recording_receives(pair: Pair) -> list[tuple[Any, int, Request]]:
    """worker 1's posted receives, with their requests (to complete by hand)."""
    posted: list[tuple[Any, int, Request]] = []
    worker = pair.w1.tr._worker
    real = worker.tag_recv

    def tag_recv(buf: Any, tag: int) -> Request:
        req = real(buf, tag)
        posted.append((buf, tag, req))
        return req

    worker.tag_recv = tag_recv
    return posted


def _frames_to(pair: Pair, address: bytes) -> list[tuple[int, bytes]]:
    return [(t, d) for t, d in pair.net.queues[address] if tags.kind_of(t) == tags.FRAME]


def test_a_small_buffer_rides_inline_in_its_frame(pair: Pair) -> None:
    pair.open()
    got = _keep_buffers(pair)
    posted = _recording_receives(pair)
    small = torch.arange(100, dtype=torch.uint8)
    pair.w0.tr.send(1, b"inline", [small])
    assert len(pair.net.queues[pair.w1.address]) == 1  # the frame alone
    pair.settle()
    assert not posted  # nothing to receive separately
    (payload, bufs), = got
    assert payload == b"inline" and torch.equal(bufs[0], small)


def test_a_large_buffer_goes_under_its_data_tag_and_lands_whole(pair: Pair) -> None:
    pair.open()
    got = _keep_buffers(pair)
    posted = _recording_receives(pair)
    small = torch.arange(100, dtype=torch.uint8)
    big = (torch.arange(256 * 1024) % 251).to(torch.uint8)  # over the 64 KiB inline threshold
    pair.w0.tr.send(1, b"two", [small, big])
    queue = pair.net.queues[pair.w1.address]
    (data_tag, data), = [(t, d) for t, d in queue if tags.kind_of(t) == tags.DATA]
    assert len(data) == big.numel()
    pair.deliver_one(pair.w1)  # the frame: its inline buffer, and a receive posted
    (buf, tag, req), = posted
    assert tag == data_tag and buf.numel() == big.numel()
    assert not got  # the message waits for its data
    np.copyto(buf.numpy(), np.frombuffer(data, dtype=np.uint8))  # UCX lands it
    req.done = True
    pair.w1.tr._turn()
    (payload, bufs), = got
    assert payload == b"two"
    assert torch.equal(bufs[0], small) and torch.equal(bufs[1], big)


def test_small_messages_queued_behind_a_frame_in_flight_go_as_one_batch(pair: Pair) -> None:
    pair.open()
    got = _keep_buffers(pair)
    sent: list[Request] = []
    ep_class = type(pair.w0.tr._pipes[1].ep)
    real_send = ep_class.tag_send

    def slow_send(self: Any, buf: Any, tag: int) -> Request:
        real_send(self, buf, tag)
        req = Request(done=False)  # still in flight: what follows queues
        sent.append(req)
        return req

    # Messages without buffers go by send_frame.
    ep_class.tag_send = ep_class.send_frame = slow_send
    try:
        for i in range(5):
            pair.w0.tr.send(1, b"m%d" % i, [])
    finally:
        ep_class.tag_send = ep_class.send_frame = real_send
    for req in sent:
        req.done = True
    for _ in range(5):
        pair.w0.tr._turn()
    frames = _frames_to(pair, pair.w1.address)
    kinds = [FrameKind(d[3]) for _, d in frames]
    assert kinds[0] is FrameKind.MESSAGE and FrameKind.BATCH in kinds[1:], kinds
    assert len(frames) < 5  # fewer frames than messages
    pair.settle()
    assert [p for p, _ in got] == [b"m%d" % i for i in range(5)]  # in order, once each


def test_frames_taken_in_one_turn_are_handled_in_the_order_sent(pair: Pair) -> None:
    """Whole frames of an authenticated peer are handled as they are taken,
    one by one (none queued behind another): each message once, in order,
    a bufferless one and one with a buffer inline alike."""
    pair.open()
    for i in range(4):
        pair.w0.tr.send(1, b"m%d" % i, [torch.full((8,), i, dtype=torch.uint8)] if i % 2 else [])
    # One frame in flight holds the rest back into one BATCH (batch.py):
    # here every frame leaves alone, as each send completed at once.
    assert pair.queue_for_poll(pair.w1) == 4
    assert pair.w1.tr._rx.poll()
    assert pair.w1.messages == [(0, b"m0"), (0, b"m1"), (0, b"m2"), (0, b"m3")]
    assert pair.w1.tr._rx.frames == []


class _Stop(BaseException):
    """What a handler may let through ``except Exception`` (from unpickling)."""


def test_a_handler_that_raises_ends_the_turn_and_the_rest_is_kept(pair: Pair) -> None:
    """The second message's handler raises a BaseException: the turn ends
    there, and the frames taken behind it are neither lost nor handled
    twice; the next turn hands them on, in order."""
    pair.open()
    seen: list[bytes] = []

    def on_message(peer: int, payload: Any, bufs: list) -> None:
        seen.append(bytes(payload))
        if bytes(payload) == b"m1" and seen.count(b"m1") == 1:
            raise _Stop()

    pair.w1.tr._rx._on_message = on_message
    for i in range(4):
        pair.w0.tr.send(1, b"m%d" % i, [])
    assert pair.queue_for_poll(pair.w1) == 4
    try:
        pair.w1.tr._rx.poll()
        raise AssertionError("the handler's BaseException was swallowed")
    except _Stop:
        pass
    assert seen == [b"m0", b"m1"]
    assert len(pair.w1.tr._rx.frames) == 2  # received, kept for the next turn
    assert pair.w1.tr._rx.poll()
    assert seen == [b"m0", b"m1", b"m2", b"m3"]
    assert pair.w1.tr._rx.frames == []
