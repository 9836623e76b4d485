"""Rendezvous and membership through torch's c10d stores.

Workers publish ``(name, worker address, host, pid)`` under their rank,
read everyone else's, and share the job secret.  ``env://``, ``tcp://`` and
``file://`` come from ``torch.distributed.rendezvous`` unchanged, so
torchrun's variables work as they do for torch's RPC.

Dynamic membership (``world_size=None``) keeps the ranks present in one
store key, changed only under a lock taken with ``compare_set``, so joins
and leaves happen one at a time, as in torch.  A job is static or dynamic:
the first worker claims the mode and a worker of the other kind is refused.

A static job may be initialised again after a shutdown, on the same store
address, by the same processes or new ones.  Rank 0 leaves the store last:
it removes the job's keys (:func:`clear`), for a store that outlives the job
(torchrun's agent store, a file), and lets go of a server it hosts, before
it says goodbye; the other workers' shutdown waits for that goodbye, so no
worker starts its next job on the last one's keys or server.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable

import torch.distributed as dist

from ..transport import Peer
from ..errors import AuthenticationError, RpcError, RpcTimeoutError

logger = logging.getLogger(__name__)

PREFIX = "ucxrpc/"
#: The barriers of a static job (their keys are cleared with it).
BARRIERS = ("init", "shutdown", "shutdown-done")


@dataclass(frozen=True)
class Member:
    """What a worker publishes at init: who and where it is, and its devices
    (device counts, ``devices`` and maps, as strings) so that every worker can
    check everyone's device maps."""

    rank: int
    name: str
    address: bytes
    host: str
    pid: int
    device_count: int = 0
    devices: tuple[str, ...] = ()
    device_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    cuda_direct: bool = False  # its UCX takes device memory (else: staged)
    max_frame_bytes: int = 1 << 30  # its limit: senders check it first
    lifeline: str | None = None  # where the kernel watches it for us (transport/watch/lifeline.py)
    cma: str | None = None  # how a peer on its host may read it by address (transport/hostmem/cma.py)
    tcp_segment: int | None = None  # its UCX TCP fragment size: every worker's must be one

    def peer(self) -> Peer:
        """What the transport needs of this record to reach the worker."""
        return Peer(self.rank, self.name, self.address, self.cuda_direct, self.max_frame_bytes,
                    self.lifeline, self.pid, self.cma, self.tcp_segment)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "name": self.name, "address": self.address.hex(),
                           "host": self.host, "pid": self.pid,
                           "device_count": self.device_count, "devices": list(self.devices),
                           "device_maps": self.device_maps, "cuda_direct": self.cuda_direct,
                           "max_frame_bytes": self.max_frame_bytes, "lifeline": self.lifeline,
                           "cma": self.cma, "tcp_segment": self.tcp_segment})

    @staticmethod
    def from_json(raw: bytes) -> "Member":
        d = json.loads(raw)
        maps = {str(to): {str(k): str(v) for k, v in m.items()}
                for to, m in dict(d.get("device_maps", {})).items()}
        return Member(int(d["rank"]), str(d["name"]), bytes.fromhex(d["address"]),
                      str(d["host"]), int(d["pid"]), int(d.get("device_count", 0)),
                      tuple(str(x) for x in d.get("devices", ())), maps,
                      bool(d.get("cuda_direct", False)),
                      int(d.get("max_frame_bytes", 1 << 30)),
                      None if d.get("lifeline") is None else str(d["lifeline"]),
                      None if d.get("cma") is None else str(d["cma"]),
                      None if d.get("tcp_segment") is None else int(d["tcp_segment"]))


# c10d stores need a finite timeout; this one stands for "no limit" (the
# job's own timeout, None, waits as long as the job runs).
_STORE_NO_LIMIT = timedelta(days=30)


def _store_timeout(timeout: float | None) -> timedelta:
    return _STORE_NO_LIMIT if timeout is None else timedelta(seconds=timeout)


