"""The user-facing side of RRefs: ``RRef`` (an owner's local handle or a
user's fork), its proxies, and ``remote()``."""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Callable, Generic, TypeVar

import torch

from .. import _torch_futures, api, devices, profiling, timeouts
from .._torch_profiler import profiler_enabled
from ..agent import RpcAgent, WorkerInfo
from ..errors import RRefError
from .owner import (_owner_add_fork, _owner_backward, _owner_create, _owner_create_now,
                    _owner_fetch, _owner_run_now, _owner_type, registry, run_into)
from .proxy import _invoke_method, _proxy_call
from .registry import ForkId, Registry, RRefId, new_id

__all__ = ["RRef", "remote"]

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value on its owner worker.

    ``RRef(value)`` makes a local owner RRef.  Picklable only inside RPC
    arguments and return values, where it becomes a fork on the receiver.
    On a worker with CUDA devices an owned value is held as torch's RPC
    holds it, in a future that knows those devices: its CUDA tensors must be
    on them, and torch finds them by pickling the value with plain pickle,
    so it must be picklable; else using the RRef raises torch's error
    ("... not among the expected device(s)", "Cannot extract tensors").
    """

    _owner_id: int
    _rref_id: RRefId
    _fork_id: ForkId | None
    _confirmed: torch.futures.Future
    _registry: Registry
    #: Set by a profiled remote() (see _get_profiling_future).
    _profiling_future: torch.futures.Future | None = None

    def __init__(self, value: T, type_hint: Any = None) -> None:
        reg = registry()
        rref_id = new_id(reg.me)
        e = reg.entry(rref_id)
        self._setup(reg, reg.me, rref_id, None, confirmed=True)
        # The handle first: an entry nobody holds is freed once its value is set.
        e.handle = weakref.ref(self, reg.freer(rref_id))
        e.value.set_result(value)

    @classmethod
    def _make(cls, owner: int, rref_id: RRefId, fork_id: ForkId | None,
              confirmed: bool) -> RRef[Any]:
        self = cls.__new__(cls)
        self._setup(registry(), owner, rref_id, fork_id, confirmed)
        return self

    def _setup(self, reg: Registry, owner: int, rref_id: RRefId, fork_id: ForkId | None,
               confirmed: bool) -> None:
        self._registry = reg
        self._owner_id = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._confirmed = torch.futures.Future()
        if confirmed:
            self._confirmed.set_result(None)
        if fork_id is not None:
            reg.user_made(confirmed)

    def _confirm(self, fut: torch.futures.Future) -> None:
        """Creation acknowledged (or failed) by the owner."""
        self._registry.user_confirmed()
        # Not raised here: this frame holds the RRef, which holds _confirmed
        # (see _torch_futures.failure).
        exc = _torch_futures.failure(fut)
        if exc is not None:
            self._confirmed.set_exception(exc)
        else:
            self._confirmed.set_result(None)

    def __del__(self) -> None:
        fork_id = getattr(self, "_fork_id", None)
        if fork_id is None:
            return
        try:
            self._registry.user_died(self._owner_id, self._rref_id, fork_id,
                                     self._confirmed.done())
        except Exception:  # interpreter shutdown
            pass

    def __reduce__(self) -> tuple[Any, ...]:
        if devices.extracting_tensors():
            # A CUDA-aware future looking for tensors in a value holding this
            # RRef: as torch's own RRefs, it holds none (and makes no fork).
            return (tuple, ())
        agent = self._registry.agent
        dest = agent.pickling_destination()
        if dest is None:
            raise RRefError("Can not pickle rref in python pickler: an RRef can only be "
                            "pickled inside an RPC (as an argument "
                            "or a return value)")
        fork_id: ForkId | None = None
        if dest == self._owner_id:
            # No fork on its owner: this RRef holds the value until the
            # owner has the message (RpcAgent.keep_until_answered).
            agent.keep_until_answered(self)
        else:
            fork_id = new_id(agent.info.id)
            if self.is_owner():
                self._registry.add_fork(self._rref_id, fork_id, dest)
            else:
                # Registered before the message exists: the owner always
                # knows of the child before the child can drop it.
                owner = agent.members.workers[self._owner_id]
                agent.wait(agent.call(owner, _owner_add_fork, (self._rref_id, fork_id, dest),
                                      {}, agent.default_timeout))
        return (_rebuild_rref, (self._owner_id, self._rref_id, fork_id))

    # -- torch's RRef API --------------------------------------------------

    def is_owner(self) -> bool:
        return self._owner_id == self._registry.me

    def owner(self) -> WorkerInfo:
        return self._registry.agent.members.workers[self._owner_id]

    def owner_name(self) -> str:
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        return self._confirmed.done() and not _failed(self._confirmed)

    def local_value(self) -> T:
        """The value, on the owner only (waits if it is still being computed).

        Raises:
            RRefError: called on a user RRef.
        """
        if not self.is_owner():
            # torch's words first (its tests match them), then ours.
            raise RRefError(f"For UserRRef(rref_id={_gid(self._rref_id)}, fork_id="
                            f"{_gid(self._fork_id)}), can't call localValue() on user "
                            f"{self._registry.agent.info}. Call it on owner {self.owner()}: "
                            f"RRef.local_value() must be called on the owner "
                            f"({self.owner_name()}); use to_here()")
        return _torch_futures.result(self._registry.entry(self._rref_id).value)

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied here; remote()'s creation errors surface here.

        ``timeout`` in seconds, -1 for the default, 0 for none; on expiry a
        RuntimeError says the RPC timed out.
        """
        if self.is_owner():
            return self.local_value()
        agent = self._registry.agent
        if profiler_enabled():  # torch's span, under any profiler
            with torch.autograd.profiler.record_function(
                    f"to_here#({agent.info.name})->({self.owner_name()})"):
                return self._fetch(agent, timeout)
        return self._fetch(agent, timeout)

    def _fetch(self, agent: RpcAgent, timeout: float) -> T:
        fut = agent.call(self.owner(), _owner_fetch, (self._rref_id,), {},
                         timeouts.for_call(timeout, agent.default_timeout))
        # The creation's acknowledgement arrives before the value: if it
        # failed (timed out, say), that is the error to raise.
        agent.wait(self._confirmed)
        return agent.wait(fut)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value, a scalar tensor, on its owner.

        With a distributed autograd context id, the distributed backward pass
        of that context (the owner must have taken part in it); with -1, local
        autograd on the owner, accumulating into ``.grad`` there, which only
        the owner's own RRef may ask for (as in torch).

        Raises:
            RRefError: a user RRef without a context id.
            RuntimeError: the value is not a tensor; the context is unknown.
        """
        if not self.is_owner() and dist_autograd_ctx_id == -1:
            raise RRefError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        if self.is_owner():
            _owner_backward(self, dist_autograd_ctx_id, retain_graph)
        else:
            agent = self._registry.agent
            agent.wait(api.rpc_async(self.owner(), _owner_backward,
                                     (self, dist_autograd_ctx_id, retain_graph)))

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.rpc_sync().m(*args)`` runs ``value.m(*args)`` on
        the owner and returns its result, raising as :func:`ucxrpc.rpc_sync`
        does; ``timeout`` as there (-1 the default, 0 none)."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """As :meth:`rpc_sync`, returning a future (:func:`ucxrpc.rpc_async`)."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """As :meth:`rpc_sync`, returning an RRef to the result, owned by
        this RRef's owner (:func:`ucxrpc.remote`)."""
        return _Proxy(self, "remote", timeout)

    def _get_profiling_future(self) -> torch.futures.Future:
        """torch's name: for an RRef made by ``remote()`` under torch's
        legacy profiler, the future that completes once the call's span and
        the owner's events are in the profile.

        Raises:
            RuntimeError: the RRef was not made so (torch's words).
        """
        if self._profiling_future is None:
            raise RuntimeError("Profiling future has not been set!")
        return self._profiling_future

    def _value_type(self) -> type:
        """The value's type (asked of the owner once, as torch's _get_type)."""
        t = getattr(self, "_type", None)
        if t is None:
            if self.is_owner():
                t = type(self.local_value())
            else:
                agent = self._registry.agent
                t = agent.wait(agent.call(self.owner(), _owner_type, (self._rref_id,), {},
                                          agent.default_timeout))
            self._type = t
        return t

    def __repr__(self) -> str:
        # torch's form, which its tests compare with.
        if self.is_owner():
            return f"OwnerRRef({_gid(self._rref_id)})"
        return f"UserRRef(RRefId = {_gid(self._rref_id)}, ForkId = {_gid(self._fork_id)})"


