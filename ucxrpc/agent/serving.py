"""The serving side of an agent: a request from a peer runs on the worker
pool and is answered with its result, its future's value (for an
``@async_execution`` function), or its error.

Every request is counted from its arrival until its answer left
(:attr:`Server.unanswered`), so that a graceful shutdown can wait for what
this worker still owes its peers.  An answer that cannot leave (the peer
died meanwhile) is logged and counted as given: nobody waits for it.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .. import _torch_futures, devices
from ..errors import FrameError, RpcError, SerializationError
from ..serialization import envelope
from ..serialization.pickler import Serializer, unpickling_error
from .info import WorkerInfo
from .members import Members
from .pool import WorkerPool
from .remote_errors import describe_exception, not_a_future, undecodable_request, user_failure

__all__ = ["Served", "Server"]


class Served(Protocol):
    """What the server uses of its agent (:class:`.core.RpcAgent` is one):
    a protocol, so that the agent may own a server without a cycle."""

    info: WorkerInfo
    members: Members
    serializer: Serializer
    devices: list[torch.device]
    counters: dict[str, int]

    def dumps_for(self, dest: int, obj: Any) -> Any: ...

    def send_message(self, peer: int, kind: envelope.MsgKind, msg_id: int,
                     body: bytes | memoryview, buffers: list[Any],
                     targets: list[int] | None = None, flags: int = 0) -> None: ...

logger = logging.getLogger(__name__)

_PLAIN = envelope.PLAIN
#: A plain request's unpickling (envelope.PLAIN): pickle's own.
_loads_plain = pickle.loads


def debug_gate(log: logging.Logger) -> Callable[[int], bool | None]:
    """``gate(logging.DEBUG)``: False where ``log`` said it is not enabled
    for DEBUG and nothing changed its levels since (its own cache, which
    ``setLevel`` clears), else True or None; then ``isEnabledFor`` answers.
    A C call in place of a Python one, two to three times a message a side
    (issue 52), for the per-message trace (docs/style.md).  Where a
    Python's logger keeps no such cache, always None."""
    return getattr(getattr(log, "_cache", None), "get", lambda level: None)


_debug = debug_gate(logger)


#: Request bodies up to this many bytes are copied out of their frame
#: before they queue for the pool (see Server.accept).
COPY_BODY_MAX = 4096


