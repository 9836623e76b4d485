"""The sending side of a transport: frames onto a pipe's endpoint.

A message is one frame (small buffers inline) and one tag message per
separate buffer (:mod:`.wire.frame`); CUDA buffers go GPU-direct, staged through
host chunks, or packed (:mod:`.cuda.staging`); large host buffers to a peer that
reads us by address go as their address alone (:mod:`.hostmem.cma`), held until
the peer says it read them, or, where the peer lent us memory for them
(:mod:`.grants`), are written into it before their frame goes.  Every
frame says how far this side read the peer's (``ack``, :mod:`.wire.frame`).  A
small message sent while the pipe's previous frame is still in flight
waits in the pipe's outbox and leaves with the others as one BATCH frame
(:mod:`.wire.batch`).

Every request left in flight goes to ``inflight`` for the progress loop to
watch; the loop tells :meth:`Sender.frame_left` when a pipe's last frame
completed, which sends what waited behind it.  All methods but
:meth:`frame_left` run under the pipe's lock, held by the caller.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..errors import FrameError
from .wire import batch
from .hostmem import cma
from . import grants
from .cuda import staging
from .wire.frame import REMOTE, WRITTEN, FrameKind, Limits, encode
from .wire.gather import Buffer, Gather
from .pipe import OutState, Pipe
from .wire.tags import FRAME, HINT_MASK, data_tag, kind_base
from .ucx.binding import Request
from .ucx.ucp import DONE
from .._core import Outlet

__all__ = ["Sender"]

logger = logging.getLogger(__name__)


def _host_views(buffers: Sequence[Buffer]) -> list[tuple[int, memoryview | None, int]]:
    """What :func:`.wire.frame.encode` takes for host buffers (a Gather's parts
    are not one block of memory: never inline)."""
    return [(b.numel(), None if isinstance(b, Gather) else b.numpy().data, -1) for b in buffers]


def _least_by_address(pipe: Pipe, busy: bool) -> int:
    """The smallest host buffer sent to ``pipe``'s peer by address: sooner
    where this loop (``busy``) or the peer's may not poll."""
    return cma.BUSY_MIN_BYTES if busy or pipe.inbound.peer_busy else cma.MIN_BYTES


