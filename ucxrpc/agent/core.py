"""The RPC agent: sends calls, serves calls, owns the transport and pool.

Requests run on a :class:`WorkerPool` and are answered by the server
(:mod:`.serving`); responses complete
``torch.futures.Future`` objects where they land (the transport's progress
thread, or a caller driving it), or on a callback pool where a callback
was hooked on (:mod:`.calls`).  A pipe that breaks fails every call
waiting on that peer at once, naming it, instead of letting the calls run
into their timeout.
"""

from __future__ import annotations

import contextlib

import itertools
import logging
import pickle
import sys
import threading
import time
from typing import Any, Callable, Literal, overload

import torch

from .. import _torch_futures, devices, timeouts
from . import rendezvous
from ..serialization import envelope
from .pool import WorkerPool, this_thread as pool_thread
from ..errors import ClosedError, FrameError, SerializationError
from ..options import UcxRpcBackendOptions
from ..serialization.pickler import Serializer, unpickling_error
from ..transport import SPIN_S, Limits, Peer, Transport
from ..transport.loop.strategy import Why
from ..transport.wire.gather import Buffer, Gather
from .calls import CallFuture, CallTable, SyncReply
from .hooks import Hooks
from .info import WorkerInfo
from .members import Members
from .remote_errors import rebuild_exception
from .serving import Server, debug_gate
from .state import MOVES, AgentState

#: A peer that sent us a request this recently is likely to send the next
#: one soon, even if a reply came in since (a worker that both serves and
#: calls, as each side of an exchange does): the transport's own polling
#: window after an event, which this agent's transport keeps.
CALLED_WITHIN_S = SPIN_S

logger = logging.getLogger(__name__)


def spin_while_rules(agent: Any) -> tuple[tuple[Any, ...], ...]:
    """The agent's word on whether its progress loop may keep polling while
    idle (:attr:`Why.AWAITED`), or why not: the transport's ``spin_while``,
    rules the native core reads (csrc/expect.c) as every drive starts and
    ends and before every spin.

    Polling holds the GIL between UCX calls: a thread running Python code
    (a user function, or the caller's own work between calls) gets it
    back only at the interpreter's 5 ms switch interval, so a callee's
    few-microsecond function took milliseconds.  So poll only while no
    pool thread runs code (its ``running`` count) and a message is likely
    soon: a reply to a call in flight (the call table's ``by_id``), or the
    next request of a peer that called within :data:`CALLED_WITHIN_S`.
    """
    return (("above", (agent._pool, "running"), Why.COMPUTING),
            ("any", (agent.calls.by_id,), Why.AWAITED),
            ("within", (agent, "_requested_at"), CALLED_WITHIN_S, Why.AWAITED),
            ("then", Why.NOTHING_DUE))


#: The message kinds as the header's numbers (_on_message compares them).
_REQUEST, _RESPONSE = int(envelope.MsgKind.REQUEST), int(envelope.MsgKind.RESPONSE)
_KINDS = frozenset(int(k) for k in envelope.MsgKind)
_PLAIN = envelope.PLAIN
#: A plain message's unpickling (envelope.PLAIN): pickle's own.
_loads_plain = pickle.loads

_debug = debug_gate(logger)  # (this module's logger's; see debug_gate)


def _bounded(fn: Callable[[float | None], None], timeout: float | None, what: str) -> None:
    """``fn(timeout)`` on a daemon thread, waited for ``timeout`` seconds at
    most (None: for as long as it takes), plus the 5 s the shutdown
    barriers' second step may take."""
    t = threading.Thread(target=fn, args=(timeout,), name="ucxrpc-shutdown", daemon=True)
    t.start()
    t.join(None if timeout is None else timeout + 6.0)
    if t.is_alive():
        logger.warning("%s: gave up after %.1f s (the store is out of reach?)", what, timeout)


def _wait_until(done: Callable[[], bool], timeout: float | None) -> None:
    """Poll ``done`` until it holds or ``timeout`` seconds passed (None: no
    limit); shutdown's waits, where 5 ms of latency costs nothing."""
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)