def _gid(id_: tuple[int, int] | None) -> str:
    """An RRef or fork id as torch prints one."""
    if id_ is None:
        return "None"
    return f"GloballyUniqueId(created_on={id_[0]}, local_id={id_[1]})"


def _failed(fut: torch.futures.Future) -> bool:
    return _torch_futures.failure(fut) is not None


def _rebuild_rref(owner: int, rref_id: RRefId, fork_id: ForkId | None) -> RRef[Any]:
    reg = registry()
    if owner == reg.me:  # sent to its owner: no fork was made
        return _owner_handle(reg, rref_id)
    return RRef._make(owner, rref_id, fork_id, confirmed=True)


def _owner_handle(reg: Registry, rref_id: RRefId) -> RRef[Any]:
    """The owner's local RRef object for ``rref_id`` (one per value)."""
    e = reg.entry(rref_id)
    with reg.lock:
        h = e.handle() if e.handle is not None else None
        if isinstance(h, RRef):  # the registry holds handles as its protocol: ours are RRefs
            return h
        made: RRef[Any] = RRef._make(reg.me, rref_id, None, confirmed=True)
        e.handle = weakref.ref(made, reg.freer(rref_id))
        return made


class _Proxy:
    """``rref.rpc_sync().method(...)`` and friends: call a method on the owner."""

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            owner = self._rref.owner()
            fargs = (self._rref, name, args, kwargs)
            if self._mode == "remote":
                # As torch: a name the value's type lacks fails here and now
                # (the new RRef would only fail on its first use).
                value_type = self._rref._value_type()
                if not hasattr(value_type, name):
                    raise AttributeError(f"'{value_type.__name__}' object has "
                                         f"no attribute '{name}'")
                return remote(owner, _invoke_method, fargs, timeout=self._timeout)
            if self._mode == "sync":
                # Through agent.wait: a proxy call inside an RPC handler must
                # not pin a pool thread (see _pool.WorkerPool.blocking).
                return api.rpc_sync(owner, _proxy_call, fargs, timeout=self._timeout)
            return api.rpc_async(owner, _proxy_call, fargs, timeout=self._timeout)
        return call