class Sender:
    """Encodes and sends messages for one worker.

    Args:
        my_id: this worker's id, carried in every tag.
        limits: this side's limits (the peer's max frame is on its pipe).
        host_as_device: the debug switch that treats host buffers as device
            ones (staging.py).
        inflight: where requests still in flight go (the loop's queue).
        wake: makes the loop turn, for requests left in flight (the loop's
            ``nudge``: a progress thread lingering after a driver is left to it).
        failed: ``(pipe, error)`` for a send that failed at once (the pipe
            breaks; called later, not under its lock).
        pipes: the transport's pipes by peer id (:attr:`send_alone` looks
            its peer up there).
        strategy: the loop's strategy: its ``blocked_until`` says whether
            this worker's loop may not poll now (every frame says so to the
            peer; :data:`.hostmem.cma.BUSY_MIN_BYTES`); None, never.
    """

    def __init__(self, *, my_id: int, limits: Limits, host_as_device: bool,
                 inflight: deque[tuple[Request, Any]], wake: Callable[[], None],
                 failed: Callable[[Pipe, BaseException], None],
                 pipes: dict[int, Pipe] | None = None, strategy: Any = None,
                 bounce: bool = False) -> None:
        self.my_id = my_id
        # Device buffers sent directly go through buffers CUDA IPC can
        # share: this process's own device memory cannot be (bounce.py).
        self._bounce = bounce
        self.bounced_bytes = 0
        self.limits = limits
        self._host_as_device = host_as_device
        self._inflight = inflight
        self._wake = wake
        self._failed = failed
        self._frame_base = kind_base(FRAME, my_id)
        #: Pipes whose peer has not yet read all it was sent by address, and
        #: those among them where it reads some in two halves (the transport
        #: removes a pipe under its lock when that ends).
        self.holding: set[Pipe] = set()
        self.holding_split: set[Pipe] = set()
        #: A frame without buffers, made, sealed, sent and watched in one C
        #: call (csrc/send.c): ``frame`` for :meth:`send`, and
        #: :attr:`send_alone` for a message to a peer whose pipe lets it go
        #: at once, with its buffers where all go inline: host buffers that
        #: are neither read by address (cma.BUSY_MIN_BYTES) nor sent in
        #: chunks (staging), none with the debug switch that treats host
        #: buffers as device ones; and into the pipe's outbox where a
        #: small one waits behind a frame in flight (:meth:`_queue_small`'s
        #: rule, not with that switch: :meth:`_batchable`).  Host buffers
        #: that go by address (:meth:`_by_address`'s rule) go with it too,
        #: below the size from which a grant may take them instead
        #: (:meth:`_write`), and so below cma.SPLIT_BYTES: a 1 MiB echo
        #: beside a busy process spent ~45 µs a side in :meth:`send`
        #: (issue 52).
        inline_max = 0 if host_as_device else min(
            limits.inline_threshold, cma.BUSY_MIN_BYTES - 1, staging.HOST_CHUNK_OVER)
        self._outlet = Outlet(pipes={} if pipes is None else pipes, limits=limits,
                              strategy=strategy, inflight=inflight, wake=wake, failed=failed,
                              open=OutState.OPEN, done=DONE, tensor=torch.Tensor,
                              uint8=torch.uint8, flush=self.flush,
                              frame_base=self._frame_base, hint_mask=HINT_MASK,
                              message_kind=FrameKind.MESSAGE, inline_max=inline_max,
                              batch=None if host_as_device else (
                                  batch.MAX_ITEM, batch.MAX_MESSAGES, batch.MAX_BYTES,
                                  batch.BASE),
                              by_address=None if host_as_device else (
                                  cma.MIN_BYTES, cma.BUSY_MIN_BYTES,
                                  min(grants.MIN_BYTES, cma.SPLIT_BYTES)),
                              holding=self.holding)
        self._contended = self._outlet.contended
        #: ``send_alone(peer, hint, head, body[, buffers]) -> bool``: a
        #: message of ``head`` then ``body`` to worker id ``peer``, its
        #: ``buffers`` (a list) inline or by address, as one frame, or into
        #: the pipe's outbox where a frame in flight or an outbox waits
        #: before it, under the pipe's lock and the thread's guard; False
        #: (nothing changed) where it can do neither: no open pipe, a
        #: buffer that is to go neither inline nor by address (above), one
        #: by address behind a frame in flight, or a message that waits
        #: and is too large to wait in an outbox (the outbox is then sent
        #: first, on the Python path).  Every message tries it first: a no-op's
        #: request and reply cost seven Python calls a side on the way here
        #: before, a 16 KiB echo's ~7 µs a side more (issue 52).
        self.send_alone = self._outlet.send
        self.staged_bytes = 0
        self.packed_buffers = 0
        self.batches = 0
        self.batched_messages = 0
        self.read_buffers = 0
        self.written_buffers = 0
        self.gathered_buffers = 0

    def send(self, pipe: Pipe, payload: bytes | memoryview, buffers: Sequence[Buffer],
             kind: FrameKind = FrameKind.MESSAGE, hint: int = 0,
             devices: list[int] | None = None) -> None:
        """Send a message on an open pipe (under its lock).

        Raises:
            FrameError: it breaks a limit, this side's or the peer's.
        """
        if pipe.out.outbox or pipe.out.last_frame is not None:  # else nothing to wait for
            if kind is FrameKind.MESSAGE and self._batchable(payload, buffers):
                if self._queue_small(pipe, payload, buffers, hint):
                    return
            elif pipe.out.outbox:
                self.flush(pipe)  # what waits goes first
        if not buffers:
            # Nothing to read by address, stage or send apart: the frame
            # alone, in C (raises FrameError over the peer's limit too).
            self._outlet.frame(pipe, kind, hint, payload, b"")
            return
        out = None
        busy = self._contended()
        remote = None
        if pipe.cma.read_by_peer:
            buffers, remote = self._by_address(pipe, kind, buffers, busy)
        if remote is not None and pipe.grants.granted:
            remote = self._write(pipe, buffers, remote)
        if remote is None and buffers and staging.needed(buffers, self._host_as_device):
            # Planned as tensors: a bundle's parts joined (a Gather beside
            # a buffer sent in chunks too).
            tensors = [b.joined() if isinstance(b, Gather) else b for b in buffers]
            out = staging.plan(tensors, devices, staged=not pipe.direct,
                               host_as_device=self._host_as_device, bounced=self._bounce)
            buffers = tensors
        # Where staged or packed, the receiver allocates on the device each
        # descriptor names; REMOTE ways (by address) come only without them.
        views, ways = (_host_views(buffers), remote) if out is None else (out.views, out.ways)
        ack = pipe.cma.read_through  # read once: the loop may move it on meanwhile
        frame, separate = encode(kind, pipe.out.seq + 1, payload, views, pipe.auth.out_key,
                                 self.limits, ways, pipe.out.peer_max_frame, ack=ack, busy=busy)
        if out is not None:
            self.staged_bytes += out.staged_bytes
            self.packed_buffers += out.packed
        if frame.nbytes > pipe.out.peer_max_frame:  # its header alone: inlining stays within
            raise FrameError(f"frame of {frame.nbytes} bytes exceeds max_frame_bytes="
                             f"{pipe.out.peer_max_frame} of the receiver ({pipe.name})")
        pipe.out.seq += 1
        seq = pipe.out.seq
        assert pipe.ep is not None
        held = [b for b, way in zip(buffers, remote)  # tensors: REMOTE ones are never Gathers
                if way[0] == REMOTE and isinstance(b, torch.Tensor)] if remote else None
        if held:  # before the frame: its acknowledgement may come at once
            pipe.cma.held[seq] = held
            self.read_buffers += len(held)
            self.holding.add(pipe)
            if any(b.numel() >= cma.SPLIT_BYTES for b in held):
                pipe.cma.split_seq = seq
                self.holding_split.add(pipe)
        sent = pipe.ep.tag_send(frame, self._frame_base | hint)
        pipe.cma.ack_sent = ack
        reqs: list[tuple[Request, Pipe]] = [(sent, pipe)]
        try:
            for i in separate:
                tag = data_tag(self.my_id, pipe.auth.out_epoch, seq, i)
                for part in (buffers[i],) if out is None else out.parts(i):
                    reqs.append((pipe.ep.tag_send(part, tag), pipe))
                    if type(part) is Gather:
                        self.gathered_buffers += 1
        finally:  # what went out is watched, whatever failed after it
            if out is not None:
                self.bounced_bytes += out.bounced_bytes
            pipe.out.sent += 1
            self._track(pipe, reqs, sent)

    def flush(self, pipe: Pipe) -> None:
        """Send ``pipe``'s outbox as one BATCH frame (under its lock)."""
        frames, pipe.out.outbox = pipe.out.outbox, []
        pipe.out.outbox_bytes = 0
        if not frames or pipe.out.state is not OutState.OPEN:
            return
        assert pipe.ep is not None
        ack = pipe.cma.read_through
        frame, _ = encode(FrameKind.BATCH, pipe.out.seq + 1, batch.pack(frames), [],
                          pipe.auth.out_key, self.limits,
                          peer_max_frame=pipe.out.peer_max_frame, ack=ack,
                          busy=self._contended())
        pipe.out.seq += 1
        sent = pipe.ep.tag_send(frame, self._frame_base)
        pipe.cma.ack_sent = ack
        pipe.out.sent += len(frames)
        self.batches += 1
        self.batched_messages += len(frames)
        self._track(pipe, [(sent, pipe)], sent)

    def frame_left(self, pipe: Pipe, req: Request) -> None:
        """From the loop: ``req``, a send on ``pipe``, completed.  If it was
        the pipe's last frame, what waited behind it goes now.  (Senders
        read ``last_frame``, not the request, which would drop the GIL in
        ucxx and queue behind whoever holds it.)"""
        if req is not pipe.out.last_frame:
            return
        with pipe.lock:
            if req is pipe.out.last_frame:
                pipe.out.last_frame = None
                if pipe.out.outbox:
                    self.flush(pipe)

    def stats(self) -> dict[str, int]:
        return {"staged_bytes": self.staged_bytes, "bounced_bytes": self.bounced_bytes,
                "packed_buffers": self.packed_buffers,
                "batches": self.batches, "batched_messages": self.batched_messages,
                # send_alone's: went in its one call, waited in an outbox
                # from it, or was left to send().
                "messages_sent_alone": self._outlet.sent,
                "messages_queued_in_one_call": self._outlet.queued,
                "messages_not_sent_alone": self._outlet.declined,
                "buffers_read_by_peers": self.read_buffers + self._outlet.read_buffers,
                "buffers_written_into_peers": self.written_buffers,
                "buffers_sent_as_parts": self.gathered_buffers,
                # Not yet acknowledged: what peers still may read.
                "buffers_held_for_peers": sum(len(b) for pipe in list(self.holding)
                                              for b in list(pipe.cma.held.values()))}

    def _by_address(self, pipe: Pipe, kind: FrameKind, buffers: Sequence[Buffer], busy: bool
                    ) -> tuple[Sequence[Buffer], list[tuple[int, int, int]] | None]:
        """``buffers`` and the frame's ways when some of them are to be read
        by address (host buffers of :data:`.hostmem.cma.MIN_BYTES` or more, of
        :data:`.hostmem.cma.BUSY_MIN_BYTES` where this loop (``busy``) or the peer's
        may not poll, in a message without device buffers), else None; a
        bundle read by address is joined first (the peer reads one block)."""
        if kind is not FrameKind.MESSAGE or self._host_as_device:
            return buffers, None
        # Every message to such a pipe asks: one size read per buffer when,
        # as mostly, none is large, and the strategy only when one is.
        sizes = [b.numel() for b in buffers]
        if not sizes:
            return buffers, None
        largest = max(sizes)
        if largest < cma.BUSY_MIN_BYTES:
            return buffers, None
        least = _least_by_address(pipe, busy)
        if largest < least or any(b.is_cuda for b in buffers):
            return buffers, None
        out: list[Buffer] = []
        ways: list[tuple[int, int, int]] = []
        for b, n in zip(buffers, sizes):
            if n >= least:
                if isinstance(b, Gather):
                    b = b.joined()
                ways.append((REMOTE, 0, b.data_ptr()))
            else:
                ways.append((0, 0, 0))
            out.append(b)
        return out, ways

    def _write(self, pipe: Pipe, buffers: Sequence[Buffer],
               ways: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """``ways`` with each buffer to be read by address for which the peer
        lent us a grant written into it now (WRITTEN); the rest as they
        were."""
        out = list(ways)
        for i, (flags, _, address) in enumerate(ways):
            n = buffers[i].numel()
            if flags != REMOTE or n < grants.MIN_BYTES:
                continue
            grant = grants.pick(pipe, n)
            if grant is None:
                continue
            gid, there = grant
            try:
                cma.write(pipe.cma.pid, there, address, n)
            except OSError as exc:
                # The peer is gone (its pipe breaks by the lifeline) or its
                # grant is not mapped: it reads this one by address instead.
                logger.debug("writing %d bytes into a grant of %s failed: %s", n, pipe.name,
                             exc.strerror or exc)
                continue
            out[i] = (WRITTEN, gid, 0)
            self.written_buffers += 1
        return out

    def _batchable(self, payload: bytes | memoryview, buffers: Sequence[Buffer]) -> bool:
        """Whether a message may wait in an outbox: small, in host memory
        and inline throughout (batch.py)."""
        total = len(payload)
        if total > batch.MAX_ITEM or self._host_as_device:
            return False
        for b in buffers:
            n = b.numel()
            total += n
            if b.is_cuda or n > self.limits.inline_threshold or total > batch.MAX_ITEM:
                return False
        return total <= self.limits.inline_total

    def _queue_small(self, pipe: Pipe, payload: bytes | memoryview,
                     buffers: Sequence[Buffer], hint: int) -> bool:
        """Put a message in ``pipe``'s outbox; sent at once if nothing is in
        flight any more (or the outbox is full).  False if it cannot wait
        (it would not go inline within the peer's limits): the outbox is
        then sent, and the caller sends the message alone."""
        # The rule is the native core's (csrc/send.c's queue), which the
        # Outlet's send applies itself; here for a message that came this
        # way (a backlog sent once its pipe opened, a caller's tuple).
        if self._outlet.queue(pipe, hint, payload, b"", list(buffers)):
            return True
        self.flush(pipe)
        return False

    def _track(self, pipe: Pipe, reqs: list[tuple[Request, Pipe]], frame: Request) -> None:
        """Watch the sends still in flight (waking the loop for them); a
        send that failed at once breaks the pipe.  ``frame``, the frame's
        own send, becomes the pipe's last frame while in flight (small
        messages then wait for it: batch.py): the frame by the rule the
        frames sent alone follow (the core's ``Outlet.track``), the rest
        here."""
        self._outlet.track(pipe, frame)
        waking = False
        for r, owner in reqs:
            if r is frame:
                continue
            if not r.done:
                self._inflight.append((r, owner))
                waking = True
                continue
            if (err := r.error()) is not None:
                self._failed(pipe, err)
        if waking:
            self._wake()