def open_store(init_method: str, rank: int, world_size: int,
               timeout: float | None) -> tuple[Any, int, int]:
    """A c10d store from ``init_method``; returns (store, rank, world_size).
    ``timeout``: for each store operation (None: no limit)."""
    td = _store_timeout(timeout)
    store, rank, world_size = next(dist.rendezvous(init_method, rank=rank,
                                                   world_size=world_size, timeout=td))
    store.set_timeout(td)
    return store, rank, world_size


def clear(store: Any, world_size: int) -> None:
    """Remove a finished static job's keys, so that a store which outlives
    it serves the next job clean (its members' addresses and its barriers
    are not read as the next job's)."""
    keys = [PREFIX + "secret", PREFIX + "mode"]
    keys += [f"{PREFIX}member/{r}" for r in range(world_size)]
    keys += [f"{PREFIX}{b}/{r}" for b in BARRIERS for r in range(world_size)]
    for key in keys:
        store.delete_key(key)


def open_dynamic_store(init_method: str, rank: int, timeout: float | None) -> Any:
    """The store of a dynamic group: torch's own choice for ``init_method``
    (a TCPStore hosted by rank 0 for ``env://`` and ``tcp://``)."""
    if rank < 0:
        # torch's words first (its rendezvous handlers say this), then ours.
        said = ("environment variable RANK expected" if init_method.startswith("env://")
                else "rank parameter missing")
        raise ValueError(f"{said}: dynamic membership (world_size=None) needs an explicit rank")

    try:  # torch's helper reads only the options' init_method
        store = dist._create_store_from_options(SimpleNamespace(init_method=init_method), rank)
    except RuntimeError as exc:
        if rank == 0 and "EADDRINUSE" in str(exc):
            raise RpcError(f"rank 0 hosts the group's store at {init_method}, but that address "
                           f"is in use: is a rank 0 already running? ({exc})") from exc
        raise
    store.set_timeout(_store_timeout(timeout))
    return store


def claim_mode(store: Any, mode: str) -> None:
    """Record the job's mode ("static" or "dynamic"), or check it matches."""
    key = PREFIX + "mode"
    current = store.compare_set(key, "", mode).decode()
    if current != mode:
        raise RpcError(f"RPC group mixes statically and dynamically initialized members "
                       f"which is not supported: this job's workers joined with "
                       f"{'world_size=None' if current == 'dynamic' else 'a world_size'}; "
                       f"a worker cannot join it "
                       f"{'with world_size=None' if mode == 'dynamic' else 'with a world_size'}"
                       " (static and dynamic membership do not mix)")


