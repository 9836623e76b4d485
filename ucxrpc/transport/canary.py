"""Is this worker's shared-memory receive queue still moving?

UCX's shared-memory transports deliver every local peer's messages through
one FIFO per receiving worker.  A sender takes a slot, copies its fragment
in, then marks the slot written; a sender killed between the two leaves a
slot that is never marked, and the receiver waits on it for good
(``uct_mm_ep_am_common_send`` in UCX's ``src/uct/sm/mm/base/mm_ep.c``).
From then on no peer on this host reaches this worker, and UCX reports
nothing.  A large transfer spends most of its time in that copy: a peer
killed while streaming to us left the queue stuck in 6 kills of 18
(benchmarks/shm_kill.py, docs/reliability.md).

The check: a second, private UCX worker in this process sends one message
to the main worker, through that same queue.  If it has not arrived after
:data:`WAIT_S` of progress, the queue is stuck.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .ucx import Endpoint, Request, Worker

#: Transports whose receive side is such a FIFO (cma and knem only copy
#: between address spaces; the FIFO that carries their requests is one of
#: these).
FIFO_TRANSPORTS = frozenset({"sysv", "posix", "xpmem"})
#: Seconds of progress a canary gets: its endpoint's wire-up and the message
#: take milliseconds when the queue moves.
WAIT_S = 2.0


def uses_fifo(lanes: Sequence[tuple[str, str]]) -> bool:
    """Whether an endpoint with these (transport, device) lanes sends through
    its peer's shared-memory FIFO."""
    return any(t in FIFO_TRANSPORTS for t, _ in lanes)


class Canary:
    """A private UCX worker that sends one-byte messages to ``address``."""

    def __init__(self, transports: Sequence[str] | None, address: bytes, tag: int) -> None:
        self._worker = Worker(transports)
        self._failed: BaseException | None = None
        self._ep = Endpoint(self._worker, address, self._on_error)
        self._tag = tag
        self._byte = np.zeros(1, dtype=np.uint8)
        self._sent: list[Request] = []

    def _on_error(self, exc: BaseException) -> None:
        self._failed = exc

    @property
    def failed(self) -> BaseException | None:
        """Why the canary's own endpoint failed, if it did: then its silence
        says nothing about the queue."""
        return self._failed

    def send(self) -> None:
        self._sent = [r for r in self._sent if not r.done]
        self._sent.append(self._ep.tag_send(self._byte, self._tag))

    def progress(self) -> None:
        self._worker.progress()

    def close(self) -> None:
        if self._failed is None:  # closing a failed endpoint crashed ucxx
            self._ep.close()
        self._worker.close()