# -- remote() ---------------------------------------------------------------

def remote(to: Any, func: Callable[..., T], args: tuple[Any, ...] | None = None,
           kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> RRef[T]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an RRef to its result
    at once.

    ``timeout`` (seconds; -1 default, 0 none) covers creating the RRef, not
    the function's run.  Creation errors and timeouts, and the function's
    own exception, surface on the RRef's next use (``to_here``, proxies).

    Raises:
        RpcError: RPC is not initialized; an unknown ``to``.
        ValueError: ``timeout`` is negative but not -1.
    """
    agent = api._current()
    dest = agent.members.resolve(to)
    # Refused before an RRef exists: one made and dropped would leave the
    # owner a deletion to remember.
    seconds = timeouts.for_call(timeout, agent.default_timeout)
    reg = registry(agent)
    rref_id = new_id(reg.me)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if profiler_enabled():  # the one check a call pays for torch's profiler
        span = profiling.Span.begin(agent, "remote", func, dest)
        if span is not None:
            return _remote_profiled(agent, reg, dest, rref_id, span, func, args, kwargs, timeout)
    if dest.id == reg.me:
        rref = _owner_handle(reg, rref_id)
        # On the caller's streams: after the work that made the arguments.
        agent.submit(contextvars.copy_context().run, run_into, reg.entry(rref_id).value,
                     func, args, kwargs, devices.current_streams(agent.devices))
        return rref
    fork_id = new_id(reg.me)  # the caller's own fork, numbered as torch numbers it
    rref = RRef._make(dest.id, rref_id, fork_id, confirmed=False)
    fut = agent.call(dest, _owner_create, (rref_id, fork_id, reg.me, func, args, kwargs), {},
                     seconds)
    fut.add_done_callback(rref._confirm)
    return rref


def _remote_profiled(agent: RpcAgent, reg: Registry, dest: WorkerInfo, rref_id: RRefId,
                     span: profiling.Span, func: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], timeout: float) -> RRef[Any]:
    """``remote()`` under torch's legacy profiler: the owner runs the function
    under the profiler before it answers, so the span lasts until the value
    exists and the answer carries the owner's events, as in torch (whose
    creation ``timeout`` thus covers the function's run too, as here)."""
    try:
        if dest.id == reg.me:
            rref = _owner_handle(reg, rref_id)
            fut = span.run_here(agent, _owner_run_now, (rref_id, func, args, kwargs,
                                                        devices.current_streams(agent.devices)))
        else:
            fork_id = new_id(reg.me)
            rref = RRef._make(dest.id, rref_id, fork_id, confirmed=False)
            fut = agent.call(dest, *span.request(_owner_create_now,
                                                 (rref_id, fork_id, reg.me, func, args, kwargs),
                                                 {}),
                             timeouts.for_call(timeout, agent.default_timeout))
    except BaseException:
        span.abandon()
        raise
    profiled = span.finish(fut)
    if not rref.is_owner():
        profiled.add_done_callback(rref._confirm)
    rref._profiling_future = profiled
    return rref
