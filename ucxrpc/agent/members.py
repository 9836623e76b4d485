"""Who the workers of a job are, what their names resolve to, and which
of them failed or left.

:class:`Members` is one agent's view of the job: the worker table (this
worker included), name resolution with torch's error messages, the record
of peers whose pipe broke or who left a dynamic group (with the error their
calls fail with), and the device maps per peer, set at join.  It opens no
pipe itself: a new peer is handed to ``add_peer`` (the transport's), and a
peer that is gone to ``on_gone(peer, error)`` (the agent fails its calls and
tells the layers above), so it can be built and tested without a process.

Contract:

* :meth:`add` of a known worker replaces its entry and forgets its earlier
  failure: it joined again (maybe at a new address, which the transport
  opens a new pipe to).
* A peer's first failure is kept; later reports of it are ignored, and so
  are reports about a worker that is not (or no longer) a member, with one
  exception: a peer failed as unreachable (:class:`UnreachableError`: its
  process may live on) that is then found gone is failed again, with that.
* An unreachable peer is :meth:`restore`-d once its pipe is re-established:
  its calls work again.
* ``on_gone`` runs once per failure or departure, while the worker is still
  in the table (its name still resolves in what ``on_gone`` does).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .. import devices
import logging
import time

from ..errors import (AuthenticationError, BrokenError, ClosedError, PeerLeftError, RpcError,
                      UnreachableError)
from ..transport import Peer
from .rendezvous import Member
from .info import WorkerInfo

__all__ = ["AddPeer", "Members"]

logger = logging.getLogger(__name__)

#: The transport's ``add_peer(peer)``.
AddPeer = Callable[[Peer], None]


class Members:
    """The workers one agent knows, by id and by name, and their state."""

    def __init__(self, me: WorkerInfo, *, add_peer: AddPeer,
                 on_gone: Callable[[int, BaseException], None],
                 my_maps: Callable[[], Mapping[str, devices.DeviceMap]] = dict) -> None:
        """``me``: this worker; ``my_maps()``: its device maps by peer name
        (the options', read at each :meth:`add`)."""
        self.me = me
        self._add_peer = add_peer
        self._on_gone = on_gone
        self._my_maps = my_maps
        self.workers: dict[int, WorkerInfo] = {}
        self._names: dict[str, WorkerInfo] = {}
        # By peer id: where this worker's tensors land on the peer (requests),
        # and the reverse of the peer's map to us (replies).
        self.device_maps: dict[int, devices.DeviceMap] = {}
        self.reverse_device_maps: dict[int, devices.DeviceMap] = {}
        self._broken: dict[int, BaseException] = {}
        # is_broken is the dict's own membership test, bound over the
        # method: every call asks it, a Python call fewer each (issue 52).
        self.is_broken = self._broken.__contains__  # type: ignore[method-assign, assignment]
        #: When each peer now unreachable was found so (monotonic seconds).
        self._unreachable_since: dict[int, float] = {}
        # (peer, replying) -> (the map it was learnt from, device -> target).
        self._target_cache: dict[tuple[int, bool], tuple[Any, dict[int, int]]] = {}
        #: How many pipes to peers broke (departures not counted).
        self.failures = 0

    # ------------------------------------------------------------ the table

    def add(self, m: Member) -> None:
        """Know worker ``m`` (this one too): at join, and when a worker joins
        a dynamic group (maybe again, at a new address)."""
        if m.rank != self.me.id:
            mine = self._my_maps().get(m.name)
            if mine:
                self.device_maps[m.rank] = mine
            theirs = m.device_maps.get(self.me.name)
            if theirs:
                self.reverse_device_maps[m.rank] = {
                    dst: src for src, dst in devices.to_device_map(theirs).items()}
            self._add_peer(m.peer())
            self._broken.pop(m.rank, None)
            self._unreachable_since.pop(m.rank, None)
        wi = WorkerInfo(m.name, m.rank)
        self.workers[m.rank] = wi
        self._names[m.name] = wi

    def remove(self, rank: int) -> None:
        """A worker left a dynamic group: its calls fail (``on_gone``, with a
        :class:`PeerLeftError`), then its name is unknown from now on and its
        device maps are dropped.  Unknown ranks and this worker are ignored."""
        wi = self.workers.get(rank)
        if wi is None or rank == self.me.id:
            return
        self._gone(rank, PeerLeftError(f"worker {wi.name} left the group"))
        self.workers.pop(rank, None)
        # The name may belong to a newer worker already (it left and rejoined
        # under another rank): only our own entry goes.
        if self._names.get(wi.name) == wi:
            del self._names[wi.name]
        self.device_maps.pop(rank, None)
        self.reverse_device_maps.pop(rank, None)

    def name_of(self, peer: int) -> str:
        """The name of worker ``peer``, or "id N" for one we do not know."""
        wi = self.workers.get(peer)
        return wi.name if wi is not None else f"id {peer}"

    def resolve(self, to: Any) -> WorkerInfo:
        """The member ``to`` names: a name, an id, or a WorkerInfo.

        Raises:
            RpcError: no such member (torch's message, naming ``to``).
            ValueError: a float (torch's type for a wrong rank value).
            TypeError: anything else.
        """
        if isinstance(to, WorkerInfo):
            if self.workers.get(to.id) != to:
                raise RpcError(f"Unknown destination worker {to}: could not find destination "
                               f"id {to.id}")
            return to
        if isinstance(to, str):
            wi = self._names.get(to)
            if wi is None:
                raise RpcError(f"Unknown destination worker {to}: could not find "
                               f"destination name {to}")
            return wi
        if isinstance(to, int) and not isinstance(to, bool):
            wi = self.workers.get(to)
            if wi is None:
                raise RpcError(f"Unknown destination worker {to}: could not find "
                               f"destination id {to}")
            return wi
        if isinstance(to, float):  # a value of the right kind, wrong: torch's ValueError
            raise ValueError(f"'to' must be a worker name, rank or WorkerInfo; a rank is an int, "
                             f"got {to!r}")
        raise TypeError(f"'to' must be a worker name, rank or WorkerInfo, got {type(to).__name__}")

    # ------------------------------------------------------------- failures

    def fail(self, peer: int, exc: BaseException) -> None:
        """The pipe to ``peer`` broke, ``exc`` says how (the transport's
        report): recorded and passed to ``on_gone``, unless the peer left
        the group or failed already (the first cause is the one to tell:
        a pipe's later errors follow from it) -- but a peer failed as
        unreachable and now found gone is failed again."""
        if peer not in self.workers:
            return
        before = self._broken.get(peer)
        if before is not None and not (isinstance(before, UnreachableError)
                                       and not isinstance(exc, UnreachableError)):
            return
        self.failures += 1
        if isinstance(exc, UnreachableError):
            self._unreachable_since.setdefault(peer, time.monotonic())
        else:
            self._unreachable_since.pop(peer, None)
        self._gone(peer, exc)

    def restore(self, peer: int) -> None:
        """``peer``, failed as unreachable, has its pipe back: calls to it
        work again.  Any other failure stays."""
        if not isinstance(self._broken.get(peer), UnreachableError):
            return
        del self._broken[peer]
        since = self._unreachable_since.pop(peer, None)
        logger.warning("worker %s is reachable again%s", self.name_of(peer),
                       "" if since is None else f" after {time.monotonic() - since:.1f} s")

    def _gone(self, peer: int, exc: BaseException) -> None:
        self._broken[peer] = exc
        self._on_gone(peer, self.peer_error(peer))

    def is_broken(self, peer: int) -> bool:
        """Whether ``peer`` failed or left (and did not join again)."""
        return peer in self._broken

    def broken(self) -> set[int]:
        """The ids of the peers that failed or left."""
        return set(self._broken)

    def peer_error(self, peer: int) -> BaseException:
        """The error a call to the failed ``peer`` fails with, naming it;
        its type says how the peer went, and its ``__cause__`` is the
        report."""
        cause = self._broken.get(peer)
        who = f"worker {self.name_of(peer)} (id {peer})"
        err: RpcError
        if isinstance(cause, AuthenticationError):
            err = AuthenticationError(f"pipe to {who} refused: {cause}")
        elif isinstance(cause, PeerLeftError):
            err = PeerLeftError(f"{who} left the group")
        elif isinstance(cause, ClosedError):
            err = ClosedError(f"{who} is gone: {cause}")
        elif isinstance(cause, UnreachableError):
            err = UnreachableError(f"{who} is unreachable: {cause}; calls to it fail until "
                                   "its pipe is re-established, once its process answers "
                                   "again")
        else:  # gone for good (unreachable is said only of a peer that may be back)
            err = BrokenError(f"{who} failed: {cause}")
        err.__cause__ = cause
        return err

    # -------------------------------------------------------------- devices

    def cuda_targets(self, peer: int, pickled: Any, replying: bool = False) -> list[int] | None:
        """Where each of a message's buffers lands on ``peer`` (None: host
        only, :meth:`device_targets`), its CUDA buffers settled first
        (one stream query per device, a wait only where work is pending);
        replies travel the reverse of the caller's map.

        Raises:
            RpcError: a CUDA buffer with no device map to ``peer``.
        """
        if not pickled.cuda:
            return None
        sources = [b.get_device() for b in pickled.buffers]
        targets = self.device_targets(peer, sources, replying)
        devices.settle_indices({s for s in sources if s >= 0})
        return targets

    def device_targets(self, peer: int, sources: list[int], replying: bool = False) -> list[int]:
        """Where buffers on devices ``sources`` here (-1: host memory) land
        on ``peer``: -1 for host memory, else a CUDA index.  Which of the
        peer's devices one of ours lands on is decided once per peer,
        direction and device, not per message: a message costs a lookup per
        buffer.

        Raises:
            RpcError: a CUDA device with no device map entry to ``peer``
                (every time it is asked: nothing is remembered of a refusal).
        """
        table = self._targets_for(peer, replying)
        try:
            return [table[s] for s in sources]
        except KeyError:  # a device not yet seen for this peer: decided now, or refused
            return self._learn(peer, replying, table, sources)

    def _targets_for(self, peer: int, replying: bool) -> dict[int, int]:
        """Device index here -> target on ``peer`` (-1: host memory) so far
        learnt; kept while the map it was learnt from is the peer's map (a
        peer that joins again, or a job-wide check at join, replaces it)."""
        maps = self.reverse_device_maps if replying else self.device_maps
        current = maps.get(peer)
        key = (peer, replying)
        entry = self._target_cache.get(key)
        if entry is None or entry[0] is not current:
            entry = self._target_cache[key] = (current, {-1: -1})
        return entry[1]

    def _learn(self, peer: int, replying: bool, table: dict[int, int],
               sources: list[int]) -> list[int]:
        maps = self.reverse_device_maps if replying else self.device_maps
        unknown = sorted({s for s in sources if s not in table})
        found = devices.target_devices([torch.device("cuda", s) for s in unknown], maps.get(peer),
                                       self.name_of(peer), replying=replying)
        table.update(zip(unknown, found))
        return [table[s] for s in sources]
