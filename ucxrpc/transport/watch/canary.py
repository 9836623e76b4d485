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

import logging
import time
from typing import Callable, Sequence

import numpy as np

from ..._states import StateEnum
from ..ucx.ucp import FULL_MASK
from ..ucx.binding import Endpoint, Request, Worker

logger = logging.getLogger(__name__)

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


class CheckState(StateEnum):
    IDLE = "idle"            # no check running (none needed, or the last one passed)
    WAITING = "waiting"      # a canary is on its way; its arrival proves the queue moves
    STUCK = "stuck"          # it did not arrive: final, no local peer can reach us
    UNAVAILABLE = "unavailable"  # the canary's own endpoint failed: no check can run


#: The check's moves (:meth:`QueueCheck._move` checks each).  STUCK and
#: UNAVAILABLE are final: no check runs after them.
_MOVES: dict[CheckState, frozenset[CheckState]] = {
    CheckState.IDLE: frozenset({CheckState.WAITING, CheckState.UNAVAILABLE}),
    CheckState.WAITING: frozenset({CheckState.IDLE, CheckState.STUCK, CheckState.UNAVAILABLE}),
    CheckState.STUCK: frozenset(),
    CheckState.UNAVAILABLE: frozenset(),
}


class QueueCheck:
    """The check for one worker, run from its progress loop.

    :meth:`start` after a peer that may have been copying into our queue
    failed; :meth:`poll` every turn while :attr:`state` is WAITING.  When
    the canary does not arrive in :data:`WAIT_S` of listening,
    ``on_stuck(reason)`` is called once and the state stays STUCK.

    Args:
        worker: the main worker, whose queue is checked.
        transports: as the main worker's (the canary must take the same path).
        tag: the canary's tag on the main worker.
    """

    def __init__(self, worker: Worker, transports: Sequence[str] | None, tag: int,
                 on_stuck: Callable[[str], None]) -> None:
        self._worker = worker
        self._transports = transports
        self._tag = tag
        self._on_stuck = on_stuck
        self._canary: Canary | None = None
        self._rx: list[Request] = []
        self.state = CheckState.IDLE
        #: state is WAITING, kept by _move: a plain attribute, as the loop
        #: tests it every turn (issue 52).
        self.waiting = False
        self._since = 0.0  # when the canary went out
        self._cause = ""
        self.stuck: str | None = None  # why no local peer can reach us, once so
        self.checks = 0

    def _move(self, to: CheckState) -> None:
        """The one place the check's state changes, as :data:`_MOVES` allows."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"queue check: no move from {self.state.value} to {to.value}")
        self.state = to
        self.waiting = to is CheckState.WAITING

    def start(self, cause: str) -> None:
        """Send a canary because ``cause`` failed; no-op unless IDLE."""
        if self.state is not CheckState.IDLE:
            return
        if self._canary is not None and self._canary.failed is not None:
            self._move(CheckState.UNAVAILABLE)
            return
        try:
            if self._canary is None:
                self._canary = Canary(self._transports, self._worker.address, self._tag)
            self._canary.send()
        except Exception:  # a check that cannot run must not hurt the pipes
            logger.exception("cannot check the shared-memory receive queue")
            return
        self._move(CheckState.WAITING)
        self._since = time.monotonic()
        self._cause = cause
        self.checks += 1

    def excuse(self, seconds: float, now: float) -> None:
        """Move the clock on by ``seconds`` the loop was not listening: a
        stall of ours is not a stuck queue."""
        if self.state is CheckState.WAITING:
            self._since = min(now, self._since + seconds)

    def poll(self) -> None:
        """Look for the canary (WAITING only)."""
        if self.state is not CheckState.WAITING:
            return
        assert self._canary is not None
        self._canary.progress()
        self._rx = [r for r in self._rx if not r.done]
        probe = self._worker.probe(self._tag, FULL_MASK)
        if probe is not None:
            self._rx.append(self._worker.recv_probed(np.empty(1, dtype=np.uint8), probe))
            self._move(CheckState.IDLE)
            logger.debug("shared-memory receive queue still moves after %s failed", self._cause)
        elif self._canary.failed is not None:
            logger.warning("cannot check the shared-memory receive queue: %s",
                           self._canary.failed)
            self._move(CheckState.UNAVAILABLE)
        elif time.monotonic() - self._since > WAIT_S:
            self._move(CheckState.STUCK)
            self.stuck = (
                f"this worker's UCX shared-memory receive queue is stuck since {self._cause} "
                "failed (a process killed while copying a message into it leaves a slot UCX "
                "waits on for good), so no peer on this host can reach this worker any more; "
                "restart it, or keep local traffic off shared memory with transports=['tcp'] "
                "where a job must outlive killed peers")
            logger.error("%s", self.stuck)
            self._on_stuck(self.stuck)

    def close(self) -> None:
        if self._canary is not None:
            self._canary.close()
