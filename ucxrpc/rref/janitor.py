"""The thread that tells owners about user RRefs that died here."""

from __future__ import annotations

import gc
import logging
import queue
import threading
from typing import Any, Callable

from .. import _torch_futures
from .registry import ForkId, Registry, RRefId

__all__ = ["Janitor"]

logger = logging.getLogger(__name__)

#: ``(owner id, [(rref id, fork id), ...])`` → the call's future.
SendDeletions = Callable[[int, list[tuple[RRefId, ForkId]]], Any]
#: Queued by :meth:`Janitor.stop`: the thread's wait ends.
_STOP: Any = object()


class Janitor:
    """Batches the registry's deletions per owner and sends them, until the
    agent closes; :meth:`flush` sends what is queued and waits."""

    def __init__(self, reg: Registry, send: SendDeletions) -> None:
        self._reg = reg
        self._send = send
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ucxrpc-rref-{reg.me}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The agent closed: the thread ends (what is queued stays unsent:
        the owners can no longer be called)."""
        self._reg.deletions.put(_STOP)

    def _run(self) -> None:
        # Runs until the agent closes: a worker in its shutdown barrier still
        # serves calls, and RRefs those calls drop must still reach owners.
        # It waits without a timeout (stop() ends the wait): an idle worker
        # woken twice a second for nothing paid ~1 ms of CPU each time on a
        # slow VM (issue 50's idle bound, 2026-11-30).
        deletions = self._reg.deletions
        while True:
            item = deletions.get()
            if item is _STOP or self._reg.agent.closed:
                return
            batch: dict[int, list[tuple[RRefId, ForkId]]] = {}
            pending: tuple[int, RRefId, ForkId] | None = item
            while pending is not None:
                batch.setdefault(pending[0], []).append((pending[1], pending[2]))
                try:
                    pending = deletions.get_nowait()
                except queue.Empty:
                    pending = None
                if pending is _STOP:
                    self._send_batch(batch)
                    return
            self._send_batch(batch)

    def _send_batch(self, batch: dict[int, list[tuple[RRefId, ForkId]]]) -> list[Any]:
        futs = []
        for owner, items in batch.items():
            if owner == self._reg.me:
                self._reg.del_forks(items)
                continue
            try:
                futs.append(self._send(owner, items))
            except Exception as exc:  # owner gone: nothing left to free
                logger.debug("RRef deletions for worker %d not sent: %s", owner, exc)
        return futs

    def flush(self, timeout: float | None) -> None:
        """Before a graceful shutdown: tell owners about every dead user now."""
        gc.collect()
        batch: dict[int, list[tuple[RRefId, ForkId]]] = {}
        while True:
            try:
                item = self._reg.deletions.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:  # the thread's, not ours: left for it
                self._reg.deletions.put(_STOP)
                break
            batch.setdefault(item[0], []).append((item[1], item[2]))
        for fut in self._send_batch(batch):
            try:
                _torch_futures.result(fut)
            except Exception:  # owner died meanwhile
                pass
