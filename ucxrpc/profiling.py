"""RPC under torch's profiler: what torch's agent records, recorded alike.

While torch's legacy autograd profiler (``torch.autograd.profiler_legacy.profile``)
is on in a thread, each ``rpc_sync``, ``rpc_async`` and ``remote`` made there
is an event named as torch names it, ``rpc_async#udf(worker0 -> worker1)``
(``rpc_sync#``, ``rpc_remote#``; a builtin by its qualified name,
``rpc_sync#aten::add(...)``), from the call until its future completes.  The
callee runs the function under the legacy profiler with the caller's
settings (shapes, memory, stacks...) and sends its events back with the
reply; they join the caller's profile attributed to the callee (``node_id``,
``is_remote``) and named ``<key>#remote_op: <event>``, the events of the
callee's own calls included (those made while the function runs; a call
made from a future's callback on another thread is not profiled, there being
no profiler on that thread).  ``to_here`` is a span too
(``to_here#(worker0)->(worker1)``), under any profiler, as in torch.  The
profile's Chrome trace (``export_chrome_trace``) thus shows each call on
both workers: the caller's span on its thread, the callee's events on a
track of their own (``node_id:1, thread_id:3``), as torch's does.

Under the Kineto profiler (``torch.profiler.profile``, and
``torch.autograd.profiler.profile``, which is Kineto since torch 2.0)
torch's agent records no RPC: it warns that the worker is not profiled and
makes the call as usual.  So does ucxrpc (torch's own
``test_profiler_with_async_rpc_udf`` checks that no RPC event shows there).

Cost while no profiler is on: one check per call
(:func:`~ucxrpc._torch_profiler.profiler_enabled`), made before anything
here runs; a callee pays nothing, as only a profiling caller sends
:func:`_serve` or :func:`_serve_async`.

How: a call's span is recorded by the profile's :class:`Session` itself (a
start and an end time), not by a ``record_function``: the span ends on the
thread that completes the call, and an ``@async_execution`` callee sends its
events when the function's future completes, on yet another thread.  torch
carries the profiler's thread-local state to those threads in C++, where
Python callbacks do not reach.  A profile whose start this process did not
see (entered before ``init_rpc``) has no session: its calls get torch's own
``record_function`` span, ended by ``_call_end_callbacks_on_future``, and no
callee events (there are no settings to send).  See
:mod:`ucxrpc._torch_profiler` for the torch hooks this takes.
"""

from __future__ import annotations

import contextvars
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import _torch_futures, _torch_profiler, devices, timeouts
from ._torch_profiler import CalleeProfile, Event, Session, Settings
from .agent import RpcAgent, WorkerInfo, not_a_future
from .functions import _plain, async_execution

if TYPE_CHECKING:
    from .agent.calls import SyncReply

__all__ = ["Span", "call", "install", "rpc_key"]

#: Between a call's key and the name of an event its callee recorded (torch's).
REMOTE_OP = "#remote_op: "

_KINETO = ("Profiling a distributed call with the Kineto profiler will profile the caller, "
           "but not the worker.")


def install(agent: RpcAgent) -> None:
    """At ``init_rpc``: this worker's legacy profiles become RPC-aware."""
    _current[0] = weakref.ref(agent)
    _torch_profiler.install(agent.info.id)


# The agent install() was last called with (a callee's, for its devices):
# api imports this module, so it is handed over rather than asked of api;
# weakly, so that a shut-down agent is not kept.
_current: list[weakref.ref[RpcAgent] | None] = [None]


def _agent() -> RpcAgent:
    ref = _current[0]
    agent = ref() if ref is not None else None
    if agent is None:
        raise RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc "
                           "first.")
    return agent


def rpc_key(mode: str, func: Any, me: str, to: str) -> str:
    """torch's profiling key (``_build_rpc_profiling_key``):
    ``rpc_<mode>#<function>(<me> -> <to>)``, ``mode`` one of sync, async,
    remote.  Where torch raises for a callable without ``__qualname__`` (a
    ``functools.partial``), its type's name stands in."""
    name = (_torch_profiler.builtin_name(func) or getattr(func, "__qualname__", None)
            or type(func).__qualname__)
    return f"rpc_{mode}#{name}({me} -> {to})"


def call(agent: RpcAgent, to: WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any], timeout: timeouts.Seconds, waited: bool
         ) -> torch.futures.Future | SyncReply:
    """``rpc_sync`` (``waited``) or ``rpc_async`` made while a profiler is on
    in this thread (the caller checked): as :meth:`RpcAgent.call`, profiled
    as torch profiles it.  Raises what :meth:`RpcAgent.call` raises."""
    span = Span.begin(agent, "sync" if waited else "async", func, to)
    if span is None:
        return agent.call(to, func, args, kwargs, timeout, waited=waited)
    try:
        fut = agent.call(to, *span.request(func, args, kwargs), timeout)
    except BaseException:
        span.abandon()
        raise
    return span.finish(fut)


