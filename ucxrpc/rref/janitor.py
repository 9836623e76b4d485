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

    def _run(self) -> None:
        # Runs until the agent closes: a worker in its shutdown barrier still
        # serves calls, and RRefs those calls drop must still reach owners.
        deletions = self._reg.deletions
        while not self._reg.agent.closed:
            try:
                item = deletions.get(timeout=0.5)
            except queue.Empty:
                continue
            batch: dict[int, list[tuple[RRefId, ForkId]]] = {}
            pending: tuple[int, RRefId, ForkId] | None = item
            while pending is not None:
                batch.setdefault(pending[0], []).append((pending[1], pending[2]))
                try:
                    pending = deletions.get_nowait()
                except queue.Empty:
                    pending = None
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
            batch.setdefault(item[0], []).append((item[1], item[2]))
        for fut in self._send_batch(batch):
            try:
                _torch_futures.result(fut)
            except Exception:  # owner died meanwhile
                pass
