"""torch's ``rpc.api._all_gather``: every worker's object, at every worker.

The worker first by name leads: the others send it their objects
(:func:`_gather_at_leader`), and once all are in it sends each of them all
of them (:func:`_answer_follower`).  Each call is numbered per set of
workers (:class:`_Gatherings`, one per agent), since every worker of a set
makes the same calls in the same order (torch's rule); :class:`_Gathering`
is one call as this worker sees it.

:mod:`ucxrpc.api` imports :func:`_all_gather`, where torch has it and
libraries call it (PyG), and builds ``_wait_all_workers`` and ``_barrier``
on it.  This module needs three of the API's functions (the current agent,
``rpc_sync``, ``rpc_async``): the API hands them over as it is imported
(:func:`bind`), so that neither module imports the other back.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from . import timeouts
from .errors import RpcError, RpcTimeoutError
from .functions import _plain

if TYPE_CHECKING:
    from .agent import RpcAgent


class _Api:
    """What this module calls of :mod:`ucxrpc.api` (handed over by :func:`bind`)."""

    current: Callable[[], RpcAgent]
    rpc_sync: Callable[..., Any]
    rpc_async: Callable[..., Any]


api = _Api()


def bind(current: Callable[[], RpcAgent], rpc_sync: Callable[..., Any],
         rpc_async: Callable[..., Any]) -> None:
    """Called once by :mod:`ucxrpc.api` as it is imported."""
    api.current, api.rpc_sync, api.rpc_async = current, rpc_sync, rpc_async


class _Gathering:
    """One ``_all_gather`` as this worker sees it: on the leader, the objects
    coming in (``all_in`` once every worker's did); on a follower, the
    leader's answer (``answered``).  ``ended`` once this worker left it, so
    that a message come too late is refused rather than kept."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.objects: dict[str, Any] = {}
        self.all_in = threading.Event()
        self.answered = threading.Event()
        self.ended = False


class _Gatherings:
    """An agent's all-gathers, by sequence id: every worker numbers its
    calls for a set of workers alike, since all of them make the same calls
    in the same order (torch's rule)."""

    def __init__(self, agent: RpcAgent) -> None:  # (made per agent: a new job numbers from 0)
        self.lock = threading.Lock()
        self.next: dict[tuple[str, ...], int] = {}
        self.open: dict[str, _Gathering] = {}

    def begin(self, names: frozenset[str]) -> tuple[str, _Gathering]:
        group = tuple(sorted(names))
        with self.lock:
            n = self.next.get(group, 0)
            self.next[group] = n + 1
        seq = f"{','.join(group)}#{n}"
        return seq, self.get(seq, names)

    def get(self, seq: str, names: frozenset[str]) -> _Gathering:
        with self.lock:
            g = self.open.get(seq)
            if g is None:
                g = self.open[seq] = _Gathering(names)
            return g

    def end(self, seq: str, g: _Gathering, ok: bool) -> None:
        with self.lock:
            g.ended = True
            if ok:  # a failed one stays, ended: a late message is refused, not kept
                self.open.pop(seq, None)


def _gatherings(agent: RpcAgent) -> _Gatherings:
    return agent.extension("all_gather", _Gatherings)


@_plain
def _gather_at_leader(seq: str, name: str, obj: Any, names: frozenset[str]) -> None:
    """On the leader: ``name``'s object for all-gather ``seq``."""
    states = _gatherings(api.current())
    g = states.get(seq, names)
    with states.lock:
        if g.ended:
            raise RpcError(f"_all_gather {seq} already ended on its leader (it timed out): "
                           f"{name}'s object came too late")
        if name not in g.names or name in g.objects:
            why = "twice" if name in g.objects else "from a worker not among its workers"
            raise RpcError(f"_all_gather {seq}: an object from {name} {why}")
        g.objects[name] = obj
        if len(g.objects) == len(g.names):
            g.all_in.set()


@_plain
def _answer_follower(seq: str, objects: dict[str, Any]) -> None:
    """On a follower: every worker's object, from the leader.  One come
    after this worker gave up (its own error said so) is dropped."""
    states = _gatherings(api.current())
    g = states.get(seq, frozenset(objects))
    with states.lock:
        if not g.ended:
            g.objects = objects
            g.answered.set()


def _all_gather(obj: Any, worker_names: Any = None,
                timeout: float = timeouts.UNSET) -> dict[str, Any]:
    """Every worker's ``obj``, by worker name, once all of ``worker_names``
    (default: every worker) called this: torch's ``rpc.api._all_gather``.
    The worker first by name leads: the others send it their objects, it
    sends each of them all of them.  Every worker of the set must make the
    same calls in the same order.

    ``timeout``: -1 (the default) bounds each call by the RPC timeout and
    the wait for the others not at all; 0 bounds nothing; else seconds for
    both, as torch's.

    Raises:
        RuntimeError: a wait ran out of time, or the leader could not give
            some followers the result (naming them).
        ValueError: this worker is not one of ``worker_names``.
    """
    agent = api.current()
    me = agent.info.name
    names = frozenset(worker_names) if worker_names is not None else frozenset(
        wi.name for wi in list(agent.members.workers.values()))
    if me not in names:
        raise ValueError(f"_all_gather on {me}, which is not one of its workers "
                         f"{sorted(names)}")
    if timeout == timeouts.UNSET:
        call_timeout, wait_timeout = timeouts.UNSET, None
    elif timeout == 0:
        call_timeout, wait_timeout = 0.0, None
    else:
        call_timeout = wait_timeout = float(timeout)
    states = _gatherings(agent)
    seq, g = states.begin(names)
    leader = min(names)
    ok = False
    try:
        if leader != me:
            api.rpc_sync(leader, _gather_at_leader, (seq, me, obj, names), timeout=call_timeout)
            with agent.blocking():
                if not g.answered.wait(wait_timeout):
                    raise RpcError(f"timed out in _all_gather after {wait_timeout:.2f} seconds "
                                   f"waiting for the objects from its leader {leader}")
            ok = True
            return g.objects
        _gather_at_leader(seq, me, obj, names)
        with agent.blocking():
            if not g.all_in.wait(wait_timeout):
                missing = sorted(names - set(g.objects))
                raise RpcError(f"timed out in _all_gather after {wait_timeout:.2f} seconds: "
                               f"no object from {', '.join(missing)}")
        answers = {name: api.rpc_async(name, _answer_follower, (seq, g.objects),
                                       timeout=call_timeout)
                   for name in sorted(names - {me})}
        failed = []
        for name, fut in answers.items():
            try:
                fut.wait()
            except Exception as exc:
                failed.append((name, exc))
        if failed:
            limit = agent.default_timeout if call_timeout == timeouts.UNSET else call_timeout
            said = (f"timed out in _all_gather after {limit:.2f} seconds"
                    if limit and all(isinstance(e, RpcTimeoutError) for _, e in failed)
                    else "could not be given the result of _all_gather")
            raise RpcError(f"Followers {[n for n, _ in failed]} {said}. "
                           f"The first exception is {failed[0][1]}")
        ok = True
        return g.objects
    finally:
        states.end(seq, g, ok)
