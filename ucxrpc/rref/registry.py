"""Per-agent RRef state: the values this worker owns and who holds forks of
them, and the count of user RRefs it holds."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch

from .. import devices
from ..agent import RpcAgent
from ..errors import RRefError

__all__ = ["ForkId", "Handle", "Owned", "RRefId", "Registry", "new_id"]

logger = logging.getLogger(__name__)

RRefId = tuple[int, int]   # (creating worker, number)
ForkId = tuple[int, int]   # (worker that made the fork, number)
_ids = itertools.count(0)  # one counter for RRef and fork ids, from 0, as torch's
#: How many values freed by a peer's failure are remembered (:attr:`Registry.lost`).
LOST_KEPT = 4096


class Handle(Protocol):
    """What the owner's side uses of an RRef (:class:`.handle.RRef`): its id,
    and, for a proxy's call, its value here and a proxy of its own.  A
    protocol, so that what the RRef calls (owner.py, proxy.py) need not
    import the RRef."""

    _rref_id: RRefId

    def local_value(self) -> Any: ...

    def remote(self, timeout: float = -1.0) -> Any: ...

    def rpc_sync(self, timeout: float = -1.0) -> Any: ...


def new_id(me: int) -> tuple[int, int]:
    """A fresh RRef or fork id made by worker ``me``."""
    return (me, next(_ids))


class Owned:
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
        self.handle: weakref.ref[Handle] | None = None


class Registry:
    """Owned values, fork accounting, and deletions waiting to be sent (the
    janitor, :mod:`.janitor`, sends them)."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.me = agent.info.id
        # Reentrant: RRef finalizers and weakref callbacks take it, and the
        # garbage collector may run them on a thread that already holds it.
        self.lock = threading.RLock()
        self.owned: dict[RRefId, Owned] = {}
        # Forks deleted before their registration ran: requests run on a
        # thread pool, so a deletion can overtake the message creating it.
        self.tombstones: set[tuple[RRefId, ForkId]] = set()
        self.users = 0          # live user RRefs on this worker
        self.pending_users = 0  # of which not yet confirmed by their owner
        self.deletions: queue.SimpleQueue[tuple[int, RRefId, ForkId]] = queue.SimpleQueue()
        #: Values freed because the peers holding their forks failed or
        #: became unreachable, and why: a user that comes back after an
        #: outage and asks for one is told so (:meth:`entry`), instead of
        #: waiting for a value that will never be made.  The latest kept.
        self.lost: OrderedDict[RRefId, str] = OrderedDict()

    # -- owner side --------------------------------------------------------

    def entry(self, rref_id: RRefId) -> Owned:
        """The record of ``rref_id``, created if a message got here first.

        Raises:
            RRefError: the value was freed when the peers holding it failed
                (:meth:`drop_forks_of`), naming them and why.
        """
        with self.lock:
            e = self.owned.get(rref_id)
            if e is None:
                why = self.lost.get(rref_id)
                if why is not None:
                    raise RRefError(f"RRef {rref_id} owned by {self.agent.info.name} is gone: "
                                    f"{why}")
                e = self.owned[rref_id] = Owned(self.agent.devices)
                # _maybe_free keeps a value still being made; this looks again
                # once it is made.
                e.value.add_done_callback(lambda _: self._maybe_free(rref_id))
            return e

    def freer(self, rref_id: RRefId) -> Callable[[Any], None]:
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
            if not e.value.done():
                # Requests run on a pool, so a proxy call or fetch sent right
                # after remote() can get here before the message creating the
                # value, and its RRef argument die before that message adds
                # the caller's fork: freeing now would orphan the waiters of
                # this future and make the creation start a fresh entry.
                return
            del self.owned[rref_id]  # the value goes with it

    def drop_forks_of(self, peer: int, err: BaseException | None = None) -> None:
        """``peer`` died, became unreachable or left (``err``: how its calls
        fail): the forks it held are gone, and so are values nobody else
        holds; a later request for one of those is told why."""
        with self.lock:
            gone = [(rid, fid) for rid, e in self.owned.items()
                    for fid, holder in e.forks.items() if holder == peer]
        if not gone:
            return
        logger.info("dropping %d RRef forks held by worker %d: %s", len(gone), peer, err)
        self.del_forks(gone)
        why = (f"it was freed when {err} (an RRef does not outlive a failure, or an outage, "
               "between its owner and a worker holding it)")
        with self.lock:
            for rid, _ in gone:
                if rid not in self.owned:
                    self.lost[rid] = why
            while len(self.lost) > LOST_KEPT:
                self.lost.popitem(last=False)

    # -- user side ---------------------------------------------------------

    def user_made(self, confirmed: bool) -> None:
        with self.lock:
            self.users += 1
            if not confirmed:
                self.pending_users += 1

    def user_confirmed(self) -> None:
        with self.lock:
            self.pending_users -= 1

    def user_died(self, owner: int, rref_id: RRefId, fork_id: ForkId, confirmed: bool) -> None:
        # Runs in __del__, maybe on any thread, maybe inside a lock holder:
        # only a SimpleQueue put is safe here.
        with self.lock:
            self.users -= 1
            if not confirmed:
                self.pending_users -= 1
        self.deletions.put((owner, rref_id, fork_id))

    def debug_info(self) -> dict[str, int]:
        with self.lock:
            return {"num_owner_rrefs": len(self.owned), "num_pending_users": self.pending_users,
                    "num_forks": sum(len(e.forks) for e in self.owned.values()),
                    "num_user_rrefs": self.users}