class RpcAgent:
    """Sends calls, serves calls, and owns the transport and worker pool."""

    def __init__(self, name: str, rank: int, world_size: int | None,
                 options: UcxRpcBackendOptions, store: Any) -> None:
        self.options = options
        self.store = store
        self.info = WorkerInfo(name, rank)
        self.world_size = world_size  # None: dynamic membership (see agent/membership.py)
        self.serializer = Serializer(max_buffers=options.max_buffers)
        self._ids = itertools.count(1)
        #: The calls this worker waits for, and their deadlines.
        self.calls = CallTable(name, options.num_worker_threads)
        #: ``rpc_timeout`` as below the API: seconds, or None for none.
        self.default_timeout = timeouts.of_option(options.rpc_timeout)
        self.state = AgentState.NEW
        self._requested_at = -CALLED_WITHIN_S  # when a peer's last request came
        self.counters = {"calls_sent": 0, "calls_served": 0, "remote_errors": 0}
        secret = rendezvous.job_secret(store, rank)
        limits = Limits(max_buffers=options.max_buffers,
                        max_frame_bytes=options.max_frame_bytes,
                        max_message_bytes=options.max_message_bytes)
        # Made before the transport, whose polling rules read its running
        # count (spin_while_rules); told of quiet once the transport is there.
        self._pool = WorkerPool(options.num_worker_threads, idle_wait=self._drive)
        self.transport = Transport(my_id=rank, secret=secret, on_message=self._on_message,
                                   on_frame_error=self._on_frame_error,
                                   on_broken=self._on_broken,
                                   on_restored=self._on_restored, limits=limits,
                                   transports=options.transports,
                                   progress_mode=options.progress or "adaptive",
                                   spin_while=spin_while_rules(self),
                                   host_timeout=options.peer_timeout,
                                   cuda_devices=[*options.device_list(),
                                                 *(d for m in (options.device_maps or {}).values()
                                                   for d in m)])
        # A message without buffers to a peer: one C call (send_message).
        self._send_alone = self.transport.send_alone
        self._pool.on_quiet = self.transport.wake
        self._server = Server(self, self._pool)
        #: The workers, their names, device maps, and which of them are gone.
        self.members = Members(self.info, add_peer=self.transport.add_peer,
                               on_gone=self._peer_gone, my_maps=options.maps)
        #: The CUDA devices this worker uses (set at join).
        self.devices: list[torch.device] = []
        # For the layers above (RRefs, autograd, membership), which the agent
        # must not import: their per-agent state, and what they plug in.
        self.extensions: dict[str, Any] = {}
        self._extensions_lock = threading.Lock()
        self.hooks = Hooks()
        #: Per thread, while a message is pickled (dumps_for): ``now``, its
        #: (destination id, the call's kept list or None for a reply).
        self._dest = threading.local()

    @property
    def closed(self) -> bool:
        """Whether the agent shut down: it takes no calls any more."""
        return self.state is AgentState.CLOSED

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the pool that runs user functions (for the
        layers above: an RRef's value made on its owner, say)."""
        self._pool.submit(fn, *args)

    def extension(self, key: str, create: Callable[[RpcAgent], Any]) -> Any:
        """The per-agent state of a layer above, made by ``create(self)`` on
        first use (once, whichever thread gets here first)."""
        ext = self.extensions.get(key)
        if ext is None:
            with self._extensions_lock:
                ext = self.extensions.get(key)
                if ext is None:
                    ext = self.extensions[key] = create(self)
        return ext

    # ------------------------------------------------------------ lifecycle

    def publish(self) -> rendezvous.Member:
        """Put this worker's record (address, devices, maps) in the store."""
        maps = self.options.maps()
        return rendezvous.publish(self.store, self.info.id, self.info.name, self.transport.address,
                                  device_count=torch.cuda.device_count(),
                                  devices=tuple(str(d) for d in self.options.device_list()),
                                  device_maps={to: {str(k): str(v) for k, v in m.items()}
                                               for to, m in maps.items()},
                                  cuda_direct=self.transport.cuda_direct,
                                  max_frame_bytes=self.transport.limits.max_frame_bytes,
                                  lifeline=self.transport.lifeline,
                                  cma=self.transport.cma_offer,
                                  tcp_segment=self.transport.tcp_segment)

    def _move(self, to: AgentState) -> None:
        """The one place the agent's state changes, as :data:`MOVES` allows.

        Raises:
            RuntimeError: a move the table does not hold (a bug, named).
        """
        if to not in MOVES[self.state]:
            raise RuntimeError(f"{self.info.name}: the agent cannot go from "
                               f"{self.state.value} to {to.value}")
        self.state = to

    def start(self) -> None:
        self.transport.start()
        self.calls.start()
        if self.state is AgentState.NEW:
            self._move(AgentState.JOINING)

    def join(self, timeout: float | None) -> None:
        """Publish our address, learn everyone's, then start serving;
        ``timeout`` bounds the wait for the others (None: no limit)."""
        assert self.world_size is not None
        self.publish()
        members = rendezvous.collect(self.store, self.world_size)
        self.check_device_maps(members)
        for m in members.values():
            self.members.add(m)
        self.start()
        rendezvous.barrier(self.store, "init", self.info.id, self.world_size, timeout)
        self.joined()
        logger.info("%s joined a job of %d workers", self.info, self.world_size)

    def joined(self) -> None:
        """The join is complete (every worker of a static job met at the
        init barrier; a dynamic group's members were told)."""
        self._move(AgentState.SERVING)

    @property
    def dynamic(self) -> bool:
        """Whether this worker is in a dynamic group (no fixed world size)."""
        return self.world_size is None

    def check_device_maps(self, members: dict[int, rendezvous.Member]) -> None:
        """torch's job-wide device-map checks, on everyone's published maps
        (every worker raises the same error); then this worker's maps by peer
        id: for requests it sends, and the reverse for replies."""
        names = [m.name for m in members.values()]
        all_maps = {m.name: {to: devices.to_device_map(mp) for to, mp in m.device_maps.items()}
                    for m in members.values()}
        reverse = devices.reverse_maps(self.info.name, all_maps)
        # As given (maybe empty): torch checks indices where none were given.
        all_devices = {m.name: [devices.to_device(d) for d in m.devices]
                       for m in members.values()}
        devices.validate(names, {m.name: m.device_count for m in members.values()},
                         all_maps, all_devices)
        ids = {m.name: m.rank for m in members.values()}
        mine = all_maps[self.info.name]
        self.members.device_maps = {ids[to]: mp for to, mp in mine.items()}
        self.members.reverse_device_maps = {ids[src]: mp for src, mp in reverse.items()}
        self.devices = all_devices[self.info.name] or devices.default_devices(mine, reverse)

    def shutdown(self, graceful: bool, timeout: float | None) -> None:
        """Stop serving; graceful waits for everyone's in-flight work first,
        and for every live worker to reach shutdown, at most ``timeout``
        seconds for each wait (None: as long as the job runs)."""
        if self.closed:
            return
        try:
            if graceful:
                self._move(AgentState.DRAINING)
                for hook in list(self.hooks.before_shutdown):
                    try:
                        hook(timeout)
                    except Exception:
                        logger.exception("%s: shutdown hook failed", self.info)
                self._drain(timeout)
                # The store may be out of reach (a partition, a dead rank 0),
                # and a c10d store call then blocks for minutes: bounded here.
                _bounded(self._leave if self.dynamic else self._barriers,
                         timeout, f"{self.info}: leaving the job")
        finally:
            self._teardown()

    def _leave(self, timeout: float | None) -> None:
        if self.hooks.leave_group is not None:
            self.hooks.leave_group(timeout)

    def _barriers(self, timeout: float | None) -> None:
        assert self.world_size is not None
        me = self.info.id
        try:
            # Dead workers are not waited for: the kernel tells us, and a
            # worker never talked to is checked (its lifeline connected).
            rendezvous.barrier(self.store, "shutdown", me, self.world_size, timeout,
                               gone=self.members.broken, poke=self.transport.check)
            if me == 0:
                # The store lives in rank 0: keep it up until all have left
                # it, then leave it clean for the next job.
                rendezvous.barrier(self.store, "shutdown-done", me, self.world_size,
                                   5.0 if timeout is None else min(timeout, 5.0),
                                   gone=self.members.broken)
                rendezvous.clear(self.store, self.world_size)
            else:
                rendezvous.arrive(self.store, "shutdown-done", me)
        except Exception as exc:  # a dead rank 0 takes the store with it
            logger.warning("%s: shutdown barrier incomplete: %s", self.info, exc)
            return
        self._drop_store()
        if me != 0:
            # Rank 0 clears the job from the store (and stops a server it
            # hosts) before it says goodbye: returning earlier would let our
            # next init_rpc read this job's keys, or join its server.
            self._await_gone(0, 5.0 if timeout is None else min(timeout, 5.0))

    def _await_gone(self, peer: int, timeout: float) -> None:
        """Wait until ``peer`` shut down (or died), ``timeout`` s at most."""
        self.transport.check(peer)
        _wait_until(lambda: self.members.is_broken(peer), timeout)

    def _drop_store(self) -> None:
        """Release our reference to the store: a client's connection closes,
        and where this process hosts the store, its server stops (no other
        reference is kept)."""
        self.store = None

    def _drain(self, timeout: float | None) -> None:
        """Wait for our outstanding calls and the requests we are serving."""
        _wait_until(lambda: not (self.calls or self._server.unanswered), timeout)

    def _teardown(self) -> None:
        self._move(AgentState.CLOSED)
        self._pool.close()
        self.transport.close()
        self._drop_store()
        self.calls.close(ClosedError(f"RPC agent {self.info.name} shut down"))
        for hook in list(self.hooks.on_close):
            try:
                hook()
            except Exception:
                logger.exception("%s: close hook failed", self.info)

    # -------------------------------------------------------------- calling

    @overload
    def call(self, to: WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], timeout: timeouts.Seconds,
             waited: Literal[False] = False) -> torch.futures.Future: ...

    @overload
    def call(self, to: WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], timeout: timeouts.Seconds,
             waited: bool) -> torch.futures.Future | SyncReply: ...

    def call(self, to: WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], timeout: timeouts.Seconds, waited: bool = False
             ) -> torch.futures.Future | SyncReply:
        """Send ``func(*args, **kwargs)`` to ``to``; the future gets the result.

        ``timeout`` in seconds, None for none (:mod:`ucxrpc.timeouts`).  ``waited``: the caller waits
        for the reply with :meth:`wait` at once, which progresses the
        transport itself, so the progress thread is not woken for it; the
        reply then lands in a :class:`SyncReply` where it can.
        Pickling errors raise here with their own type; transport errors
        raise as :class:`RpcError`.
        """
        if self.state is AgentState.CLOSED:  # (closed, inline: once a call)
            raise ClosedError("RPC agent is shut down")
        finish = None
        if self.hooks.wrap_call is not None:
            wrapped = self.hooks.wrap_call(to, func, args, kwargs)
            if wrapped is not None:
                func, args, kwargs, finish = wrapped
        kept: list[Any] = []
        request = (func, args, kwargs)
        # A plain call (no tensor, no RRef: csrc/plain.c) in one C call,
        # marked so that its callee unpickles it in one (envelope.PLAIN).
        pickled = None
        payload = self.serializer.dumps_plain(request)
        if payload is None:
            pickled = self.dumps_for(to.id, request, kept)
            payload = pickled.payload
        del request
        fut: torch.futures.Future | SyncReply = (
            SyncReply() if waited and finish is None and not self.devices
            else CallFuture(self.devices))
        if kept:
            # Held by the future: the call table holds it until the answer
            # comes, and whoever keeps the future after keeps these too
            # (see keep_until_answered).
            fut.kept = kept  # type: ignore[union-attr]
        msg_id = next(self._ids)
        self.counters["calls_sent"] += 1
        if self.members.is_broken(to.id):
            raise self.members.peer_error(to.id)
        # With its deadline, before it is sent: the reply may come first.
        self.calls.add(msg_id, fut, to.id, waited, timeout)
        try:
            remote = to.id != self.info.id
            if pickled is None:
                self.send_message(to.id, envelope.MsgKind.REQUEST, msg_id, payload, [], None,
                                  _PLAIN)
            else:
                # (cuda_targets is None without CUDA buffers: not asked then)
                self.send_message(to.id, envelope.MsgKind.REQUEST, msg_id, payload,
                                  pickled.buffers, self.members.cuda_targets(to.id, pickled)
                                  if remote and pickled.cuda else None)
            if remote and not waited:
                self.transport.wake()  # to poll for the reply (see spin_while_rules)
        except BaseException:
            self.calls.pop(msg_id)
            raise
        if _debug(logging.DEBUG) is not False and logger.isEnabledFor(logging.DEBUG):
            # (the per-message trace, docs/style.md; _debug: see debug_gate)
            logger.debug("%s: call %d to %s: %s (%d buffers, timeout %s)", self.info.name,
                         msg_id, to.name, getattr(func, "__qualname__", func),
                         0 if pickled is None else len(pickled.buffers), timeout)
        if finish is None:
            return fut
        assert isinstance(fut, torch.futures.Future)  # as made above for a wrapper
        return finish(fut)

    def send_message(self, peer: int, kind: envelope.MsgKind, msg_id: int, body: bytes | memoryview,
                     buffers: list[Buffer], targets: list[int] | None = None,
                     flags: int = 0) -> None:
        """Send one message (a request, or the server's answer) to ``peer``,
        this worker included; ``targets`` as :meth:`Members.cuda_targets`
        gives them; ``flags`` the header's (:data:`envelope.PLAIN` or 0)."""
        if peer != self.info.id and self._send_alone(
                # (envelope.hint and the header, inline: issue 52)
                peer, (msg_id << 3) | kind,
                envelope.pack(kind, envelope.VERSION, flags, 0, msg_id), body, buffers):
            return
        payload = envelope.encode(kind, msg_id, body, flags)
        if peer == self.info.id:
            self._loopback(payload, buffers)
        else:
            self.transport.send(peer, payload, buffers, envelope.hint(kind, msg_id), targets,
                                alone=False)

    def _loopback(self, payload: bytes, buffers: list[Buffer]) -> None:
        # A call to oneself gets copies, as a remote callee would.  The
        # copies are queued on this thread's streams, and the callee reads
        # them on its pool's: settled first, as a remote call's buffers are
        # before UCX reads them (no-op for host buffers).
        copies = [b.joined() if isinstance(b, Gather) else b.clone() for b in buffers]
        devices.settle(copies)
        self._on_message(self.info.id, memoryview(payload), copies)

    def blocking(self) -> contextlib.AbstractContextManager[None]:
        """A ``with`` block in which this thread waits for work done
        elsewhere in the job: where it is a pool thread, the pool may start
        another meanwhile (as in :meth:`wait`)."""
        return self._pool.blocking()

    def wait(self, fut: torch.futures.Future | SyncReply) -> Any:
        """``fut.wait()`` that lets the pool replace a thread blocked here,
        and that handles the reply on this thread while polling pays."""
        if getattr(pool_thread, "pool", None) is not self._pool:  # (owns_this_thread, inline)
            # A user's thread: no pool to tell (and no context manager's
            # four calls per rpc_sync; issue 52).
            if not fut.done():
                done = fut if type(fut) is SyncReply else fut.done  # (a Reply: its own test)
                # (_drive, inline: a call fewer every rpc_sync; issue 52)
                if not self.transport.drive(done) and not done():
                    self.transport.wake()
            # (_torch_futures.result, inline: a call fewer every rpc_sync)
            try:
                return fut.wait()
            except Exception as exc:
                error = _torch_futures.detach(exc, sys._getframe())
            raise error
        with self._pool.blocking():
            if not fut.done():
                self._drive(fut.done)
            # Its error as a copy: raised as it is, the future's own exception
            # would keep every caller's frame alive (_torch_futures.failure).
            return _torch_futures.result(fut)

    def _drive(self, done: Callable[[], bool]) -> None:
        """Progress the transport on this thread until ``done()`` (see
        :meth:`Transport.drive`): a reply or request is handled where it is
        wanted, without a thread hand-off, which on a GPU machine's idle
        cores costs a wake-up each way.  On a worker with CUDA devices too:
        the transport gives the thread a CUDA context first if it has none,
        received device tensors are allocated on a stream of the
        transport's own (whichever thread allocates them), and a CUDA-aware
        future completed here records its events on this thread's current
        streams, which its waiter (this thread, or one that waits after
        it) then waits for: at most an extra wait for work the user queued,
        never a missed one."""
        if not self.transport.drive(done) and not done():
            self.transport.wake()  # the progress thread's turn now

    # ------------------------------------------------------------ receiving

    def _on_message(self, peer: int, payload: memoryview, buffers: list[torch.Tensor]) -> None:
        # (envelope.decode, inline for a sound header: every message, a
        # call and a Header fewer; it still names what is wrong with one)
        kind = version = flags = msg_id = 0
        if payload.nbytes >= envelope.HEAD_SIZE:
            kind, version, flags, _, msg_id = envelope.unpack(payload)
        if version != envelope.VERSION or kind not in _KINDS:
            envelope.decode(payload)  # raises FrameError
        body = payload[envelope.HEAD_SIZE:]
        # (a PLAIN flag on a message with buffers is the sender's error:
        # its body is unpickled the usual way, which takes them)
        plain = (flags & _PLAIN) != 0 and not buffers
        if _debug(logging.DEBUG) is not False and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: %s %d from %s (%d bytes, %d buffers)", self.info.name,
                         envelope.MsgKind(kind).name.lower(), msg_id,
                         self.members.name_of(peer), len(payload), len(buffers))
        if kind == _REQUEST:
            self._requested_at = time.monotonic()
            self._server.accept(peer, msg_id, body, buffers, plain)
        elif kind == _RESPONSE:
            call = self.calls.pop(msg_id)
            if call is None:
                return  # timed out or failed already
            try:
                value = _loads_plain(body) if plain else self.serializer.loads(body, buffers)
            except Exception as exc:
                if plain:
                    exc = unpickling_error(exc)
                self.calls.complete(call, exc=SerializationError(
                    f"cannot decode the response from {self.members.name_of(peer)}: {exc}"))
                return
            if call.waited:
                # (CallTable.complete's way for a waited call, inline: every
                # rpc_sync's reply, a call fewer; issue 52)
                call.future.set_result(value)
            else:
                self.calls.complete(call, value)
        else:  # ERROR
            call = self.calls.pop(msg_id)
            if call is not None:
                self.counters["remote_errors"] += 1
                self.calls.complete(call, exc=rebuild_exception(body))

    def _on_frame_error(self, peer: int, hint: int, exc: BaseException) -> None:
        """A message from ``peer`` broke one of our limits: answer or fail it."""
        kind, msg_id = envelope.parse_hint(hint)
        logger.warning("%s: message %s from %s rejected: %s", self.info.name, msg_id,
                       self.members.name_of(peer), exc)
        if kind == envelope.MsgKind.REQUEST:
            self._server.refuse(peer, msg_id, FrameError(
                f"message rejected by {self.info.name}: {exc}"))
        elif kind in (envelope.MsgKind.RESPONSE, envelope.MsgKind.ERROR):
            self.calls.fail(msg_id, FrameError(f"the reply from {self.members.name_of(peer)} was "
                                               f"rejected by {self.info.name}: {exc}"))

    def dumps_for(self, dest: int, obj: Any, kept: list[Any] | None = None) -> Any:
        """Serialize ``obj`` for worker ``dest`` (see :meth:`pickling_destination`);
        ``kept``: a call's list for :meth:`keep_until_answered` (None for a reply)."""
        # One slot, (dest, kept), set and restored once a message: nested
        # pickling (a reducer that pickles) sees its own and gets ours back.
        local = self._dest
        outer = getattr(local, "now", None)
        local.now = (dest, kept)
        try:
            return self.serializer.dumps(obj)
        finally:
            local.now = outer

    def keep_until_answered(self, obj: Any) -> None:
        """While a call's arguments are pickled on this thread: hold ``obj``
        until the call is answered (a reply pickles nothing that needs it).
        An RRef sent to its owner makes no fork there, so its owner knows
        nothing holds the value for the message: the sender dropping its
        own RRef at once sent a deletion that the owner's pool could serve
        before the request's unpickling got to the RRef, and free the
        value under it (rref/handle.py).  Answered, the callee has
        unpickled the request; torch's user holds its RRef until the owner
        acknowledges it alike."""
        now = getattr(self._dest, "now", None)
        if now is not None and now[1] is not None:
            now[1].append(obj)

    def pickling_destination(self) -> int | None:
        """The worker the message being pickled on this thread goes to, or
        None outside an RPC; objects such as RRefs pickle differently per
        destination and refuse to pickle outside RPC."""
        now = getattr(self._dest, "now", None)
        return None if now is None else now[0]

    def lookup_member(self, peer: int) -> Peer | None:
        """Where an unknown worker id lives, from its record in the store (the
        transport asks when such a worker opens a pipe to us)."""
        store = self.store
        m = None if store is None else rendezvous.find_member(store, peer)
        return None if m is None else m.peer()

    def _on_broken(self, peer: int, exc: BaseException) -> None:
        # The transport is made before the members, so it calls back here.
        self.members.fail(peer, exc)

    def _on_restored(self, peer: int) -> None:
        self.members.restore(peer)

    def _peer_gone(self, peer: int, err: BaseException) -> None:
        """``peer`` failed or left (see :class:`Members`): its calls fail
        with ``err``, then the layers above drop what it held."""
        self.calls.fail_peer(peer, err)
        for hook in list(self.hooks.on_peer_failure):
            try:
                hook(peer, err)
            except Exception:
                logger.exception("%s: peer-failure hook failed", self.info)

    # ---------------------------------------------------------------- info

    # torch's RpcAgent methods, for code that reaches the agent itself
    # (``rpc._get_current_rpc_agent().get_worker_infos()``: torch's sharding).

    def get_worker_info(self, worker: str | int | None = None) -> WorkerInfo:
        """This worker's WorkerInfo, or that of the worker named or numbered.

        Raises:
            RpcError: no such worker (naming it).
        """
        return self.info if worker is None else self.members.resolve(worker)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the job (this one too), by id."""
        return [wi for _, wi in sorted(self.members.workers.items())]

    def get_debug_info(self) -> dict[str, str]:
        """:meth:`debug_info` with string values, as torch's agent gives it."""
        return {k: str(v) for k, v in self.debug_info().items()}

    def debug_info(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters, peer_failures=self.members.failures,
                                   timeouts=self.calls.timeouts)
        out.update({"outstanding_calls": len(self.calls), "pending_requests": self._pool.pending(),
                    "broken_peers": sorted(self.members.broken()), "state": self.state.value,
                    "armed_deadlines": self.calls.armed()})
        out.update(self.transport.stats())
        for source in list(self.hooks.debug_sources):
            out.update(source())
        return out
