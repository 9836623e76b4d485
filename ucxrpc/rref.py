"""Remote references: ``remote()``, ``RRef`` and their reference counting.

An RRef names a value living on its *owner*.  Every RRef held outside the
owner is a *fork*, registered with the owner under a fork id before the
message carrying it leaves the sender, so:

* the owner knows every user (a parent keeps its own fork until the child's
  is registered, because registration happens before the child exists);
* a user RRef that dies sends its fork's deletion to the owner;
* the owner drops the value once it has no forks and no local RRef object.

Forks held by a worker that dies are dropped by the owner; RRefs owned by a
dead worker fail on use with an error naming it.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import queue
import threading
import weakref
from typing import Any, Callable, Generic, TypeVar

import torch

from . import api, devices
from .agent import RpcAgent, WorkerInfo
from .errors import RRefError
from .functions import _plain, async_execution

logger = logging.getLogger(__name__)

T = TypeVar("T")
RRefId = tuple[int, int]   # (creating worker, number)
ForkId = tuple[int, int]   # (worker that made the fork, number)
_ids = itertools.count(1)


class _Owned:
    """The owner's record of one RRef: its value and who holds forks.

    On a worker with CUDA devices the value's future knows them, as torch's
    OwnerRRef's: set on the streams that made the value, it records where
    that work ends, and whoever waits for it (``local_value``, ``to_here``'s
    reply, proxies) waits on its own streams for that work.
    """

    __slots__ = ("value", "forks", "handle")

    def __init__(self, devs: list[torch.device]) -> None:
        self.value: torch.futures.Future = devices.future(devs)
        self.forks: dict[ForkId, int] = {}
        self.handle: weakref.ref[RRef[Any]] | None = None


class _Registry:
    """Per-agent RRef state: owned values, and deletions waiting to be sent."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.me = agent.info.id
        # Reentrant: RRef finalizers and weakref callbacks take it, and the
        # garbage collector may run them on a thread that already holds it.
        self.lock = threading.RLock()
        self.owned: dict[RRefId, _Owned] = {}
        # Forks deleted before their registration ran: requests run on a
        # thread pool, so a deletion can overtake the message creating it.
        self.tombstones: set[tuple[RRefId, ForkId]] = set()
        self.users = 0          # live user RRefs on this worker
        self.pending_users = 0  # of which not yet confirmed by their owner
        self.deletions: queue.SimpleQueue[tuple[int, RRefId, ForkId]] = queue.SimpleQueue()
        self.janitor = threading.Thread(target=self._send_deletions, daemon=True,
                                        name=f"ucxrpc-rref-{self.me}")
        self.janitor.start()
        agent.hooks.before_shutdown.append(self._flush)
        agent.hooks.on_peer_failure.append(self._drop_forks_of)
        agent.hooks.debug_sources.append(self.debug_info)

    # -- owner side --------------------------------------------------------

    def entry(self, rref_id: RRefId) -> _Owned:
        """The record of ``rref_id``, created if a message got here first."""
        with self.lock:
            e = self.owned.get(rref_id)
            if e is None:
                e = self.owned[rref_id] = _Owned(self.agent.devices)
            return e

    def handle(self, rref_id: RRefId) -> RRef[Any]:
        """The owner's local RRef object for ``rref_id`` (one per value)."""
        e = self.entry(rref_id)
        with self.lock:
            h = e.handle() if e.handle is not None else None
            if h is None:
                h = RRef._make(self.me, rref_id, None, confirmed=True)
                e.handle = weakref.ref(h, self._freer(rref_id))
            return h

    def _freer(self, rref_id: RRefId) -> Callable[[Any], None]:
        """A weakref callback: the owner's local RRef object died."""
        def freed(_: Any) -> None:
            self._maybe_free(rref_id)
        return freed

    def add_fork(self, rref_id: RRefId, fork_id: ForkId, holder: int) -> None:
        e = self.entry(rref_id)
        with self.lock:
            if (rref_id, fork_id) in self.tombstones:
                self.tombstones.discard((rref_id, fork_id))
            else:
                e.forks[fork_id] = holder
        self._maybe_free(rref_id)

    def del_forks(self, items: list[tuple[RRefId, ForkId]]) -> None:
        for rref_id, fork_id in items:
            with self.lock:
                e = self.owned.get(rref_id)
                if e is None or e.forks.pop(fork_id, None) is None:
                    self.tombstones.add((rref_id, fork_id))
            self._maybe_free(rref_id)

    def _maybe_free(self, rref_id: RRefId) -> None:
        with self.lock:
            e = self.owned.get(rref_id)
            if e is None or e.forks or (e.handle is not None and e.handle() is not None):
                return
            del self.owned[rref_id]  # the value goes with it

    def _drop_forks_of(self, peer: int) -> None:
        with self.lock:
            gone = [(rid, fid) for rid, e in self.owned.items()
                    for fid, holder in e.forks.items() if holder == peer]
        if gone:
            logger.info("dropping %d RRef forks held by dead worker %d", len(gone), peer)
            self.del_forks(gone)

    # -- user side ---------------------------------------------------------

    def user_died(self, owner: int, rref_id: RRefId, fork_id: ForkId, confirmed: bool) -> None:
        # Runs in __del__, maybe on any thread, maybe inside a lock holder:
        # only a SimpleQueue put is safe here.
        with self.lock:
            self.users -= 1
            if not confirmed:
                self.pending_users -= 1
        self.deletions.put((owner, rref_id, fork_id))

    def _send_deletions(self) -> None:
        # Runs until the agent closes: a worker in its shutdown barrier still
        # serves calls, and RRefs those calls drop must still reach owners.
        while not self.agent.closed:
            try:
                item = self.deletions.get(timeout=0.5)
            except queue.Empty:
                continue
            batch: dict[int, list[tuple[RRefId, ForkId]]] = {}
            pending: tuple[int, RRefId, ForkId] | None = item
            while pending is not None:
                batch.setdefault(pending[0], []).append((pending[1], pending[2]))
                try:
                    pending = self.deletions.get_nowait()
                except queue.Empty:
                    pending = None
            self._send_batch(batch)

    def _send_batch(self, batch: dict[int, list[tuple[RRefId, ForkId]]]) -> list[Any]:
        futs = []
        for owner, items in batch.items():
            if owner == self.me:
                self.del_forks(items)
                continue
            try:
                futs.append(self.agent.call(self.agent.workers[owner], _owner_del_forks,
                                            (items,), {}, 0))
            except Exception as exc:  # owner gone: nothing left to free
                logger.debug("RRef deletions for worker %d not sent: %s", owner, exc)
        return futs

    def _flush(self, timeout: float | None) -> None:
        """Before a graceful shutdown: tell owners about every dead user now."""
        import gc

        gc.collect()
        batch: dict[int, list[tuple[RRefId, ForkId]]] = {}
        while True:
            try:
                item = self.deletions.get_nowait()
            except queue.Empty:
                break
            batch.setdefault(item[0], []).append((item[1], item[2]))
        for fut in self._send_batch(batch):
            try:
                fut.wait()
            except Exception:  # owner died meanwhile
                pass

    def debug_info(self) -> dict[str, int]:
        with self.lock:
            return {"num_owner_rrefs": len(self.owned), "num_pending_users": self.pending_users,
                    "num_forks": sum(len(e.forks) for e in self.owned.values()),
                    "num_user_rrefs": self.users}


