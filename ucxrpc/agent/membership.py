"""Dynamic membership (``init_rpc(world_size=None)``): joining and leaving
a running group, one worker at a time, as torch does.

Join, under the group lock (:class:`rendezvous.GroupLock`): check that the
rank and the name are free (or held by an earlier process of this worker,
one its kernel says is gone: a process restarted under its name and rank
takes its place, a new incarnation the others reach at its new address),
publish this worker's record, check everyone's
device maps with it included, start serving, add the rank to the group, then
tell every present worker (an RPC each, so that when ``init_rpc`` returns
every worker knows the newcomer, as in torch).  A present worker learns where
the newcomer lives from its record when the newcomer's first handshake
arrives.  Leave, under the lock: tell every present worker, which fails what
was pending with the leaver and drops its RRef forks and autograd contexts,
then take the rank out of the group.  A worker that cannot be told (dead,
unreachable) is skipped with a warning: it cannot hold up the others.

The store lives in rank 0 (as in torch), so rank 0 leaves last.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable

from . import rendezvous
from . import RpcAgent
from ..errors import RpcError

logger = logging.getLogger(__name__)

__all__ = ["join", "leave"]


def join(agent: RpcAgent, timeout: float | None, welcome: Callable[[str], None],
         farewell: Callable[[int], None]) -> None:
    """Join ``agent``'s dynamic group.  ``welcome(record_json)`` and
    ``farewell(rank)`` are the functions the other workers run (by RPC) to
    add and remove a worker.

    Raises:
        RpcError: the rank or name is taken, or the group
            lock was not had within ``timeout``.
        ValueError: device maps that fail torch's checks.
    """
    store = agent.store
    with rendezvous.GroupLock(store, _token(agent), timeout):
        present = {r: rendezvous.member(store, r) for r in rendezvous.group_ranks(store)}
        me = agent.info
        held = present.get(me.id)
        if held is not None and held.name == me.name:
            # A process restarted under its name and rank: it takes the
            # place of the one that died, once that one's kernel says so.
            gone = agent.transport.process_gone(held.peer())
            if gone is None:
                raise RpcError(f"rank {me.id} is already in the group, as {me.name!r}, "
                               "whose process lives (or does not answer); ranks must be "
                               "unique")
            logger.warning("%s takes the place of its earlier process: %s", me, gone)
            del present[me.id]
        if me.id in present:
            raise RpcError(f"rank {me.id} is already in the group, as "
                           f"{present[me.id].name!r}; ranks must be unique")
        for m in present.values():
            if m.name == me.name:
                raise RpcError(f"worker name {me.name!r} is already in the group, as rank "
                               f"{m.rank}; names must be unique")
        record = agent.publish()
        agent.check_device_maps({**present, me.id: record})
        for m in (record, *present.values()):
            agent.members.add(m)
        agent.transport.on_unknown_peer = agent.lookup_member
        agent.start()
        rendezvous.set_group_ranks(store, [*present, me.id])
        _tell(agent, list(present), welcome, (record.to_json(),), timeout)
    agent.hooks.leave_group = lambda t: leave(agent, t, farewell)
    agent.joined()
    logger.info("%s joined a group of %d workers", me, len(present) + 1)


def leave(agent: RpcAgent, timeout: float | None, farewell: Callable[[int], None]) -> None:
    """Leave the group: every present worker forgets this one first."""
    store = agent.store
    me = agent.info.id
    try:
        with rendezvous.GroupLock(store, _token(agent), timeout):
            others = [r for r in rendezvous.group_ranks(store) if r != me]
            _tell(agent, others, farewell, (me,), timeout)
            rendezvous.set_group_ranks(store, others)
    except Exception as exc:  # the store went with rank 0, or timed out
        logger.warning("%s: could not leave the group cleanly: %s", agent.info, exc)


def _token(agent: RpcAgent) -> str:
    """Who holds the group lock, unique to this attempt (and readable in the
    error of one who waited too long for it)."""
    return f"{agent.info.name}/{os.getpid()}/{uuid.uuid4().hex}"


def _tell(agent: RpcAgent, ranks: list[int], func: Callable[..., Any], args: tuple[Any, ...],
          timeout: float | None) -> None:
    futures = []
    for r in ranks:
        to = agent.members.workers.get(r)
        if to is None or agent.members.is_broken(r):
            continue
        try:
            futures.append((to, agent.call(to, func, args, {}, timeout)))
        except RpcError as exc:
            logger.warning("%s: could not reach %s: %s", agent.info, to.name, exc)
    for to, fut in futures:
        try:
            agent.wait(fut)
        except RpcError as exc:
            logger.warning("%s: %s did not answer (%s); going on without it",
                           agent.info, to.name, exc)