class Server:
    """Runs and answers the requests that reach ``agent``, on ``pool``."""

    def __init__(self, agent: Served, pool: WorkerPool) -> None:
        self._agent = agent
        self._pool = pool
        self._lock = threading.Lock()
        #: Requests received and not yet answered.
        self.unanswered = 0
        self._serve_task = self._serve  # bound once, not per request

    def accept(self, peer: int, msg_id: int, body: memoryview,
               buffers: list[torch.Tensor], plain: bool = False) -> None:
        """A request arrived: it runs on the pool.  ``plain``: its body is a
        plain pickle (:data:`envelope.PLAIN`), and it has no buffers.

        What waits in the pool's queue is what the cyclic garbage collector
        walks: a burst of ``rpc_async`` calls queued thousands of requests
        here, each holding a bound method, a memoryview of its frame and
        that view's managed buffer, an empty list and two tuples.  They
        outlived the young collections and set off full ones, 80-100 ms each
        in a process that imported torch (benchmarks/runs/AD.md).
        So a small body is queued as bytes (not tracked, and its frame is
        let go at once), the method is bound once, and no buffers are an
        empty tuple: the task's arguments are then untracked, and only the
        queue's own tuple per request is left.
        """
        with self._lock:
            self.unanswered += 1
        self._pool.submit(self._serve_task, peer, msg_id,
                          bytes(body) if body.nbytes <= COPY_BODY_MAX else body,
                          buffers or (), plain)

    def refuse(self, peer: int, msg_id: int, exc: BaseException) -> None:
        """A request that cannot run (it broke a limit): answered with ``exc``."""
        with self._lock:
            self.unanswered += 1
        self._reply_error(peer, msg_id, exc)

    def _answered(self) -> None:
        with self._lock:
            self.unanswered -= 1

    def _serve(self, peer: int, msg_id: int, body: bytes | memoryview,
               buffers: Sequence[torch.Tensor], plain: bool = False) -> None:
        agent = self._agent
        agent.counters["calls_served"] += 1
        try:
            # (annotated, not cast(): typing.cast is a Python call a request)
            request: Any = (_loads_plain(body) if plain
                            else agent.serializer.loads(body, buffers))
            func, args, kwargs = request
            del request  # else it keeps the arguments alive past the del below
        except Exception as exc:
            if plain:  # in the serializer's words, as the usual way raises it
                error = unpickling_error(exc)
                if error is not exc:
                    error.__cause__ = exc
                exc = error
            self._reply_error(peer, msg_id, undecodable_request(exc, agent.info.name,
                                                                agent.members.name_of(peer)))
            return
        if _debug(logging.DEBUG) is not False and logger.isEnabledFor(logging.DEBUG):
            # (the per-message trace, docs/style.md; _debug: see debug_gate)
            logger.debug("%s: serving call %d from %s: %s (%d buffers)", agent.info.name,
                         msg_id, agent.members.name_of(peer),
                         getattr(func, "__qualname__", func), len(buffers))
        streams = (devices.callee_streams(agent.devices, buffers) if agent.devices
                   else devices.NO_STREAMS)
        with streams:  # the reply's CUDA tensors are settled on these streams too
            try:
                result = func(*(args or ()), **(kwargs or {}))
            except Exception as exc:
                self._reply_error(peer, msg_id, user_failure(func, args, kwargs, exc, agent.info))
                return
            # Drop the arguments before replying: the caller's next message may
            # arrive at once and should find their pooled buffers free again.
            del args, kwargs, body, buffers
            if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                if not isinstance(result, torch._C.Future):
                    self._reply_error(peer, msg_id, not_a_future(func, result))
                    return
                result.add_done_callback(lambda f: self._reply_future(peer, msg_id, f))
                return
            self._reply(peer, msg_id, result, func)

    def _reply_future(self, peer: int, msg_id: int, fut: torch.futures.Future) -> None:
        """Answer an ``@async_execution`` call with its future's value.

        Runs as the future's callback, so its CUDA tensors are settled on the
        streams current there.  A future that knows its devices (torch's
        ``Future(devices=...)``, the futures ucxrpc's calls return) runs it
        on streams that wait for the work behind its value.  A plain future
        runs it on the streams of the thread that completes it: whoever
        completes one with CUDA tensors must do so on the streams that made
        them, or after synchronizing them.  torch's agent relies on the same
        (it cannot know which streams made a plain future's value either).
        """
        exc = _torch_futures.failure(fut)  # not raised here: this frame holds fut
        if exc is not None:
            self._reply_error(peer, msg_id, exc)
            return
        self._reply(peer, msg_id, fut.value(), None)

    def _reply(self, peer: int, msg_id: int, result: Any, func: Any) -> None:
        agent = self._agent
        # A plain result (None, numbers, strings: csrc/plain.c) in one C
        # call, marked so that the caller unpickles it in one.
        payload = agent.serializer.dumps_plain(result)
        if payload is not None:
            buffers: list[Any] = []
            targets = None
            flags = _PLAIN
        else:
            try:
                pickled = agent.dumps_for(peer, result)
            except Exception as exc:
                name = getattr(func, "__qualname__", "the function")
                self._reply_error(peer, msg_id, SerializationError(
                    f"cannot pickle the result of {name} on {agent.info.name}: "
                    f"{type(exc).__name__}: {exc}"))
                return
            payload, buffers, targets, flags = pickled.payload, pickled.buffers, None, 0
            if pickled.cuda and peer != agent.info.id:  # (host buffers only: no targets)
                try:
                    targets = agent.members.cuda_targets(peer, pickled, replying=True)
                except RpcError as exc:
                    self._reply_error(peer, msg_id, exc)
                    return
        del result
        try:
            agent.send_message(peer, envelope.MsgKind.RESPONSE, msg_id, payload, buffers,
                               targets, flags)
        except FrameError as exc:
            self._reply_error(peer, msg_id, exc)
            return
        except RpcError as exc:
            logger.warning("%s: reply to %s lost: %s", agent.info.name,
                           agent.members.name_of(peer), exc)
        else:
            if _debug(logging.DEBUG) is not False and logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s: replied to call %d from %s (%d buffers)", agent.info.name,
                             msg_id, agent.members.name_of(peer), len(buffers))
        with self._lock:  # (_answered, inline: every reply; issue 52)
            self.unanswered -= 1

    def _reply_error(self, peer: int, msg_id: int, exc: BaseException) -> None:
        agent = self._agent
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: answering call %d from %s with %s: %s", agent.info.name, msg_id,
                         agent.members.name_of(peer), type(exc).__name__, exc)
        try:
            agent.send_message(peer, envelope.MsgKind.ERROR, msg_id,
                               describe_exception(exc, agent.info), [])
        except RpcError as err:
            logger.warning("%s: error reply to %s lost: %s", agent.info.name,
                           agent.members.name_of(peer), err)
        self._answered()