def _registry(agent: RpcAgent | None = None) -> _Registry:
    return (agent or api._current()).extension("rref", _Registry)


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
    _registry: _Registry

    def __init__(self, value: T, type_hint: Any = None) -> None:
        reg = _registry()
        rref_id = (reg.me, next(_ids))
        e = reg.entry(rref_id)
        e.value.set_result(value)
        self._setup(reg, reg.me, rref_id, None, confirmed=True)
        e.handle = weakref.ref(self, reg._freer(rref_id))

    @classmethod
    def _make(cls, owner: int, rref_id: RRefId, fork_id: ForkId | None,
              confirmed: bool) -> RRef[Any]:
        self = cls.__new__(cls)
        self._setup(_registry(), owner, rref_id, fork_id, confirmed)
        return self

    def _setup(self, reg: _Registry, owner: int, rref_id: RRefId, fork_id: ForkId | None,
               confirmed: bool) -> None:
        self._registry = reg
        self._owner_id = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._confirmed = torch.futures.Future()
        if confirmed:
            self._confirmed.set_result(None)
        if fork_id is not None:
            with reg.lock:
                reg.users += 1
                if not confirmed:
                    reg.pending_users += 1

    def _confirm(self, fut: torch.futures.Future) -> None:
        """Creation acknowledged (or failed) by the owner."""
        reg = self._registry
        with reg.lock:
            reg.pending_users -= 1
        try:
            fut.value()
        except Exception as exc:
            self._confirmed.set_exception(exc)
            return
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
            raise RRefError("an RRef can only be pickled inside an RPC (as an argument "
                            "or a return value)")
        fork_id: ForkId | None = None
        if dest != self._owner_id:
            fork_id = (agent.info.id, next(_ids))
            if self.is_owner():
                self._registry.add_fork(self._rref_id, fork_id, dest)
            else:
                # Registered before the message exists: the owner always
                # knows of the child before the child can drop it.
                owner = agent.workers[self._owner_id]
                agent.wait(agent.call(owner, _owner_add_fork, (self._rref_id, fork_id, dest),
                                      {}, agent.options.rpc_timeout))
        return (_rebuild_rref, (self._owner_id, self._rref_id, fork_id))

    # -- torch's RRef API --------------------------------------------------

    def is_owner(self) -> bool:
        return self._owner_id == self._registry.me

    def owner(self) -> WorkerInfo:
        return self._registry.agent.workers[self._owner_id]

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
            raise RRefError(f"RRef.local_value() must be called on the owner "
                            f"({self.owner_name()}), not on {self._registry.agent.info.name}; "
                            "use to_here()")
        return self._registry.entry(self._rref_id).value.wait()

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied here; remote()'s creation errors surface here.

        ``timeout`` in seconds, -1 for the default, 0 for none; on expiry a
        RuntimeError says the RPC timed out.
        """
        if self.is_owner():
            return self.local_value()
        agent = self._registry.agent
        fut = agent.call(self.owner(), _owner_fetch, (self._rref_id,), {},
                         _resolve_timeout(agent, timeout))
        # The creation's acknowledgement arrives before the value: if it
        # failed (timed out, say), that is the error to raise.
        agent.wait(self._confirmed)
        return agent.wait(fut)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value, a scalar tensor, on its owner.

        With a distributed autograd context id, the distributed backward pass
        of that context (the owner must have taken part in it); with -1, local
        autograd on the owner, accumulating into ``.grad`` there.
        """
        if self.is_owner():
            _owner_backward(self, dist_autograd_ctx_id, retain_graph)
        else:
            agent = self._registry.agent
            agent.wait(api.rpc_async(self.owner(), _owner_backward,
                                     (self, dist_autograd_ctx_id, retain_graph)))

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "remote", timeout)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(RRefId = {self._rref_id}, ForkId = {self._fork_id})"


