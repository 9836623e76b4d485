"""The receiving side of a transport: frames off the worker, into messages.

Frames are found with ``tag_probe`` and received into memory of exactly
their size, after their claimed size and sender were judged worth it
(anyone can send to a worker).  A frame then says how big each data buffer
is and on which device, and a receive is posted for each straight into its
final memory (staged device buffers through pinned host chunks,
:mod:`.cuda.staging`), or, where it came by address, read out of the sender's
memory at once (:mod:`.hostmem.cma`; acknowledged through ``by_address``), or, where
its sender wrote it into memory we lent it, taken from there
(:mod:`.grants`).  Distinct tags per buffer let concurrent large messages
on one pipe proceed side by side.  A BATCH frame (:mod:`.wire.batch`) is taken
apart into the messages it holds.

Handshake frames are handed to the transport (``on_handshake``), which
owns the pipes' state; everything else on the way to ``on_message`` is
here.  All of it runs on the thread turning the loop.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from ..errors import AuthenticationError, BrokenError, FrameError
from .wire import batch
from .hostmem import cma
from .cuda import staging
from .wire.frame import (PACKED, PREFIX, REMOTE, STAGED, WRITTEN, BufferDesc, Frame, FrameKind,
                         Limits, decode, peek_kind, peek_seq)
from .by_address import ByAddress
from . import grants as _grants
from .grants import Grants
from .handshake import Handshake
from .pipe import Incoming, Piece, Pipe, Shared
from .hostmem.pool import PAGE
from .wire.tags import (HANDSHAKE, HINT_MASK, ID_MASK, ID_SHIFT, KIND_SHIFT, data_tag,
                        epoch_base, epoch_mask, kind_of, sender_of)
from .ucx.binding import Request, Taken, Worker
from .ucx.ucp import DONE
from .._core import Inlet

__all__ = ["Receiver", "MAX_HANDSHAKE_FRAME"]

logger = logging.getLogger(__name__)

#: (tag, mask) of every frame: handshake frames and messages (kinds 0 and
#: 1, the tag's top bit clear); data and the canary go to posted receives.
FRAMES = (0, 1 << 63)

MAX_HANDSHAKE_FRAME = 1024  # real ones are under 200 bytes
#: Frames up to this size (and max_frame_bytes) are received as they are
#: found, before they are judged (:meth:`Receiver.poll`): far under UCX's
#: rendezvous thresholds, so UCX holds all of one already.
SMALL_FRAME = 64 << 10
#: Why a frame being received is dropped: its pipe ended (not counted: it
#: was nobody's fault).
ENDED = "its pipe ended"

OnMessage = Callable[[int, memoryview, list[torch.Tensor]], None]
OnFrameError = Callable[[int, int, BaseException], None]
Allocator = Callable[[int, int], torch.Tensor]


def _inline_view(frame: np.ndarray, where: int, nbytes: int) -> torch.Tensor:
    """A buffer that travelled inside its frame, as a view of the frame
    (the ``Inlet`` makes them with this too)."""
    return torch.from_numpy(frame[where:where + nbytes])


def _inline(frame: np.ndarray, d: BufferDesc) -> torch.Tensor:
    return _inline_view(frame, d.where, d.nbytes)


class Receiver:
    """Receives and delivers the messages of one worker's pipes.

    Args:
        worker: the UCX worker to probe and receive on.
        limits: this side's limits.
        shared: the transport's pipes (read, never changed here) and the
            loop's list of requests in flight, where data receives go as
            ``(request, Incoming | Piece | None)``; the loop hands each back
            to :meth:`completed`.
        alloc: ``(nbytes, device)`` → memory for a data buffer.
        alloc_read: ``(nbytes, phase)`` → host memory for a buffer read by
            address, starting at ``phase`` in its page where it can (as
            the sender's does: see :meth:`.hostmem.pool.HostPool.alloc`).
        host_as_device: the debug switch of :mod:`.cuda.staging`.
        cuda_direct: whether this side's UCX takes device memory.
        bounce: device buffers sent directly land in buffers CUDA IPC can
            share, then are copied into their own (:mod:`.cuda.bounce`).
        on_message: ``(peer_id, payload, buffers)`` per complete message.
        on_frame_error: ``(peer_id, hint, error)`` for an authenticated
            peer's message that could not be taken (a limit, a failed
            allocation or receive).
        adopt: ``(sender, pipe)`` → the pipe for a HELLO from a worker id
            without one (dynamic membership), or ``pipe`` unchanged.
        handshake: takes the handshake frames
            (:meth:`.handshake.Handshake.on_frame`; AuthenticationError
            and FrameError it raises are counted here).
        by_address: told when the REMOTE buffers of a peer's frame were read
            (``read_done``), of a frame acknowledging more of ours than any
            before it (``on_ack``), and of CMA_OK / CMA_DONE frames
            (``on_frame``).
        grants: what this worker lends peers to write into, and what they
            lent it (GRANT frames).
    """

    def __init__(self, *, worker: Worker, limits: Limits, shared: Shared, alloc: Allocator,
                 alloc_read: Callable[[int, int], torch.Tensor], host_as_device: bool,
                 cuda_direct: bool, on_message: OnMessage, on_frame_error: OnFrameError,
                 adopt: Callable[[int, Pipe | None], Pipe | None], handshake: Handshake,
                 by_address: ByAddress, grants: Grants, bounce: bool = False) -> None:
        self._worker = worker
        self._bounce = bounce
        self.limits = limits
        #: Frames up to this size are received as they are taken.
        self.small = min(SMALL_FRAME, limits.max_frame_bytes)
        self._take = worker.taker(FRAMES[0], FRAMES[1], self.small)
        self._pipes = shared.pipes
        self._watch = shared.watch
        self._alloc = alloc
        self._alloc_read = alloc_read
        self._host_as_device = host_as_device
        self._cuda_direct = cuda_direct
        self._on_message = on_message
        self._on_frame_error = on_frame_error
        self._handshake = handshake
        self._adopt = adopt
        self._by_address = by_address
        self._grants = grants
        self._read_bytes = 0  # by _read (the Inlet counts its own)
        #: Frames being received: (request, buffer, tag, length, why
        #: dropped, the sender's pipe when it was probed, the sender's id).
        self.frames: list[tuple[Request, np.ndarray, int, int, str | None, Pipe | None,
                                int]] = []
        self.refused = 0
        self.frame_errors = 0
        u64 = (1 << 64) - 1
        #: :meth:`taken`, in C (csrc/receive.c): an authenticated peer's
        #: message without buffers or with inline ones only, or a batch of
        #: such messages, whole already and with nothing
        #: waiting before it (most frames), decoded, checked and handed to
        #: ``_on_message`` there; the rest handed back to the methods below
        #: (``_queue_taken``, ``_message_decoded``, ``_judged_bad``,
        #: ``_handler_failed``).  Three Python calls a message fewer, six
        #: for one with inline buffers (issue 52).  So is a message whose
        #: other buffers are read by address (:meth:`_read`'s), below the
        #: size from which this side lends a grant for the next
        #: (:meth:`.grants.Grants.lend`) and so below cma.SPLIT_BYTES; the
        #: acknowledgements frames carry are told to ``by_address`` there.
        self.inlet = Inlet(
            receiver=self, pipes=self._pipes, limits=limits, queue=self._queue_taken,
            decoded=self._message_decoded, judged_bad=self._judged_bad,
            handler_failed=self._handler_failed, bad=(AuthenticationError, FrameError),
            message=FrameKind.MESSAGE, batch=FrameKind.BATCH, done=DONE,
            inline_view=_inline_view, id_shift=ID_SHIFT,
            id_mask=ID_MASK, kind_shift=KIND_SHIFT, handshake=HANDSHAKE, hint_mask=HINT_MASK,
            max_frame=min(limits.max_frame_bytes, u64),
            max_message=min(limits.max_message_bytes, u64),
            by_address=(by_address.on_ack, alloc_read, by_address.due,
                        min(_grants.MIN_BYTES, cma.SPLIT_BYTES), PAGE))
        self.taken = self.inlet.taken  # type: ignore[method-assign]

    @property
    def read_bytes(self) -> int:
        """Bytes read out of peers' memory by address."""
        return self._read_bytes + self.inlet.read_bytes

    # ------------------------------------------------------------- frames

    def poll(self) -> bool:
        """Receive what arrived and hand on the frames that completed, in
        each sender's order: whether anything happened."""
        busy = False
        taken = self._take()
        if taken is not None:
            busy = True
            self.taken(taken)
        if self.frames:
            # A large frame (rendezvous) completes after a small one sent
            # behind it; frames are delivered in the order each sender sent
            # them, so a sender's frames wait behind its incomplete ones.
            frames, self.frames = self.frames, []
            still = []
            waiting: set[int] = set()
            seen = 0
            try:
                for entry in frames:
                    req, buf, tag, length, drop, _, sender = entry
                    seen += 1  # first: an entry is never handled twice
                    if sender in waiting or not req.done:
                        waiting.add(sender)
                        still.append(entry)
                        continue
                    busy = True
                    if drop is ENDED:
                        logger.debug("a frame from worker id %d's ended pipe dropped", sender)
                    elif drop:
                        self.dropped(tag, length, drop)
                    elif req.error() is None:
                        self.on_frame(tag, buf, sender)
            finally:
                # Whatever ends this turn (a BaseException from a callback,
                # which the handlers' ``except Exception`` lets through),
                # what was not looked at stays watched.
                self.frames[:0] = still + frames[seen:]
        return busy

    def taken(self, taken: list[Taken]) -> None:
        """Hand on the frames taken off UCX (a turn's ``ucp_take``, or a
        driver's native spin): each sender's in order, a whole one of an
        authenticated peer with nothing queued before it at once, the
        others queued for :meth:`poll` to look at as they complete.  A
        handler that raised a BaseException (which the handlers' ``except
        Exception`` lets through) ends the call, what was not looked at
        queued first.  (The native core's ``Inlet.taken``, bound over this
        in ``__init__``: see csrc/receive.c.)"""

    def _queue_taken(self, tag: int, length: int, req: Request | None, got: Any, sender: int,
                     pipe: Pipe | None) -> None:
        """A taken frame not to be handled at once (the ``Inlet``'s word):
        queued, received whole where it is wanted, into one byte where it
        is not (UCX truncates and drops it: it costs no memory here)."""
        if (pipe is not None and length <= self.limits.max_frame_bytes
                and tag >> KIND_SHIFT != HANDSHAKE and pipe.auth.in_key is not None):
            drop = None  # an authenticated peer's, within the limit: wanted
        else:
            drop = self.unwanted(tag, length, sender)
        self._queue_frame(tag, length, req, got, drop, pipe, sender)

    def _handler_failed(self, pipe: Pipe, exc: Exception) -> None:
        """The agent's handler raised ``exc`` for a message of ``pipe``'s
        (the ``Inlet``'s word): logged, and the turn goes on."""
        logger.error("message handler failed for a message from %s", pipe.name, exc_info=exc)

    def _queue_frame(self, tag: int, length: int, req: Request | None, got: Any,
                     drop: str | None, pipe: Pipe | None, sender: int) -> None:
        """A taken frame into :attr:`frames`, received into memory of its
        own where ``ucp_take`` left it (``req`` None: a large one) and
        ``drop`` does not say it is to go (then one byte: UCX truncates)."""
        if req is None:
            buf = np.empty(1 if drop else length, dtype=np.uint8)
            req = self._worker.recv_taken(buf, got)
        else:
            buf = got
        self.frames.append((req, buf, tag, length, drop, pipe, sender))

    def unwanted(self, tag: int, length: int, sender: int | None = None) -> str | None:
        """Why a probed frame is not worth receiving, judged before a byte of
        it is read: anyone can send to a worker, and a receive buffer of the
        size claimed would let them fill our memory.  ``sender``: the id
        ``tag`` claims, where the caller has it."""
        if length > self.limits.max_frame_bytes:
            return f"exceeds max_frame_bytes={self.limits.max_frame_bytes}"
        if tag >> KIND_SHIFT == HANDSHAKE:
            return "too large for a handshake" if length > MAX_HANDSHAKE_FRAME else None
        if sender is None:
            sender = sender_of(tag)
        pipe = self._pipes.get(sender)
        if pipe is None:
            return "from an unknown worker id"
        if pipe.auth.in_key is None and not pipe.auth.in_nonces:
            # A peer that re-established its pipe sends its first frames
            # right behind the PROOF, probed in the same turn, before that
            # PROOF installs the next generation that answered its HELLO.
            nxt = self._handshake.tentative.get(sender)
            if nxt is None or not nxt.auth.in_nonces:
                return "from a peer that has not authenticated"
        return None

    def dropped(self, tag: int, length: int, why: str) -> None:
        """Count a frame received into nothing.  Its tag is all we know, and
        a tag is only a claim: nothing is done on its word (senders check
        the receiver's max_frame_bytes before sending)."""
        if length > self.limits.max_frame_bytes:
            self.frame_errors += 1
        else:
            self.refused += 1
        logger.warning("dropped a %d-byte frame claiming to be from worker id %d: %s",
                       length, sender_of(tag), why)

    def on_frame(self, tag: int, buf: np.ndarray, sender: int | None = None) -> None:
        """A whole frame arrived on ``tag`` (from the worker id ``sender``
        claims, where the caller has it): act on it, or count why not."""
        if sender is None:
            sender = sender_of(tag)
        kind = tag >> KIND_SHIFT  # (tags.py's kind_of, inline)
        pipe = self._pipes.get(sender)
        if kind == HANDSHAKE and peek_kind(buf) == FrameKind.HELLO:
            pipe = self._adopt(sender, pipe)
        if pipe is None:
            self.refused += 1
            logger.warning("refused a frame from unknown worker id %d", sender)
            return
        if kind != HANDSHAKE and pipe.auth.in_key is not None:
            # As a frame taken whole is (the Inlet, in C): decoded and
            # checked, handed on there or to _message_decoded, or judged
            # bad.  Most frames of more than one shared-memory segment
            # (8 KiB) come this way, found while still arriving.
            self.inlet.frame(pipe, buf, tag & HINT_MASK)
            return
        try:
            if kind == HANDSHAKE:
                self._handshake.on_frame(pipe, decode(buf, None, self.limits))
            else:
                self.refused += 1
                logger.warning("refused an unauthenticated frame claiming to be from %s "
                               "(seq %s)", pipe.name, peek_seq(buf))
        except (AuthenticationError, FrameError) as exc:
            self._judged_bad(pipe, exc)

    def _judged_bad(self, pipe: Pipe, exc: AuthenticationError | FrameError) -> None:
        if isinstance(exc, AuthenticationError):
            self.refused += 1
            logger.warning("%s", exc)
            return
        self.frame_errors += 1
        # A pipe of a later generation may still see a frame its
        # predecessor's connection delivers late (TCP retransmitting after an
        # outage): its MAC, made with the old key, fails.
        logger.warning("dropped a frame from %s: %s%s", pipe.name, exc,
                       " (maybe one of its pipe's earlier generation, delivered late)"
                       if pipe.gen else "")

    # ----------------------------------------------------------- messages

    def _message_decoded(self, pipe: Pipe, buf: np.ndarray, frame: Frame, hint: int) -> None:
        """An authenticated peer's frame, decoded (its MAC and limits
        checked): its sequence number checked and taken, then what it
        holds acted on.  (The ``Inlet`` hands on here, unchanged, every
        frame it does not deliver itself.)"""
        if frame.seq <= pipe.inbound.seq:
            raise FrameError(f"replayed or reordered frame (seq {frame.seq} after {pipe.inbound.seq})")
        pipe.inbound.seq = frame.seq
        pipe.inbound.peer_busy = frame.busy
        if frame.ack > pipe.cma.acked:
            self._by_address.on_ack(pipe, frame.ack)
        if frame.kind is FrameKind.BATCH:
            self._batch(pipe, buf, frame)
            return
        if frame.kind is not FrameKind.MESSAGE:
            if frame.kind is FrameKind.CMA_OK or frame.kind is FrameKind.CMA_DONE:
                self._by_address.on_frame(pipe, frame)
            elif frame.kind is FrameKind.GRANT:
                self._grants.on_frame(pipe, frame)
            return
        # (the limit tested here first: _too_big is a call a message)
        if frame.total > self.limits.max_message_bytes and self._too_big(pipe, frame, hint):
            self._drain(pipe, frame)
            return
        if not frame.buffers:
            # Most messages (a no-op's request, most replies): nothing to
            # post, read or lend, so no Incoming to wait on (issue 52).
            self._hand_on(pipe, hint, frame.payload, [])
            return
        bufs: list[Any] = []
        msg = Incoming(pipe, frame, bufs, hint)
        read = False
        # (bytes, phase) of what came by address or was written into our
        # memory; made only for such a message (most have none).
        large: list[tuple[int, int]] | None = None
        for i, d in enumerate(frame.buffers):
            if d.inline:
                bufs.append(_inline(buf, d))
            elif d.flags == PACKED:
                bufs.append(None)  # cut out of its pack when that arrives
            elif d.flags == REMOTE or d.flags == WRITTEN:
                if d.flags == REMOTE:
                    bufs.append(self._read(msg, i, d))
                    phase = d.where % PAGE  # the sender's address
                    read = True
                else:
                    bufs.append(self._written(msg, i, d))
                    phase = bufs[-1].data_ptr() % PAGE
                if large is None:
                    large = []
                large.append((d.nbytes, phase))
            else:
                bufs.append(self._post(msg, i, d))
        if read:  # before delivering: a reply sent meanwhile carries the word
            pipe.cma.read_through = frame.seq
        if large is not None and msg.error is None:
            # Before delivering too: the grant is to be there before the
            # peer's next buffer, which may follow the reply at once.
            self._grants.lend(pipe, large)
        if msg.waiting == 0:
            self._deliver(msg)
        if read:
            self._by_address.read_done(pipe)

    def _post(self, msg: Incoming, i: int, d: BufferDesc) -> torch.Tensor:
        """Post the receives of buffer ``i`` of ``msg``; what it lands in."""
        tag = data_tag(msg.pipe.peer_id, msg.pipe.auth.in_epoch, msg.frame.seq, i)
        target: torch.Tensor | None = None
        if msg.error is None:
            try:
                if d.device >= 0 and not d.flags & STAGED and not self._cuda_direct:
                    raise FrameError(f"{msg.pipe.name} sent device memory directly (buffer "
                                     f"{i}), but this worker's UCX has no CUDA transport")
                target = self._alloc(d.nbytes, d.device)
            except Exception as exc:
                msg.error = exc
        if target is None:  # this or an earlier buffer failed: consume what comes, into nothing
            target = torch.empty(0, dtype=torch.uint8)
            count = staging.receives(d)
            for _ in range(count):
                self._watch.append((self._worker.tag_recv(target, tag), msg))
            msg.waiting += count
            return target
        if d.flags & STAGED or self._bounce and target.is_cuda and d.nbytes:
            landings = (staging.landings(target, d, self._host_as_device) if d.flags & STAGED
                        else [staging.bounced_landing(target)])
            for landing in landings:
                req = self._worker.tag_recv(landing.into, tag)
                msg.waiting += 1
                self._watch.append((req, msg if landing.then is None
                                    else Piece(msg, landing.then)))
            return target
        msg.waiting += 1
        self._watch.append((self._worker.tag_recv(target, tag), msg))
        return target

    def _read(self, msg: Incoming, i: int, d: BufferDesc) -> torch.Tensor:
        """Read buffer ``i`` of ``msg`` out of its sender's memory, now (the
        GIL is dropped for the copy); what it landed in.  A failure fails
        the message, naming the buffer and why."""
        pipe = msg.pipe
        if msg.error is not None:
            return torch.empty(0, dtype=torch.uint8)
        try:
            if not pipe.cma.reads:
                raise FrameError(f"{pipe.name} sent buffer {i} by address, but this worker "
                                 "never offered to read it by address")
            target = self._alloc_read(d.nbytes, d.where % PAGE)
            cma.read(pipe.cma.pid, target.data_ptr(), d.where, d.nbytes)
        except OSError as exc:
            msg.error = BrokenError(f"reading buffer {i} ({d.nbytes} bytes) out of "
                                    f"{pipe.name}'s memory failed: {exc.strerror or exc}")
            return torch.empty(0, dtype=torch.uint8)
        except Exception as exc:
            msg.error = exc
            return torch.empty(0, dtype=torch.uint8)
        self._read_bytes += d.nbytes
        return target

    def _written(self, msg: Incoming, i: int, d: BufferDesc) -> torch.Tensor:
        """Buffer ``i`` of ``msg``, which its sender wrote into our memory;
        a failure fails the message, naming the buffer and why."""
        try:
            target = self._grants.take(msg.pipe, i, d)
        except FrameError as exc:
            if msg.error is None:
                msg.error = exc
            return torch.empty(0, dtype=torch.uint8)
        return target if msg.error is None else torch.empty(0, dtype=torch.uint8)

    def _too_big(self, pipe: Pipe, frame: Frame, hint: int) -> bool:
        """Refuse a message over max_message_bytes, telling the agent (which
        answers or fails the call ``hint`` names)."""
        if frame.total <= self.limits.max_message_bytes:
            return False
        self.frame_errors += 1
        pipe.inbound.received += 1
        self._on_frame_error(pipe.peer_id, hint, FrameError(
            f"message of {frame.total} bytes exceeds max_message_bytes="
            f"{self.limits.max_message_bytes}"))
        return True

    def _batch(self, pipe: Pipe, buf: np.ndarray, frame: Frame) -> None:
        """Deliver each message of a BATCH frame (its MAC checked) in order;
        the limits apply to each message, as if it had come alone."""
        if frame.buffers:
            raise FrameError(f"a batch frame from {pipe.name} has buffers of its own")
        for raw in batch.unpack(buf, PREFIX.size, len(frame.payload)):
            inner = decode(raw, None, self.limits)
            if inner.kind is not FrameKind.MESSAGE or not all(d.inline for d in inner.buffers):
                raise FrameError(f"a batch from {pipe.name} holds a message that is not "
                                 "small (only inline buffers may be batched)")
            hint = inner.seq & HINT_MASK
            if self._too_big(pipe, inner, hint):
                continue
            bufs = [_inline(raw, d) for d in inner.buffers]
            self._deliver(Incoming(pipe, inner, bufs, hint))

    def _drain(self, pipe: Pipe, frame: Frame) -> None:
        """Consume a rejected message's buffers (truncated into one byte) so
        they do not sit in UCX's unexpected queue; their errors are ignored.
        Those sent by address are not read, and are let go."""
        if any(d.flags == REMOTE for d in frame.buffers):
            pipe.cma.read_through = frame.seq
            self._by_address.read_done(pipe)
        for i, d in enumerate(frame.buffers):
            if d.flags == WRITTEN:  # used all the same: the grant goes back to the pool
                try:
                    self._grants.take(pipe, i, d)
                except FrameError:
                    pass
                continue
            for _ in range(staging.receives(d)):
                sink = np.empty(1, dtype=np.uint8)
                req = self._worker.tag_recv(sink, data_tag(pipe.peer_id, pipe.auth.in_epoch,
                                                                   frame.seq, i))
                self._watch.append((req, None))

    def completed(self, req: Request, owner: Incoming | Piece) -> None:
        """One of a message's data receives completed (the loop calls this
        for the owners this side put on the watch list)."""
        err: BaseException | None = req.error()
        if isinstance(owner, Piece):
            if err is None:
                try:
                    owner.then()
                except Exception as exc:  # a failed copy fails its message
                    err = exc
            owner = owner.msg
        owner.waiting -= 1
        if err is not None and owner.error is None:
            owner.error = BrokenError(f"receiving a buffer from {owner.pipe.name} "
                                      f"failed: {err}")
        if owner.waiting == 0:
            self._deliver(owner)

    def abandon(self, pipe: Pipe) -> list[tuple[Request, Any]]:
        """``pipe`` ended (broken, or replaced by a new generation or a new
        process of its peer): let go of what it was receiving, so nothing
        is watched for it any more and the loop goes quiet (on the loop).
        Returns what was taken off the loop's lists: the transport keeps
        them until UCX ends them (their buffers may still be written).

        Its receives posted for data that may never come (a peer whose host
        went silent sends nothing more, and UCX fails them only where a
        kernel reset the connection) are cancelled where UCX can
        (``ucp_request_cancel`` ends a receive not yet matched; one matched
        to a rendezvous in progress, or made through ucxx, cannot be), and
        all of them, with its frames still being received, are no longer
        watched; its data already waiting unmatched in UCX's unexpected
        queue is drained (its tags carry the pipe's epoch, which no later
        pipe from that peer reuses: wire/tags.py).  A message of it being
        received is never delivered.
        """
        if pipe.inbound.abandoned:
            return []
        pipe.inbound.abandoned = True
        taken: list[tuple[Request, Any]] = []
        kept: list[tuple[Request, Any]] = []
        cancelled = 0
        for req, owner in self._watch:
            msg = owner.msg if isinstance(owner, Piece) else owner
            if isinstance(msg, Incoming) and msg.pipe is pipe:
                cancelled += self._worker.cancel(req)
                taken.append((req, owner))
            else:
                kept.append((req, owner))
        self._watch[:] = kept
        # A message frame of it still being received (a large one comes by
        # rendezvous) goes too; a handshake frame is not its (it may start
        # the next generation) and is judged on its own.
        frames = []
        for entry in self.frames:
            req, _, tag, _, _, of, _ = entry
            if of is pipe and kind_of(tag) != HANDSHAKE:
                cancelled += self._worker.cancel(req)
                taken.append((req, None))
            else:
                frames.append(entry)
        self.frames = frames
        drained = 0
        if pipe.auth.in_epoch >= 0:
            base = epoch_base(pipe.peer_id, pipe.auth.in_epoch)
            while (probe := self._worker.probe(base, epoch_mask())) is not None:
                sink = np.empty(1, dtype=np.uint8)  # truncated: UCX drops the rest
                self._watch.append((self._worker.recv_probed(sink, probe), None))
                drained += 1
        if taken or drained:
            logger.info("pipe to %s ended: %d receives let go (%d cancelled), %d unmatched "
                        "buffers drained", pipe.name, len(taken), cancelled, drained)
        return taken

    def _deliver(self, msg: Incoming) -> None:
        buffers = msg.buffers
        if msg.error is None and msg.frame.delivered >= 0 and not msg.pipe.inbound.abandoned:
            try:
                buffers = staging.finish(buffers, msg.frame.buffers, msg.frame.delivered,
                                         self._alloc)
            except Exception as exc:
                msg.error = exc
        self._hand_on(msg.pipe, msg.hint, msg.frame.payload, buffers, msg.error)

    def _hand_on(self, pipe: Pipe, hint: int, payload: memoryview, buffers: list[Any],
                 error: BaseException | None = None) -> None:
        """A whole message to the agent, or why it could not be taken;
        nothing where its pipe ended (its calls were failed then)."""
        if pipe.inbound.abandoned:
            logger.debug("a message from %s's ended pipe dropped", pipe.name)
            return
        pipe.inbound.received += 1
        try:
            if error is not None:
                self._on_frame_error(pipe.peer_id, hint, error)
            else:
                self._on_message(pipe.peer_id, payload, buffers)
        except Exception:
            logger.exception("message handler failed for a message from %s", pipe.name)
