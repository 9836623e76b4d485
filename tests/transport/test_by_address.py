"""The pipes' side of reading by address (transport/by_address.py): the
acknowledgement bookkeeping and the CMA frames' checks, without processes
(tests/transport/hostmem/test_cma.py runs them between two workers)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest
import torch

from ucxrpc.errors import BrokenError, FrameError
from ucxrpc.transport import by_address
from ucxrpc.transport.by_address import ByAddress
from ucxrpc.transport.wire.frame import Frame, FrameKind, Limits
from ucxrpc.transport.pipe import Pipe
from ucxrpc.transport.send import Sender


def _sender() -> Sender:
    return Sender(my_id=0, limits=Limits(), host_as_device=False, inflight=deque(),
                  wake=lambda: None, failed=lambda pipe, exc: None)


def _pipe() -> Pipe:
    return Pipe(1, "worker1", b"")


def _frame(kind: FrameKind, payload: bytes = b"") -> Frame:
    return Frame(kind, 1, memoryview(payload), (), np.zeros(0, dtype=np.uint8))


class _Sent(list):
    """What ByAddress sent, as (pipe name, kind); fails while ``broken``."""

    broken = False

    def __call__(self, pipe, payload, buffers, kind) -> None:
        if self.broken:
            raise BrokenError(f"pipe to {pipe.name} broken")
        self.append((pipe.name, kind))


def test_an_acknowledgement_lets_go_of_buffers_up_to_it_in_order():
    sender, pipe = _sender(), _pipe()
    ours = ByAddress(sender=sender, send=_Sent(), endpoint=lambda p: None, offered=True)
    pipe.out.seq = 5
    pipe.cma.held = {2: [torch.ones(1)], 3: [torch.ones(1)], 5: [torch.ones(1)]}
    pipe.cma.split_seq = 3
    sender.holding.add(pipe)
    sender.holding_split.add(pipe)
    ours.on_ack(pipe, 3)
    assert list(pipe.cma.held) == [5] and pipe.cma.acked == 3
    assert pipe in sender.holding and pipe not in sender.holding_split
    ours.on_ack(pipe, 5)
    assert pipe.cma.held == {} and pipe not in sender.holding


def test_an_acknowledgement_of_frames_never_sent_is_refused_naming_the_peer():
    pipe = _pipe()
    ours = ByAddress(sender=_sender(), send=_Sent(), endpoint=lambda p: None, offered=True)
    pipe.out.seq = 4
    pipe.cma.held = {4: [torch.ones(1)]}
    with pytest.raises(FrameError, match="worker1 acknowledged our frame 9, but we sent 4"):
        ours.on_ack(pipe, 9)
    assert list(pipe.cma.held) == [4]  # nothing let go on a lie


def test_cma_frames_carry_no_payload_and_ok_counts_only_where_we_offered():
    pipe = _pipe()
    ByAddress(sender=_sender(), send=_Sent(), endpoint=lambda p: None,
              offered=False).on_frame(pipe, _frame(FrameKind.CMA_OK))
    assert not pipe.cma.read_by_peer  # we published no offer: nobody may read us
    ours = ByAddress(sender=_sender(), send=_Sent(), endpoint=lambda p: None, offered=True)
    with pytest.raises(FrameError, match="CMA_OK frame from worker1 has a 3-byte payload"):
        ours.on_frame(pipe, _frame(FrameKind.CMA_OK, b"abc"))
    assert not pipe.cma.read_by_peer
    ours.on_frame(pipe, _frame(FrameKind.CMA_OK))
    assert pipe.cma.read_by_peer


def test_a_word_no_frame_carried_goes_alone_after_the_delay(monkeypatch):
    sent = _Sent()
    ours = ByAddress(sender=_sender(), send=sent, endpoint=lambda p: None, offered=True)
    carried, alone = _pipe(), Pipe(2, "worker2", b"")
    for pipe in (carried, alone):
        pipe.cma.read_through = 3
        ours.read_done(pipe)
    assert ours.due
    carried.cma.ack_sent = 3  # a reply went back with it
    monkeypatch.setattr(by_address, "ACK_DELAY_S", 0.0)
    time.sleep(0.001)
    ours.send_due()
    assert sent == [("worker2", FrameKind.CMA_DONE)] and ours.sent_alone == 1
    assert not ours.due
    # Said already (the frame's ack, as send.py stamps it): nothing more.
    alone.cma.ack_sent = 3
    ours.send_ack(alone)
    assert ours.sent_alone == 1


def test_a_word_that_cannot_go_is_not_counted_as_sent():
    sent = _Sent()
    sent.broken = True
    ours = ByAddress(sender=_sender(), send=sent, endpoint=lambda p: None, offered=True)
    pipe = _pipe()
    pipe.cma.read_through = 1
    ours.send_ack(pipe)  # the pipe broke: the peer lets its buffers go anyway
    assert ours.sent_alone == 0
