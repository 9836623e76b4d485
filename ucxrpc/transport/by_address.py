"""Reading by address, per pipe: whether a peer reads us (and we it), and
the word that buffers were read.

:mod:`.hostmem.cma` reads another process's memory; this module keeps the pipes'
side of it.  When a peer's frames authenticate and it offered to be read
(:meth:`ByAddress.accepted`), we probe it and tell it so (CMA_OK): from then
on it sends us large host buffers as their address alone (:mod:`.send`),
and must keep them until we say we read them.  That word is every frame's
``ack`` (:mod:`.wire.frame`): it rides on the reply, mostly; one that no frame
carried within :data:`ACK_DELAY_S` goes alone in a CMA_DONE frame, sent by
the loop when it finds nothing else to do (:meth:`ByAddress.send_due`).
The peer's word on ours lets our held buffers go (:meth:`ByAddress.on_ack`).

Threads: :meth:`read_done` and :meth:`send_due` belong to the loop (the
progress thread, or a thread driving it, under the baton); the rest take
the pipe's lock where they touch what senders read.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..errors import FrameError
from .hostmem import cma
from .wire.frame import Frame, FrameKind
from .pipe import Pipe
from .send import Sender

__all__ = ["ACK_DELAY_S", "ByAddress"]

logger = logging.getLogger(__name__)

#: How long our word that we read a peer's buffers by address may wait
#: for a frame going back to it (the reply, mostly: frame.py's ``ack``)
#: before a CMA_DONE frame takes it alone.  Until then the peer keeps the
#: buffers; nothing else waits for the word, while a frame sent alone costs
#: both sides a frame and the peer, if it sleeps, a wake-up (benchmarks/runs/T.md).
ACK_DELAY_S = 0.005

#: ``(pipe, payload, buffers, kind)``: the transport's send of a frame on a
#: pipe, open or not yet (queued behind its handshake).
Send = Callable[[Pipe, bytes, list[torch.Tensor], FrameKind], None]


class ByAddress:
    """One transport's side of reading by address.

    Args:
        sender: the transport's sender (which buffers it holds for peers).
        send: sends a frame on a pipe (an empty one here: CMA_OK, CMA_DONE).
        endpoint: opens the pipe's endpoint (what UCX reaches the peer by).
        offered: whether peers may read us (we published an offer).
    """

    def __init__(self, *, sender: Sender, send: Send, endpoint: Callable[[Pipe], object],
                 offered: bool) -> None:
        self._sender = sender
        self._send = send
        self._endpoint = endpoint
        self._offered = offered
        #: Pipes whose peer's buffers we read and have not yet said so, with
        #: when the first of those reads ended (read_done): truthy while a
        #: word waits for a frame (a plain attribute, not a property: the
        #: loop looks at it twice a turn, issue 52).
        self.due: dict[Pipe, float] = {}
        self.sent_alone = 0  # CMA_DONE frames sent: no other frame carried the word

    def accepted(self, pipe: Pipe) -> None:
        """The peer's frames to us authenticated: if it offered to be read
        by address, try, and tell it whether we can."""
        if pipe.cma.offer is None or pipe.cma.reads:
            return
        # Only where UCX itself reaches the peer through shared memory: two
        # network namespaces of one kernel, say, talk over TCP, and a job
        # measuring that path must not find its large buffers going around it.
        try:
            self._endpoint(pipe)
        except Exception as exc:  # the pipe's own sends will say what is wrong
            logger.debug("no endpoint to %s yet: %s", pipe.name, exc)
            return
        if not pipe.fifo:
            logger.info("large buffers from %s travel through UCX, which reaches it without "
                        "shared memory", pipe.name)
            return
        why = cma.probe(pipe.cma.pid, pipe.cma.offer)
        if why is not None:
            logger.info("large buffers from %s travel through UCX: reading its memory by "
                        "address failed (%s)", pipe.name, why)
            return
        pipe.cma.reads = True
        try:
            self._send(pipe, b"", [], FrameKind.CMA_OK)
        except Exception as exc:  # the pipe broke meanwhile
            logger.debug("CMA_OK to %s not sent: %s", pipe.name, exc)

    def on_frame(self, pipe: Pipe, frame: Frame) -> None:
        """A CMA_OK (the peer reads us by address from now on) or CMA_DONE
        (an acknowledgement alone, taken as every frame's) from ``pipe``'s
        peer."""
        if frame.payload.nbytes:
            raise FrameError(f"a {frame.kind.name} frame from {pipe.name} has a "
                             f"{frame.payload.nbytes}-byte payload; it carries none")
        if frame.kind is FrameKind.CMA_OK and self._offered:
            with pipe.lock:
                pipe.cma.read_by_peer = True

    def read_done(self, pipe: Pipe) -> None:
        """We read (or gave up on) buffers of the peer's, up to its frame
        ``pipe.cma.read_through``: the next frame we send it says so (the
        reply, mostly), or, if none went within :data:`ACK_DELAY_S`, a
        CMA_DONE frame the loop sends when it next finds nothing to do."""
        if pipe.cma.ack_sent < pipe.cma.read_through:
            self.due.setdefault(pipe, time.monotonic())

    def send_due(self) -> None:
        """Send what no frame carried within :data:`ACK_DELAY_S`."""
        due = time.monotonic() - ACK_DELAY_S
        for pipe, since in list(self.due.items()):
            if pipe.cma.ack_sent >= pipe.cma.read_through:
                del self.due[pipe]  # a frame carried it
            elif since <= due:
                del self.due[pipe]
                self.send_ack(pipe)

    def send_ack(self, pipe: Pipe) -> None:
        """A CMA_DONE frame to ``pipe`` if our word on its buffers is not
        yet there (the loop's, or closing's once the loop stopped)."""
        if pipe.cma.ack_sent >= pipe.cma.read_through:
            return
        try:
            self._send(pipe, b"", [], FrameKind.CMA_DONE)
        except Exception as exc:  # the pipe broke: the peer lets them go anyway
            logger.debug("CMA_DONE to %s not sent: %s", pipe.name, exc)
            return
        self.sent_alone += 1

    def on_ack(self, pipe: Pipe, ack: int) -> None:
        """The peer is done with our buffers of frames up to ``ack``: let
        them go."""
        with pipe.lock:
            if ack > pipe.out.seq:
                raise FrameError(f"{pipe.name} acknowledged our frame {ack}, but we sent "
                                 f"{pipe.out.seq}")
            pipe.cma.acked = ack
            held = pipe.cma.held
            while held:
                seq = next(iter(held))  # in the order sent
                if seq > ack:
                    break
                del held[seq]
            if not held:
                self._sender.holding.discard(pipe)
            if pipe.cma.split_seq <= ack:
                self._sender.holding_split.discard(pipe)