class GroupLock:
    """The lock that serializes joins and leaves of a dynamic group."""

    KEY = PREFIX + "group/lock"

    def __init__(self, store: Any, token: str, timeout: float | None) -> None:
        self.store = store
        self.token = token
        self.timeout = timeout or float("inf")  # 0 and None: no limit

    def __enter__(self) -> "GroupLock":
        deadline = time.monotonic() + self.timeout
        while self.store.compare_set(self.KEY, "", self.token).decode() != self.token:
            if time.monotonic() > deadline:
                holder = self.store.get(self.KEY).decode()
                raise RpcTimeoutError(f"timed out after {self.timeout:g} s waiting for the "
                                      f"group lock, held by {holder}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.store.compare_set(self.KEY, self.token, "")


def group_ranks(store: Any) -> list[int]:
    key = PREFIX + "group/ranks"
    if not store.check([key]):
        return []
    return [int(r) for r in json.loads(store.get(key))]


def set_group_ranks(store: Any, ranks: list[int]) -> None:
    store.set(PREFIX + "group/ranks", json.dumps(sorted(set(ranks))))


def member(store: Any, rank: int) -> Member:
    return Member.from_json(store.get(f"{PREFIX}member/{rank}"))


def find_member(store: Any, rank: int) -> Member | None:
    """The record rank ``rank`` published, if any; never waits."""
    key = f"{PREFIX}member/{rank}"
    return Member.from_json(store.get(key)) if store.check([key]) else None


def job_secret(store: Any, rank: int) -> bytes:
    """``UCXRPC_AUTH_TOKEN``, or a random secret rank 0 shares via the store."""
    token = os.environ.get("UCXRPC_AUTH_TOKEN")
    if token:
        return token.encode()
    if rank == 0:
        store.set(PREFIX + "secret", os.urandom(32).hex())
    try:
        return bytes.fromhex(store.get(PREFIX + "secret").decode())
    except ValueError as exc:
        raise AuthenticationError("the job secret in the store is malformed") from exc


def publish(store: Any, rank: int, name: str, address: bytes, device_count: int = 0,
            devices: tuple[str, ...] = (),
            device_maps: dict[str, dict[str, str]] | None = None,
            cuda_direct: bool = False, max_frame_bytes: int = 1 << 30,
            lifeline: str | None = None, cma: str | None = None,
            tcp_segment: int | None = None) -> Member:
    me = Member(rank, name, address, socket.gethostname(), os.getpid(), device_count,
                devices, dict(device_maps or {}), cuda_direct, max_frame_bytes, lifeline, cma,
                tcp_segment)
    store.set(f"{PREFIX}member/{rank}", me.to_json())
    return me


def collect(store: Any, world_size: int) -> dict[int, Member]:
    """Every member's record, waiting for late ones up to the store timeout."""
    members: dict[int, Member] = {}
    for r in range(world_size):
        members[r] = Member.from_json(store.get(f"{PREFIX}member/{r}"))
    names: dict[str, int] = {}
    for m in members.values():
        if m.name in names:
            raise RpcError(f"worker name {m.name!r} is not unique: it is used by ranks "
                           f"{names[m.name]} and {m.rank}")
        names[m.name] = m.rank
    return members


def arrive(store: Any, key: str, rank: int) -> None:
    """Say rank ``rank`` reached barrier ``key`` (without waiting there)."""
    store.set(f"{PREFIX}{key}/{rank}", "1")


#: How a barrier polls the store: every 10 ms at first, then at a tenth of
#: the time it has waited, up to every 200 ms.
_FIRST_POLL_S = 0.01
_POLL_FRACTION = 0.1
_LONGEST_POLL_S = 0.2


def barrier(store: Any, key: str, rank: int, world_size: int, timeout: float | None,
            gone: Callable[[], set[int]] = set, poke: Callable[[int], None] | None = None) -> None:
    """Wait until every rank reached ``key``, or is known to be gone.

    Ranks in ``gone()`` (dead peers) are not waited for; ``poke(rank)`` is
    called for missing ranks at once and then once a second, so that a dead
    peer is noticed.
    ``timeout``: seconds, None for no limit.

    Raises:
        RpcTimeoutError: some live rank did not arrive within ``timeout``.
    """
    arrive(store, key, rank)
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    missing = set(range(world_size))
    start = next_poke = time.monotonic()  # at once: a dead rank is found in milliseconds
    while True:
        keys = [f"{PREFIX}{key}/{r}" for r in sorted(missing)]
        if keys and store.check(keys):
            return
        for r in list(missing):
            if store.check([f"{PREFIX}{key}/{r}"]):
                missing.discard(r)
        missing -= gone()
        if not missing:
            return
        now = time.monotonic()
        if now > deadline:
            raise RpcTimeoutError(f"barrier {key!r} timed out waiting for ranks {sorted(missing)}")
        if poke is not None and now > next_poke:
            for r in missing:
                poke(r)
            next_poke = now + 1.0
        # Polled, more rarely the longer it lasts: an arrival is seen within
        # a tenth of the time waited so far (at least 10 ms, at most 200).
        # A worker waiting here is often a server that called shutdown() at
        # once and waits for the whole job; polling it every 10 ms cost it
        # 4.8% of a core, and rank 0, whose store answers, 1.1%.  (A store's
        # own wait would not poll, but c10d logs a warning each time one
        # runs out, and a slice must run out for a dead rank to be seen.)
        time.sleep(min(_LONGEST_POLL_S, max(_FIRST_POLL_S, (now - start) * _POLL_FRACTION)))