def _failed(fut: torch.futures.Future) -> bool:
    try:
        fut.value()
    except Exception:
        return True
    return False


def _resolve_timeout(agent: RpcAgent, timeout: float) -> float:
    return agent.options.rpc_timeout if timeout is None or timeout < 0 else float(timeout)


def _rebuild_rref(owner: int, rref_id: RRefId, fork_id: ForkId | None) -> RRef[Any]:
    reg = _registry()
    if owner == reg.me:  # sent to its owner: no fork was made
        return reg.handle(rref_id)
    return RRef._make(owner, rref_id, fork_id, confirmed=True)


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
                return remote(owner, _invoke_method, fargs, timeout=self._timeout)
            fut = api.rpc_async(owner, _proxy_call, fargs, timeout=self._timeout)
            # agent.wait: a proxy call inside an RPC handler must not pin a
            # pool thread (see _pool.WorkerPool.blocking).
            return api._current().wait(fut) if self._mode == "sync" else fut
        return call


# -- functions run on the owner ---------------------------------------------

def _owner_create(rref_id: RRefId, fork_id: ForkId, holder: int, func: Any,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    reg = _registry()
    e = reg.entry(rref_id)
    reg.add_fork(rref_id, fork_id, holder)
    # With the caller's context variables: a distributed autograd context
    # keeps recording the function's own calls.  On this call's streams,
    # where its received arguments are recorded (see devices.callee_streams).
    ctx = contextvars.copy_context()
    reg.agent.submit(ctx.run, _run_into, e.value, func, args, kwargs,
                           devices.current_streams(reg.agent.devices))


def _run_into(target: torch.futures.Future, func: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any], streams: list[Any]) -> None:
    """Run ``func`` on ``streams`` (one per CUDA device of this worker, none
    without) and set ``target``, which records where the value's work ends."""
    with devices.on_streams(streams):
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            target.set_exception(exc)
            return
        if getattr(func, "_wrapped_async_rpc_function", None) is not None and \
                isinstance(result, torch._C.Future):
            result.add_done_callback(lambda f: _copy_result(f, target))
            return
        target.set_result(result)