class Span:
    """One call made in a profiled thread, from its start until its future
    completes: records itself, and the events its callee sent back, in the
    thread's session."""

    @classmethod
    def begin(cls, agent: RpcAgent, mode: str, func: Any, to: WorkerInfo) -> Span | None:
        """The span of a call about to be made, or None where torch's
        profiler on this thread is not the legacy one (torch profiles no
        RPC then, and warns)."""
        if not _torch_profiler.legacy_profiler_on():
            warnings.warn(_KINETO, stacklevel=2)
            return None
        return cls(agent, rpc_key(mode, func, agent.info.name, to.name),
                   _torch_profiler.current_session())

    def __init__(self, agent: RpcAgent, key: str, session: Session | None) -> None:
        self.key = key
        self._session = session
        self._devices = agent.devices
        self._node = agent.info.id
        self._start_us = _torch_profiler.now_us()
        self._record: Any = None
        if session is None:
            self._record = torch.autograd.profiler.record_function(key)
            self._record.__enter__()

    def request(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """What to send for ``func(*args, **kwargs)``: the function run under
        the session's settings on the callee (as is without a session)."""
        if self._session is None:
            return func, args, kwargs
        # ucxrpc's own messages stay plain for distributed autograd.
        plain = getattr(func, "_ucxrpc_plain", False)
        if _is_async(func):
            serve: Any = _serve_async_plain if plain else _serve_async
        else:
            serve = _serve_plain if plain else _serve
        return serve, (self._session.settings, func, args, kwargs), {}

    def finish(self, fut: torch.futures.Future) -> torch.futures.Future:
        """The future to hand the caller for the reply future ``fut`` of
        :meth:`request`'s call: its value (or the remote error, with its
        type), completed once the span and the callee's events are in the
        session."""
        out = devices.future(self._devices)
        if self._session is None:
            ended = self._record._call_end_callbacks_on_future(fut)
            self._record.__exit__(None, None, None)
            # torch's future would hold a Python failure as its value: the
            # outcome comes from fut, once the span ended.
            ended.add_done_callback(lambda _: _torch_futures.forward(fut, out))
            return out
        session = self._session

        def done(f: Any) -> None:
            exc = _torch_futures.failure(f)
            if exc is not None:
                self._end(session, ())
                out.set_exception(exc)
                return
            reply = f.value()
            try:
                self._end(session, reply.events)
            finally:  # the caller gets its value, whatever became of the events
                out.set_result(reply.value)

        fut.add_done_callback(done)
        return out

    def run_here(self, agent: RpcAgent, func: Any, args: tuple[Any, ...]) -> torch.futures.Future:
        """Run :meth:`request` of ``func(*args)`` on this worker's pool, with
        this thread's context variables, as a callee would (a ``remote()``
        of a worker to itself, which passes its arguments as they are): the
        future to give :meth:`finish`."""
        serve, sargs, skwargs = self.request(func, args, {})
        out: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                result = serve(*sargs, **skwargs)
            except Exception as exc:
                _torch_futures.fail(out, exc)
                return
            if _is_async(serve) and isinstance(result, torch._C.Future):
                result.add_done_callback(lambda f: _torch_futures.forward(f, out))
            else:
                out.set_result(result)

        agent.submit(contextvars.copy_context().run, run)
        return out

    def abandon(self) -> None:
        """The call did not go out (it raised): the span ends now."""
        if self._record is not None:
            self._record.__exit__(None, None, None)
        elif self._session is not None:
            self._end(self._session, ())

    def _end(self, session: Session, remote: Any) -> None:
        prefix = self.key + REMOTE_OP
        # Async, as torch's span is (it ends on the thread that completes the
        # call): out of the tree of nested events, which a span ended by the
        # caller's own wait could otherwise cut across.
        span = Event(self.key, self.key, self._node, None, self._start_us,
                     _torch_profiler.now_us(), is_async=True)
        session.add([span, *(e.remote(prefix) for e in remote)])


# ------------------------------------------------------------------ callee

class _Profiled:
    """A profiled callee's answer: the function's value and its events."""

    __slots__ = ("value", "events")

    def __init__(self, value: Any, events: list[Event]) -> None:
        self.value = value
        self.events = events

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Profiled, (self.value, self.events))


def _serve(settings: Settings, func: Any, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> _Profiled:
    """Run ``func`` for a profiling caller (see :class:`CalleeProfile`)."""
    profile = CalleeProfile(settings)
    profile.start()
    try:
        value = func(*args, **kwargs)
    finally:
        profile.stop()
    return _Profiled(value, profile.events())


@async_execution
def _serve_async(settings: Settings, func: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> torch.futures.Future:
    """:func:`_serve` for an ``@async_execution`` function: the events go
    once its future completed (those of calls it made included)."""
    profile = CalleeProfile(settings)
    profile.start()
    try:
        inner = func(*args, **kwargs)
    finally:
        profile.stop()
    # Knows this worker's devices: the reply leaves from a callback of out,
    # on streams that must follow the value's work (see serving._reply_future).
    out = devices.future(_agent().devices)
    if not isinstance(inner, torch._C.Future):
        out.set_exception(not_a_future(func, inner))
        return out

    inner.add_done_callback(lambda f: _torch_futures.forward(
        f, out, lambda value: _Profiled(value, profile.events())))
    return out


@_plain
def _serve_plain(settings: Settings, func: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> _Profiled:
    """:func:`_serve` for one of ucxrpc's own functions marked plain (an
    optimizer's step), which distributed autograd must see as such."""
    return _serve(settings, func, args, kwargs)


@_plain
@async_execution
def _serve_async_plain(settings: Settings, func: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> torch.futures.Future:
    """:func:`_serve_async` for a plain function."""
    return _serve_async(settings, func, args, kwargs)


def _is_async(func: Any) -> bool:
    return getattr(func, "_wrapped_async_rpc_function", None) is not None
