"""Whether peers live, and whether our shared-memory receive queue moves.

Two verdicts break pipes, neither from silence:

* a peer's lifeline (:mod:`.watch.lifeline`) is cut: its kernel closed the
  connection (the process ended) or stopped answering TCP keepalive (the
  host vanished).  A busy or stopped process's kernel keeps answering.
* our shared-memory receive queue is stuck (:mod:`.watch.canary`), after a peer
  died mid-copy into it: every pipe whose peer reaches us through it is
  broken for good.

The lifeline thread and the loop both call ``fail``; the transport breaks a
pipe once, whichever comes first.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from ..errors import BrokenError
from .watch import canary
from .watch.lifeline import Lifelines, LineState
from .pipe import Pipe
from .wire.tags import CANARY, kind_base
from .ucx.binding import Worker

__all__ = ["Liveness"]

logger = logging.getLogger(__name__)


class Liveness:
    """Lifelines to every peer and the check of our receive queue.

    Args:
        worker, transports, my_id: the transport's (the canary sends to
            ``worker`` through the same queue its peers use).
        host_timeout: seconds a peer's host may leave keepalive unanswered.
        pipes: the transport's pipes (read when the queue is found stuck).
        fail: ``(pipe, error, orderly)`` breaks a pipe (any thread).
    """

    def __init__(self, *, worker: Worker, transports: Sequence[str] | None, my_id: int,
                 host_timeout: float, pipes: Mapping[int, Pipe],
                 fail: Callable[[Pipe, BaseException, bool], None]) -> None:
        self._pipes = pipes
        self._fail = fail
        self._closing = False
        self._lifelines = Lifelines(host_timeout)
        #: What peers need to watch this process's lifeline (published).
        self.address = self._lifelines.address.encode()
        self._queue = canary.QueueCheck(worker, transports, kind_base(CANARY, my_id),
                                        self._queue_stuck)

    def start(self) -> None:
        self._lifelines.start()

    # ------------------------------------------------------------ lifelines

    def watch(self, pipe: Pipe) -> None:
        """Connect ``pipe``'s lifeline, once (any thread)."""
        if pipe.lifeline is None or pipe.watched or self._closing:
            return
        pipe.watched = True
        try:
            self._lifelines.watch(pipe, pipe.name, pipe.lifeline,
                                  functools.partial(self._cut, pipe))
        except ValueError as exc:
            logger.warning("no lifeline to %s: %s", pipe.name, exc)

    def forget(self, pipe: Pipe) -> None:
        """``pipe`` was replaced (its worker came back elsewhere)."""
        self._lifelines.forget(pipe)

    def state(self, pipe: Pipe) -> str:
        """``pipe``'s lifeline, in words (for ``pipe_info``)."""
        if pipe.lifeline is None:
            return LineState.NONE.value
        state = self._lifelines.state(pipe)
        return "not connected" if state is None else state.value

    def _cut(self, pipe: Pipe, reason: str, orderly: bool) -> None:
        # On the lifeline thread, not the progress thread: the verdict must
        # not wait for a loop that may itself be held up.
        self._fail(pipe, BrokenError(reason), orderly)

    # --------------------------------------------------------- the queue

    @property
    def stuck(self) -> str | None:
        """Why our receive queue is stuck, or None."""
        return self._queue.stuck

    def poll(self) -> bool:
        """Look for the canary while a check waits for it (on the loop);
        whether one does (the loop keeps turning until it comes)."""
        if self._queue.state is not canary.CheckState.WAITING:
            return False
        self._queue.poll()
        return True

    def check_queue(self, cause: str) -> None:
        """A peer may have died mid-copy into our queue: check it (on the loop)."""
        if not self._closing:
            self._queue.start(cause)

    def excuse_stall(self, seconds: float, now: float) -> None:
        """Move the canary's clock on by ``seconds`` we were not listening,
        so a stall of ours is not taken for a stuck receive queue."""
        log = logger.warning if seconds > canary.WAIT_S / 2 else logger.debug
        log("progress thread stalled for %.1f s (machine overloaded, or the GIL or a "
            "callback held it)", seconds)
        self._queue.excuse(seconds, now)

    def _queue_stuck(self, reason: str) -> None:
        for pipe in list(self._pipes.values()):
            if pipe.fifo:  # open, or still waiting for its handshake's answer
                self._fail(pipe, BrokenError(reason), False)

    # ------------------------------------------------------------ closing

    def begin_close(self) -> None:
        """The transport closes: no new lifelines, no new checks."""
        self._closing = True

    def close_lifelines(self) -> None:
        """Peers watching this process's lifeline are told it shut down
        (after the last replies went out: they then fail what they still
        wait for from us)."""
        self._lifelines.close()

    def close(self) -> None:
        self._closing = True
        self._queue.close()

    def stats(self) -> dict[str, object]:
        return {"fifo_checks": self._queue.checks, "fifo_stuck": self._queue.stuck,
                "lifeline_cuts": self._lifelines.cuts}