def _copy_result(src: torch.futures.Future, dst: torch.futures.Future) -> None:
    try:
        dst.set_result(src.value())
    except Exception as exc:
        dst.set_exception(exc)


@async_execution
def _owner_fetch(rref_id: RRefId) -> torch.futures.Future:
    return _registry().entry(rref_id).value


@_plain
def _owner_add_fork(rref_id: RRefId, fork_id: ForkId, holder: int) -> None:
    _registry().add_fork(rref_id, fork_id, holder)


@_plain
def _owner_backward(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    reg = _registry()
    value = reg.agent.wait(reg.entry(rref._rref_id).value)
    if not isinstance(value, torch.Tensor):
        raise RRefError(f"RRef.backward needs an RRef of a tensor; {rref} holds a "
                        f"{type(value).__name__}")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
        return
    dist_backward = reg.agent.hooks.dist_backward
    if dist_backward is None:  # no autograd context ever existed here
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    dist_backward(context_id, [value], retain_graph)


@_plain
def _owner_del_forks(items: list[tuple[RRefId, ForkId]]) -> None:
    _registry().del_forks(items)


@async_execution
def _proxy_call(rref: RRef[Any], name: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.futures.Future:
    reg = _registry()
    value = reg.entry(rref._rref_id).value
    out = devices.future(reg.agent.devices)
    # The method may run later, on the thread that sets the value: with this
    # call's context variables (a distributed autograd context) all the same,
    # and on this call's streams, where its arguments are recorded; wait()
    # makes them follow the value's work.
    ctx = contextvars.copy_context()
    streams = devices.current_streams(reg.agent.devices)

    def run(f: torch.futures.Future) -> None:
        try:
            with devices.on_streams(streams):
                out.set_result(ctx.run(getattr(f.wait(), name), *args, **kwargs))
        except Exception as exc:  # set_exception keeps its type; then() would not
            out.set_exception(exc)

    value.add_done_callback(run)
    return out


def _invoke_method(rref: RRef[Any], name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    return getattr(rref.local_value(), name)(*args, **kwargs)


# -- remote() ---------------------------------------------------------------

def remote(to: Any, func: Callable[..., T], args: tuple[Any, ...] | None = None,
           kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> RRef[T]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an RRef to its result
    at once.

    ``timeout`` (seconds; -1 default, 0 none) covers creating the RRef, not
    the function's run.  Creation errors and timeouts, and the function's
    own exception, surface on the RRef's next use (``to_here``, proxies).
    """
    agent = api._current()
    dest = agent.resolve(to)
    reg = _registry(agent)
    rref_id = (reg.me, next(_ids))
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if dest.id == reg.me:
        rref = reg.handle(rref_id)
        # On the caller's streams: after the work that made the arguments.
        agent.submit(contextvars.copy_context().run, _run_into, reg.entry(rref_id).value,
                           func, args, kwargs, devices.current_streams(agent.devices))
        return rref
    rref = RRef._make(dest.id, rref_id, rref_id, confirmed=False)
    fut = agent.call(dest, _owner_create, (rref_id, rref_id, reg.me, func, args, kwargs), {},
                     _resolve_timeout(agent, timeout))
    fut.add_done_callback(rref._confirm)
    return rref
