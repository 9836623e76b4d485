"""Pipes to peers over one UCX worker, and the loop that progresses them.

Tags (:mod:`.wire.tags`) say what a tag message is and whom it claims to come from.

Peer death is the kernel's verdict, never silence's: each pipe that opens
also connects a lifeline to the peer's lifeline port (:mod:`.watch.lifeline`), which
the peer's kernel closes when its process ends, and which its kernel keeps
answering while the process is merely busy or stopped.  A silent peer's
calls fail by their own timeouts, in the agent, as in torch.

Progress: one thread per transport turns the loop of :mod:`.loop.progress`,
whose strategy (``progress=``; adaptive by default) decides when it polls
an idle worker and when it sleeps in epoll; a thread waiting for a message
may turn it itself (:meth:`Transport.drive`).  Senders call UCX directly from
their own thread (no hand-off on the send path; :mod:`.send`) and wake the
loop only when a send is left in flight.

Parts of their own: the handshake (:mod:`.handshake`), sending and
batching (:mod:`.send`, :mod:`.wire.batch`), receiving (:mod:`.receive`),
reading by address and writing into lent memory (:mod:`.by_address`,
:mod:`.hostmem.cma`, :mod:`.grants`), liveness, lifelines and the shared-memory
queue check (:mod:`.liveness`), pipes (:mod:`.pipe`) and the loop
(:mod:`.loop.progress`).  This module is the context that holds them together:
the pipes (adding, opening, breaking, closing) and the loop's turn.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from .._core import Expect
from ..errors import AuthenticationError, BrokenError, ClosedError, ConnectError, UnreachableError
from .cuda import bounce, staging
from .cuda.side import CudaSide, alloc as cuda_alloc
from .watch import canary
from .watch.lifeline import probe as lifeline_probe
from .hostmem import cma
from .loop import progress, strategy
from .by_address import ByAddress
from .wire.frame import FrameKind, Limits, check_limits
from .wire.gather import Buffer
from .grants import Grants
from .handshake import Handshake
from .liveness import Liveness
from .pipe import OutState, Peer, Pipe, Shared, cuda_path
from .hostmem.pool import HostPool
from .receive import FRAMES, Allocator, OnFrameError, OnMessage, Receiver
from .send import Sender
from .wire.tags import HINT_MASK, MAX_WORKER_ID
from .ucx.binding import Endpoint, Request, Worker, device_path
from .ucx.environment import effective_tls, tcp_segment

logger = logging.getLogger(__name__)

#: How long the progress loop polls after its last event, by default
#: (``spin_s``), while a message is expected.
SPIN_S = 0.01
#: How many of a peer's recent epochs a new pipe's must differ from.
EPOCHS_KEPT = 16
#: While requests of ended pipes are held, how often an idle turn asks
#: whether UCX ended them (their buffers, device memory too, go then).
PRUNE_EVERY_S = 1.0

OnBroken = Callable[[int, BaseException], None]


class Transport:
    """Authenticated, framed messages to peers over UCX.

    Thread-safety: :meth:`send` may be called from any thread.
    ``on_message`` and ``on_frame_error`` run on the thread turning the loop
    (the progress thread, or a thread in :meth:`drive`); ``on_broken`` there
    too, or on the lifeline thread when the kernel cut a peer's lifeline
    (``_break`` runs on any thread).  None may block.

    Args:
        my_id: this worker's id (< 65536), carried in every tag.
        secret: the job secret every peer must prove knowledge of.
        on_message: ``(peer_id, payload, buffers)`` for each complete message.
        on_frame_error: ``(peer_id, hint, error)`` for a message from an
            authenticated peer that broke a limit; ``hint`` is what the sender
            passed to :meth:`send`, so the caller can answer that message.
        on_broken: ``(peer_id, error)`` when a pipe fails: once for good
            (a :class:`BrokenError`), or, while the peer's process may live
            on, as an :class:`UnreachableError` (then ``on_restored`` once
            it is re-established, or ``on_broken`` again once the peer is
            found gone).
        on_restored: ``(peer_id)`` once a pipe broken as unreachable is
            re-established (a handshake of its next generation completed).
        progress_mode: the progress thread's strategy
            (:class:`.loop.strategy.Mode` or its name).
        spin_s: how long the progress thread may poll after the last event
            before it sleeps in epoll.
        spin_while: polling holds the GIL between UCX calls, which starves
            a thread running Python code: idle polling stops as soon as these
            rules (the native core's ``Expect``'s, csrc/expect.c) give
            anything but :attr:`.loop.strategy.Why.AWAITED` (the reason why;
            call :meth:`wake` when it may poll again).  None: always
            AWAITED.
        host_timeout: seconds a peer's host may leave TCP keepalive on its
            lifeline unanswered (a vanished host, a partition) before its
            pipe breaks.  A live process's kernel answers for it, however
            busy or stopped the process is.
        cuda_devices: the CUDA devices this worker declared; where a GPU is
            usable, the first one's context (else the current device's) is
            made current for UCX (:mod:`.cuda.context`).
        worker, endpoint: the UCX worker and endpoint classes
            (:mod:`.ucx.binding`'s; a test hands in its own, a fake network).

    Raises:
        ValueError: a bad ``UCXRPC_DEVICE_PATH`` (:func:`.ucx.device_path`)
            or a ``UCX_*`` setting known to break pipes.
    """

    def __init__(self, *, my_id: int, secret: bytes, on_message: OnMessage,
                 on_frame_error: OnFrameError, on_broken: OnBroken,
                 on_restored: Callable[[int], None] = lambda peer_id: None,
                 limits: Limits = Limits(), transports: Sequence[str] | None = None,
                 allocator: Allocator | None = None,
                 progress_mode: strategy.Mode | str = strategy.Mode.ADAPTIVE,
                 spin_s: float = SPIN_S,
                 spin_while: Sequence[tuple[Any, ...]] | None = None,
                 host_timeout: float = 10.0,
                 cuda_devices: Sequence[torch.device | str | int] = (),
                 worker: Callable[..., Worker] = Worker,
                 endpoint: Callable[..., Endpoint] = Endpoint) -> None:
        if not 0 <= my_id <= MAX_WORKER_ID:
            raise ValueError(f"worker id {my_id} out of range [0, {MAX_WORKER_ID}]")
        self.my_id = my_id
        self._on_message = on_message
        self._on_frame_error = on_frame_error
        self._on_broken = on_broken
        self._on_restored = on_restored
        self.limits = limits
        self.pool = HostPool()
        self._alloc = allocator or self._default_alloc
        #: Dynamic membership: what a worker id we have no pipe for published,
        #: or None; asked when such a worker says HELLO.
        self.on_unknown_peer: Callable[[int], Peer | None] | None = None
        self._data_spins = 8
        self._transports = transports
        self._cuda = CudaSide(cuda_devices, transports)
        # Any process with a usable GPU may send CUDA memory: its own device
        # maps' tensors, and replies along a caller's map reversed.
        self._endpoint_class = endpoint
        # UCX's CUDA transports open under the calling thread's context: the
        # device's, lent to this thread (the user's) while the worker opens,
        # and the thread's own, or none, again after (issue 50: the user's
        # current device never changes).  The progress thread makes it
        # current for good on its own thread (_progress_started).
        with self._cuda.lent() as cuda_context:
            #: Whose CUDA context UCX sees, or why none (for pipe_info and tests).
            self.cuda_context = cuda_context
            self._worker = worker(transports, host_timeout,
                                  device_memory=self._cuda.device is not None,
                                  device_path=device_path())
        self.address = self._worker.address
        #: UCX's TCP fragment size here (published: a peer's must be the same).
        self.tcp_segment = tcp_segment()
        self._host_as_device = staging.debug_host_as_device()
        #: What peers need to read our buffers by address (published), or
        #: None: not possible here, or the job's transports leave shared
        #: memory out.
        self.cma_offer = cma.offer() if cma.allowed(effective_tls(transports)) else None
        # Whether this side's UCX takes device memory; a pipe is GPU-direct
        # when both sides' do, and stages device buffers otherwise.
        takes_device = self._worker.cuda_memory and not self._host_as_device
        memory_way = (self._cuda.memory_way(self._worker.loaded) if takes_device
                      else bounce.Way.AS_IS)
        self._bounce = memory_way is bounce.Way.BOUNCED
        self.cuda_direct = takes_device and memory_way is not bounce.Way.STAGED
        #: The containers the parts below share (:class:`.pipe.Shared` says
        #: who changes which).
        self._shared = shared = Shared()
        self._pipes = shared.pipes
        self._tasks = shared.tasks
        self._inflight = shared.inflight
        self._watch = shared.watch
        # The loop's strategy, kept here too: every frame sent asks it
        # (the sender's contended()), and the loop's own is behind a property.
        self._strategy = strategy.strategy(progress_mode)
        self._sender = Sender(my_id=my_id, limits=limits,
                              host_as_device=self._host_as_device, inflight=shared.inflight,
                              wake=self._loop_nudge, failed=self._send_failed,
                              pipes=shared.pipes, strategy=self._strategy, bounce=self._bounce)
        #: :attr:`.send.Sender.send_alone`: the agent's way for a message
        #: without buffers or with inline ones only, before :meth:`send`.
        self.send_alone = self._sender.send_alone
        self._by_address = ByAddress(sender=self._sender, send=self._send_or_queue,
                                     endpoint=self._endpoint,
                                     offered=self.cma_offer is not None)
        #: By peer id: the epochs its data tags carried lately (a new
        #: pipe's must differ: wire/tags.py).
        self._epochs: dict[int, deque[int]] = {}
        #: Pipes replaced by their next generation (their peer came back).
        self.renewed = 0
        #: UCX's TCP connections cut as stuck when an endpoint was discarded
        #: (:meth:`_let_go_of_endpoint`).
        self.cut = 0
        #: Requests of ended pipes UCX has not ended yet (:meth:`_abandon`).
        self._retired: list[tuple[Request, Any]] = []
        self._next_prune = 0.0
        self._handshake = Handshake(my_id=my_id, secret=secret, limits=limits,
                                    sender=self._sender, endpoint=self._endpoint,
                                    watch=shared.watch, fail=self._break,
                                    accepted=self._authenticated, opened=self._restored,
                                    successor=self._successor, install=self._install,
                                    epochs=lambda peer: self._epochs.get(peer, ()))
        alloc_read = (self.pool.alloc if allocator is None
                      else lambda n, _phase: self._alloc(n, -1))
        self._grants = Grants(alloc=alloc_read, send=self._send_or_queue)
        self._rx = Receiver(worker=self._worker, limits=limits, shared=shared,
                            alloc=self._alloc, alloc_read=alloc_read,
                            host_as_device=self._host_as_device, cuda_direct=self.cuda_direct,
                            on_message=on_message, on_frame_error=on_frame_error,
                            adopt=self._adopt, handshake=self._handshake,
                            by_address=self._by_address, grants=self._grants,
                            bounce=self._bounce)
        self._closing = False
        # What a drive asks (the loop's expected, quiet and pending), as
        # rules the native core reads without calling Python (csrc/expect.c;
        # as methods, six calls a drive a side: Run BA).  expected: data in
        # flight (our sends and receives, frames being received) keeps it
        # polling; otherwise nothing once overdue.  Then not while a peer
        # copies what we sent it by address in two halves, on two threads (a
        # polling thread here would take a core that copy runs on: 16 MiB
        # one-way on a quiet host, p50 2.0-4.0 ms polling, 1.7-2.5 ms not);
        # a read in one call leaves the peer's other core free, and its
        # reply (which says the read is done) is then taken at once.  Nor
        # while a peer may write into our memory in two halves (grants.py),
        # for the same reason.  Then the agent's word (spin_while).
        Why = strategy.Why
        self._expected = Expect((
            ("any", (shared.watch, (self._rx, "frames")), Why.IN_FLIGHT),
            ("overdue", Why.QUIET),
            ("any", ((self._sender, "holding_split"),), Why.PEER_COPYING),
            ("when", (self._grants, "split_until"), self._grants.split_write_due,
             Why.PEER_COPYING),
            *(spin_while if spin_while is not None else (("then", Why.AWAITED),))))
        self._liveness = Liveness(worker=self._worker, transports=transports, my_id=my_id,
                                  host_timeout=host_timeout, pipes=shared.pipes,
                                  fail=self._lifeline_verdict, back=self._came_back)
        self._queue_check = self._liveness.queue_check
        # quiet: a turn would only look for a frame (nothing sent or received
        # in flight, no task or frame waiting, no check or by-address
        # acknowledgement due); the loop then spins natively instead of
        # turning.  Read by the core, as expected is.
        self._quiet = Expect((
            ("any", (shared.watch, shared.inflight, shared.tasks, (self._rx, "frames"),
                     (self._queue_check, "waiting"), (self._by_address, "due")), False),
            ("then", True)))
        #: What peers need to watch this process's lifeline (published).
        self.lifeline = self._liveness.address
        self._loop = progress.ProgressThread(
            name=f"ucxrpc-progress-{my_id}", progress=self._worker.progress, turn=self._turn,
            expected=self._expected, spin_s=spin_s,
            pending=Expect((("any", (shared.tasks, shared.inflight), True),
                            ("then", False))),
            arm=self._worker.arm, fd=self._worker.fd, strategy=self._strategy,
            on_stall=self._liveness.excuse_stall, on_start=self._progress_started,
            spin=self._worker.spinner(*FRAMES, self._rx.small), quiet=self._quiet,
            on_taken=self._rx.taken)
        if self._cuda.device is None:
            # The host's path (see drive): the loop's own drive, bound over
            # the method, a call fewer every wait (issue 52).
            self.drive = self._loop.drive  # type: ignore[method-assign, assignment]
        # The loop's own wake (C), bound over the method: every rpc_async
        # wakes the loop (issue 52).
        self.wake = self._loop.wake  # type: ignore[method-assign]

    # ------------------------------------------------------------------ API

    def start(self) -> None:
        self._liveness.start()
        self._loop.start()

    def add_peer(self, peer: Peer) -> None:
        """Register ``peer`` (what it published: :class:`.pipe.Peer`); its
        pipe opens on first use (ours or theirs).  A peer known under
        another address (a worker that left and joined again) gets a new
        pipe; the old one's failures are ignored."""
        old = self._pipes.get(peer.id)
        if old is not None and old.address == peer.address:
            return
        self._pipes[peer.id] = self._new_pipe(peer, 0)
        if old is not None:
            self._liveness.forget(old)
            self._handshake.forget(peer.id)
            with old.lock:
                if not old.closed:  # its endpoint dies with the process
                    old.move_to(OutState.CLOSED)
            self._call_soon(functools.partial(self._abandon, old))

    def _new_pipe(self, peer: Peer, gen: int) -> Pipe:
        """A pipe of generation ``gen`` to what ``peer`` published.  A peer
        whose UCX TCP fragments differ in size from ours gets a pipe broken
        from the start, naming both: UCX's TCP transport sizes fragments by
        the sender's setting, and a receiver with a smaller one overruns its
        buffer (docs/ucx-notes.md, pitfall 20)."""
        pipe = Pipe(peer.id, peer.name, peer.address, peer.lifeline, gen=gen, record=peer)
        if peer.tcp_segment is not None and self.tcp_segment is not None \
                and peer.tcp_segment != self.tcp_segment:
            pipe.move_to(OutState.BROKEN)
            pipe.error = ConnectError(
                f"UCX_TCP_RX_SEG_SIZE is {self.tcp_segment} bytes here and "
                f"{peer.tcp_segment} on {peer.name}: UCX's TCP transport overruns a receiver's "
                "buffer when they differ; give every worker of the job the same (or leave it "
                "unset: ucxrpc's default is 512K)")
        pipe.direct = self.cuda_direct and peer.cuda_direct
        if peer.max_frame_bytes is not None:
            pipe.out.peer_max_frame = peer.max_frame_bytes
        if self.cma_offer is not None and peer.pid:
            pipe.cma.pid = peer.pid
            pipe.cma.offer = cma.parse(peer.cma_offer)
        return pipe

    def process_gone(self, peer: Peer, timeout: float = 2.0) -> str | None:
        """Why the process ``peer`` published is gone, by its kernel's answer
        at its lifeline port, asked now (blocking, at most ``timeout``
        seconds per address); None where it answered, nothing did, or it
        published no lifeline: no verdict."""
        if not peer.lifeline:
            return None
        try:
            return lifeline_probe(peer.lifeline, timeout)
        except ValueError:
            return None

    def check(self, peer_id: int) -> None:
        """Make sure the kernel watches ``peer_id`` for us (its lifeline is
        connected), without opening the pipe: a peer that is already gone
        is found at once, one we never talked to included."""
        pipe = self._pipes.get(peer_id)
        if pipe is not None:
            self._liveness.watch(pipe)

    def send(self, peer_id: int, payload: bytes | memoryview, buffers: Sequence[Buffer],
             hint: int = 0, devices: list[int] | None = None, alone: bool = True) -> None:
        """Queue a message; returns once UCX holds it (not once delivered).

        ``devices``: where each buffer is to land on the peer (-1 host memory,
        else a CUDA index); by default where it is here.  ``alone=False``:
        the caller's :attr:`send_alone` just declined it (not tried again).

        Raises:
            ClosedError / BrokenError: the transport or pipe is down.
            FrameError: the message breaks a configured limit.
        """
        if alone and (self.send_alone(peer_id, hint, payload, b"", buffers)
                      if type(buffers) is list
                      else not buffers and self.send_alone(peer_id, hint, payload, b"")):
            return
        pipe = self._pipes.get(peer_id)
        if pipe is None:
            raise BrokenError(f"no pipe to worker id {peer_id}")
        outer = progress.guard()  # Ctrl-C waits for the send to end
        try:
            self._send_or_queue(pipe, payload, buffers, FrameKind.MESSAGE, hint & HINT_MASK,
                                devices)
        finally:
            progress.unguard(outer)

    def _send_or_queue(self, pipe: Pipe, payload: bytes | memoryview,
                       buffers: Sequence[Buffer], kind: FrameKind, hint: int = 0,
                       devices: list[int] | None = None) -> None:
        with pipe.lock:
            if pipe.out.state is OutState.OPEN:
                self._sender.send(pipe, payload, buffers, kind, hint, devices)
                return
            if pipe.out.state in (OutState.BROKEN, OutState.CLOSED):
                raise self._pipe_error(pipe)
            # Checked before queueing, as _send_locked's encode would: a
            # message queued behind the handshake is encoded later, with
            # nobody left to tell.
            check_limits(len(payload), len(buffers), sum(b.nbytes for b in buffers),
                         self.limits, pipe.out.peer_max_frame, pipe.name)
            pipe.out.backlog.append((payload, buffers, kind, hint, devices))
            if pipe.out.state is OutState.NEW:
                pipe.move_to(OutState.HELLO_SENT)
                self._call_soon(lambda: self._start_handshake(pipe))

    def pipe_info(self, peer_id: int | None = None) -> list[dict[str, Any]]:
        out = []
        for pid, pipe in sorted(self._pipes.items()):
            if peer_id is not None and pid != peer_id:
                continue
            if pipe.ep is None:
                continue
            lanes = pipe.ep.transports()
            transports = {t for t, _ in lanes}
            out.append({
                "peer": pipe.name, "peer_id": pid, "state": pipe.out.state.value,
                # Re-established this many times since its peer process joined.
                "generation": pipe.gen,
                "authenticated_in": pipe.auth.in_key is not None,
                "transports": sorted(transports),
                "lanes": [{"transport": t, "device": d} for t, d in lanes],
                "cuda_path": cuda_path(pipe.direct, transports).value,
                "lifeline": self._liveness.state(pipe),
                # Large host buffers read out of the sender's memory (cma.py).
                "by_address": {"in": pipe.cma.reads, "out": pipe.cma.read_by_peer},
                "messages_sent": pipe.out.sent, "messages_received": pipe.inbound.received,
            })
        return out

    def close(self) -> None:
        """Stop progress and close every endpoint; idempotent.  Peers
        watching this process's lifeline are told it shut down.

        Blocks, up to about 6 s: up to 1 s while peers still read this
        process's buffers by address (their word lets them go), up to 5 s
        for the loop's turn to end (:meth:`ProgressThread.stop`), then 50 ms
        for the endpoints' close requests to go out."""
        if self._closing:
            return
        self._closing = True
        self._liveness.begin_close()
        for pipe in list(self._pipes.values()):
            # Not yet said: the peer waits for the word to let its buffers go.
            self._by_address.send_ack(pipe)
        # Buffers a peer reads out of our memory must outlive its read: wait
        # (bounded) for its word, as for any send still in flight.
        end = time.monotonic() + 1.0
        while not self._loop.current and self._sender.holding and time.monotonic() < end:
            time.sleep(0.001)
        self._loop.stop()
        for pipe in self._pipes.values():
            with pipe.lock:
                if pipe.out.outbox:  # before the endpoint closes
                    self._sender.flush(pipe)
                # Closing an endpoint whose peer already failed crashed ucxx.
                if not pipe.closed:
                    pipe.move_to(OutState.CLOSED)
                    if pipe.ep is not None:
                        pipe.ep.close()
        end = time.monotonic() + 0.05
        while time.monotonic() < end:  # let the close requests go out
            self._worker.progress()
        # After the last replies went out: a peer told we shut down fails
        # whatever it still waits for from us.
        self._liveness.close_lifelines()
        self._worker.close()
        self._liveness.close()
        self.pool.clear()
        if self._bounce:
            bounce.free()
        self._loop.close()

    # ------------------------------------------------------------- sending

    def _send_failed(self, pipe: Pipe, err: BaseException) -> None:
        self._call_soon(functools.partial(self._break, pipe, err))

    def _endpoint(self, pipe: Pipe) -> Endpoint:
        if pipe.ep is None:
            def failed(exc: BaseException, p: Pipe = pipe) -> None:
                self._call_soon(functools.partial(self._break, p, exc))

            pipe.ep = self._endpoint_class(self._worker, pipe.address, failed)
            pipe.fifo = canary.uses_fifo(pipe.ep.transports())
        return pipe.ep

    def _start_handshake(self, pipe: Pipe) -> None:
        self._liveness.watch(pipe)
        try:
            self._endpoint(pipe)
            if pipe.fifo and self._liveness.stuck:
                # Its answers would come through our stuck receive queue.
                raise BrokenError(self._liveness.stuck)
            self._handshake.start(pipe)
        except Exception as exc:
            self._break(pipe, exc)

    # ---------------------------------------------------------- the loop's

    # --------------------------------------------------------------- peers

    def _adopt(self, sender: int, pipe: Pipe | None) -> Pipe | None:
        """A handshake from a worker we do not know, or from a new
        incarnation of one: ask :attr:`on_unknown_peer` where it lives.  The
        handshake still has to prove the secret."""
        if self.on_unknown_peer is None:
            return pipe
        try:
            found = self.on_unknown_peer(sender)
        except Exception:
            logger.exception("looking up worker id %d failed", sender)
            return pipe
        if found is not None:
            self.add_peer(found)
        return self._pipes.get(sender)

    # ------------------------------------------------------------ the loop

    def _poll_requests(self) -> bool:
        while self._inflight:
            self._watch.append(self._inflight.popleft())
        if not self._watch:
            return False
        busy = False
        watch = self._watch[:]
        self._watch.clear()
        still = []
        seen = 0
        try:
            for req, owner in watch:
                seen += 1  # first: an entry is never handled twice
                if not req.done:
                    still.append((req, owner))
                    continue
                busy = True
                self._completed(req, owner)
        finally:
            # As in Receiver.poll: nothing unexamined is lost.
            self._watch[:0] = still + watch[seen:]
        return busy

    def _completed(self, req: Request, owner: Any) -> None:
        if isinstance(owner, Pipe):  # a frame we sent
            err = req.error()
            if err is not None:
                self._break(owner, err)
            else:
                self._sender.frame_left(owner, req)
        elif owner is not None:  # a message's data; None: a drained buffer
            self._rx.completed(req, owner)

    def _run_tasks(self) -> bool:
        if not self._tasks:
            return False
        while self._tasks:
            self._tasks.popleft()()
        return True

    def _turn(self) -> bool:
        """One turn of the progress loop after ``worker.progress()``:
        whether it handled anything."""
        if self._watch:
            # Data in flight: UCX moves a few fragments per call, and the
            # Python work between calls is what limits bandwidth.
            for _ in range(self._data_spins):
                self._worker.progress()
        # (Each look is guarded here where it is one test: a turn runs twice a
        # message on each side, and a call is most of a turn's cost; issue 52.)
        busy = bool(self._tasks) and self._run_tasks()
        busy = self._rx.poll() or busy
        if self._watch or self._inflight:
            busy = self._poll_requests() or busy
        if self._queue_check.waiting:  # (a plain attribute: no call a turn)
            busy = self._liveness.poll() or busy
        if self._by_address.due and not busy:
            self._by_address.send_due()
        if self._retired and not busy:
            now = time.monotonic()
            if now >= self._next_prune:  # what UCX ended lets its buffers go
                self._next_prune = now + PRUNE_EVERY_S
                self._prune_retired()
        return busy

    def wake(self) -> None:
        """Make the progress thread poll again now if it sleeps (cheap when
        it does not): for a caller about to wait for a reply."""
        self._loop.wake()

    def drive(self, done: Callable[[], bool]) -> bool:
        """Progress on the calling thread until ``done()`` holds (True) or
        polling stops paying (:meth:`.loop.progress.ProgressThread.drive`):
        messages are then handled, and callbacks run, on the caller's
        thread.  Where UCX may move CUDA memory, a thread with no CUDA
        context has one current while it drives
        (:meth:`.cuda.side.CudaSide.drive`); where it cannot, the progress
        thread keeps the work (False)."""
        if self._cuda.device is None:  # (the host's path, bound over this in __init__)
            return self._loop.drive(done)
        return self._cuda.drive(self._loop.drive, done)

    def _loop_nudge(self) -> None:
        """For a send left in flight (the sender's ``wake``): the loop's
        :meth:`.loop.progress.ProgressThread.nudge`."""
        self._loop.nudge()

    def _call_soon(self, fn: Callable[[], None]) -> None:
        self._tasks.append(fn)
        self._loop.wake()

    def _progress_started(self) -> None:
        # What counts is the progress thread's context: it arms the worker
        # and moves most data.
        self.cuda_context = self._cuda.make_current()

    # ------------------------------------------------------------- failure

    def _lifeline_verdict(self, pipe: Pipe, exc: BaseException, orderly: bool,
                          final: bool) -> None:
        """What the lifeline (or the queue check) found (any thread)."""
        self._break(pipe, exc, orderly, final=final)

    def _break(self, pipe: Pipe, exc: BaseException, orderly: bool = False, *,
               final: bool = False, renew: bool = True) -> None:
        """Fail ``pipe`` (once; any thread).  ``orderly``: the peer shut down,
        nothing went wrong.  ``final``: the peer is gone for good (its
        lifeline was cut, our queue is stuck).  Otherwise, where the peer's
        process may live on (:meth:`.liveness.Liveness.alive`), the break is
        for now: the error becomes an :class:`UnreachableError`, and once
        the peer answers again the next generation replaces the pipe
        (``renew``: ask its lifeline whether it answers; the caller
        replaces it itself otherwise).  A verdict of death for a pipe
        broken as unreachable is reported again."""
        if not final and not orderly and not isinstance(exc, UnreachableError):
            # UCX's word for an endpoint often comes before the lifeline
            # thread has read the end the same exit put on the lifeline.
            gone = self._liveness.gone(pipe)
            if gone is not None:
                exc, orderly, final = BrokenError(gone[0]), gone[1], True
        recoverable = self._recoverable(pipe, exc, orderly, final)
        # A UCX error while the lifeline holds: the lifeline is asked below.
        # (A lost lifeline retries by itself; an installed successor needs
        # nothing.)
        verify = recoverable and renew and not isinstance(exc, UnreachableError)
        if verify:
            cause, exc = exc, UnreachableError(f"{exc} (its lifeline holds: its process is "
                                               "asked whether it lives)")
            exc.__cause__ = cause
        with pipe.lock:
            if pipe.out.state is OutState.CLOSED:
                return
            if pipe.out.state is OutState.BROKEN:
                if not pipe.recoverable or recoverable:
                    return
                pipe.error = exc  # found gone since: that is what to tell
                pipe.recoverable = False
            else:
                pipe.move_to(OutState.BROKEN)
                pipe.error = exc
                pipe.recoverable = recoverable
                pipe.auth.in_key = None
                pipe.out.backlog.clear()
                pipe.out.outbox.clear()
                pipe.out.outbox_bytes = 0
                pipe.cma.held.clear()  # its process is gone or will never read them
                self._grants.retire(pipe)
                self._sender.holding.discard(pipe)
                self._sender.holding_split.discard(pipe)
                pipe.cma.reads = pipe.cma.read_by_peer = False
                if not orderly:
                    # Its receives posted for data that may never come, and
                    # its data already waiting unmatched, go (on the loop,
                    # which owns them).
                    self._call_soon(functools.partial(self._abandon, pipe))
        if self._pipes.get(pipe.peer_id) is not pipe:
            return  # replaced: the worker came back under a new address, or a new generation
        (logger.info if orderly else logger.warning)("pipe to %s broke: %s", pipe.name, exc)
        # A peer that may have died mid-copy into our shared-memory receive
        # queue; one that shut down was not copying anything.
        if pipe.fifo is not False and not orderly and not isinstance(exc, ClosedError):
            self._call_soon(functools.partial(self._liveness.check_queue, pipe.name))
        if verify:
            # Its port is asked whether the same process answers; then the
            # pipe is renewed (_came_back).
            self._liveness.verify(pipe)
        try:
            self._on_broken(pipe.peer_id, self._pipe_error(pipe))
        except Exception:
            logger.exception("on_broken handler failed")

    def _abandon(self, pipe: Pipe) -> None:
        """Let go of what ``pipe``, ended, has in flight (on the loop): its
        receives (:meth:`.receive.Receiver.abandon`) and its sends.  UCX
        offers no cancel of a send, nor of a receive matched to a
        rendezvous in progress: they are no longer watched each turn (a
        loop that watched them would poll for good), but kept, with their
        buffers, until UCX ends them (:meth:`_prune_retired`), which it
        does once the endpoint goes (:meth:`_let_go_of_endpoint`)."""
        self._retired.extend(self._rx.abandon(pipe))
        while self._inflight:
            self._watch.append(self._inflight.popleft())
        kept: list[tuple[Request, Any]] = []
        for entry in self._watch:
            (self._retired if entry[1] is pipe else kept).append(entry)
        self._watch[:] = kept
        self._let_go_of_endpoint(pipe)
        self._prune_retired()

    def _let_go_of_endpoint(self, pipe: Pipe) -> None:
        """Discard the endpoint of ``pipe``, ended, where UCX still holds it
        usable (on the loop).  Nothing goes on it again: a peer that comes
        back gets the next generation's pipe and endpoint.  Discarded (a
        close by force), UCX fails its sends and the receives matched to a
        rendezvous from it, which no cancel reaches; a flushing close
        waits for a peer behind a partition for good, and a partition that
        cut a 256 MiB message left 15 receives of 16 MiB held past the heal
        on the receiver, and its sends on the sender (Run AO).  An endpoint
        UCX failed itself is left alone (closing such crashed ucxx; UCX
        failed what it held).  The discard also cuts the connections left
        stuck behind the outage (:attr:`cut`), which would otherwise resume
        after it into an endpoint UCX let go (``ucx/sockets.py``)."""
        with pipe.lock:
            if pipe.ep is not None and getattr(pipe.ep, "alive", False):
                self.cut += pipe.ep.discard()

    def _prune_retired(self) -> None:
        """Forget what UCX ended of the retired requests (their buffers go
        with them); on the loop, which owns them: whenever a pipe ends or
        is renewed, and on an idle turn every :data:`PRUNE_EVERY_S`."""
        self._retired[:] = [e for e in self._retired if not e[0].done]

    def _recoverable(self, pipe: Pipe, exc: BaseException, orderly: bool, final: bool) -> bool:
        """Whether a break of ``pipe`` for ``exc`` is for now: the peer's
        process may live on and answer again."""
        if final or orderly or self._closing or isinstance(exc, (AuthenticationError,
                                                                 ClosedError)):
            return False
        return isinstance(exc, UnreachableError) or self._liveness.alive(pipe)

    # ------------------------------------------------------ generations

    def _came_back(self, pipe: Pipe) -> None:
        """``pipe``'s peer process answered on its lifeline again (on the
        lifeline thread): re-establish the pipe if it broke meanwhile."""
        if pipe.out.state is OutState.BROKEN and pipe.recoverable:
            self._call_soon(functools.partial(self._renew, pipe))

    def _renew(self, old: Pipe) -> None:
        """Replace ``old``, broken while its peer lived, by its next
        generation, which says HELLO at once (on the loop): the peer learns
        from it that what was in flight is lost, and calls work again once
        it answers (:meth:`_restored`).  Where the peer's own HELLO of a
        newer generation was answered already, that pipe is the next one."""
        if self._closing or self._pipes.get(old.peer_id) is not old \
                or not (old.out.state is OutState.BROKEN and old.recoverable):
            return
        nxt = self._handshake.take_tentative(old.peer_id, old.gen)
        self._install(old, nxt if nxt is not None else self._successor(old, old.gen + 1))

    def _successor(self, pipe: Pipe, gen: int) -> Pipe:
        """A pipe of generation ``gen`` to ``pipe``'s peer process (not
        installed): what it published, and nothing else of ``pipe``."""
        record = pipe.record or Peer(pipe.peer_id, pipe.name, pipe.address,
                                     lifeline=pipe.lifeline)
        nxt = self._new_pipe(record, gen)
        nxt.watched = pipe.watched  # the lifeline is the peer process's, not the pipe's
        return nxt

    def _install(self, old: Pipe, new: Pipe) -> None:
        """Put ``new``, the next generation, in ``old``'s place and start its
        handshake (on the loop).  ``old`` ends: quietly where it never
        carried anything; else broken, with everything in flight on it,
        naming the outage, as the peer has lost what it had of it too."""
        if self._closing or self._pipes.get(old.peer_id) is not old:
            return
        with old.lock:
            pristine = old.out.state is OutState.NEW and old.auth.in_key is None
            if pristine:
                old.move_to(OutState.CLOSED)
        if not pristine and not old.closed:
            self._break(old, UnreachableError(
                f"{old.name} re-established its pipe to this worker after losing it (an "
                "outage between the two hosts, or a failure of UCX): what was in flight on "
                "it is lost"), renew=False)
        # An endpoint UCX has not failed (TCP kept retransmitting through the
        # outage) would deliver the old generation's frames late and hold its
        # connection for good (one that carried anything went when it broke).
        self._let_go_of_endpoint(old)
        self._pipes[new.peer_id] = new
        self.renewed += 1
        self._prune_retired()
        logger.info("pipe to %s: generation %d replaces %d", new.name, new.gen, old.gen)
        with new.lock:
            new.move_to(OutState.HELLO_SENT)
        self._start_handshake(new)

    def _authenticated(self, pipe: Pipe) -> None:
        """The peer's direction of ``pipe`` was proved (on the loop)."""
        recent = self._epochs.setdefault(pipe.peer_id, deque(maxlen=EPOCHS_KEPT))
        recent.append(pipe.auth.in_epoch)
        self._by_address.accepted(pipe)
        self._restored(pipe)

    def _restored(self, pipe: Pipe) -> None:
        """A handshake of ``pipe`` completed: if it is a later generation,
        its peer is reachable again (the agent stops failing its calls)."""
        if pipe.gen and not pipe.restored and self._pipes.get(pipe.peer_id) is pipe \
                and not pipe.closed:
            pipe.restored = True
            try:
                self._on_restored(pipe.peer_id)
            except Exception:
                logger.exception("on_restored handler failed")

    def _pipe_error(self, pipe: Pipe) -> BaseException:
        if pipe.out.state is OutState.CLOSED:
            return ClosedError(f"pipe to {pipe.name} is closed")
        if isinstance(pipe.error, AuthenticationError):
            return pipe.error
        err = (UnreachableError if pipe.recoverable else BrokenError)(
            f"pipe to {pipe.name} is broken: {pipe.error}")
        err.__cause__ = pipe.error
        return err

    def _default_alloc(self, nbytes: int, device: int) -> torch.Tensor:
        if device < 0:
            return self.pool.alloc(nbytes)
        return cuda_alloc(nbytes, device)

    def stats(self) -> dict[str, Any]:
        return {"refused_frames": self._rx.refused, "frame_errors": self._rx.frame_errors,
                # The Inlet's (csrc/receive.c): messages it handed to the
                # agent itself, frames it queued for the Python.
                "messages_received_at_once": self._rx.inlet.handled,
                "frames_queued": self._rx.inlet.passed,
                **self._sender.stats(), "bytes_read_by_address": self._rx.read_bytes,
                # Peers whose buffers we read and have not yet said so.
                "acknowledgements_held": sum(p.cma.ack_sent < p.cma.read_through
                                             for p in list(self._pipes.values())),
                "acknowledgements_sent_alone": self._by_address.sent_alone,
                **self._grants.stats(),
                # Peers whose last frame said their loop may not poll.
                "peers_busy": sum(p.inbound.peer_busy for p in list(self._pipes.values())),
                "pool": self.pool.stats(), "watched_requests": len(self._watch),
                # Requests of ended pipes that UCX still holds (not watched),
                # and the bytes of memory they keep.
                "retired_requests": len(self._retired),
                "retired_bytes": sum(_held_bytes(getattr(req, "keep", None))
                                     for req, _ in list(self._retired)),
                "pipes_renewed": self.renewed, "connections_cut": self.cut,
                **self._liveness.stats(), "progress": self._loop.info(),
                "cuda_context": self.cuda_context,
                # How device buffers reach UCX (UCXRPC_DEVICE_PATH).
                "device_path": "ucp" if self._worker.device_ucp else "ucxx"}


def _held_bytes(keep: Any) -> int:
    """The bytes of memory a request keeps for UCX (an array, a tensor, a
    gather of parts, or a tuple of them), for the transport's stats."""
    if keep is None:
        return 0
    if isinstance(keep, (tuple, list)):
        return sum(_held_bytes(part) for part in keep)
    if isinstance(keep, torch.Tensor):
        return keep.numel() * keep.element_size()
    nbytes = getattr(keep, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0
