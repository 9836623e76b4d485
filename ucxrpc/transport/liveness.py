"""Whether peers live, and whether our shared-memory receive queue moves.

Two verdicts break pipes for good, neither from silence:

* a peer's lifeline (:mod:`.watch.lifeline`) is cut: its kernel closed the
  connection or refused a new one (the process ended).  A busy or stopped
  process's kernel keeps answering.
* our shared-memory receive queue is stuck (:mod:`.watch.canary`), after a peer
  died mid-copy into it: every pipe whose peer reaches us through it is
  broken for good.

One breaks a pipe for now: the peer's host stopped answering TCP keepalive
(a partition, a host gone silent): the lifeline is *lost*, and its pipe
breaks with an :class:`~ucxrpc.errors.UnreachableError`.  Once the same
process answers again (``back``), the transport re-establishes the pipe.

A lifeline outlives the pipes of one peer process (it is keyed by the
peer's id and address): each generation of the pipe reports through it.
The lifeline thread and the loop both call ``fail``; the transport breaks a
pipe once, whichever comes first, and a later verdict of death overrides
an earlier one of unreachability.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from ..errors import BrokenError, UnreachableError
from .watch import canary
from .watch.lifeline import Lifelines, LineState
from .pipe import Pipe
from .wire.tags import CANARY, kind_base
from .ucx.binding import Worker

__all__ = ["Liveness"]

#: The lifeline states in which a peer may be alive and the line will tell
#: when it answers (:meth:`Liveness.alive`).
_ANSWERING = frozenset({LineState.UP, LineState.LOST, LineState.CHECKING})

logger = logging.getLogger(__name__)


class Liveness:
    """Lifelines to every peer and the check of our receive queue.

    Args:
        worker, transports, my_id: the transport's (the canary sends to
            ``worker`` through the same queue its peers use).
        host_timeout: seconds a peer's host may leave keepalive unanswered.
        pipes: the transport's pipes (the current one of a peer is the one
            a verdict is about; all are read when the queue is found stuck).
        fail: ``(pipe, error, orderly, final)`` breaks a pipe (any thread);
            ``final``: the peer is gone for good.
        back: ``(pipe)`` the peer's process answered again (on the
            lifeline thread): its pipe may be re-established.
    """

    def __init__(self, *, worker: Worker, transports: Sequence[str] | None, my_id: int,
                 host_timeout: float, pipes: Mapping[int, Pipe],
                 fail: Callable[[Pipe, BaseException, bool, bool], None],
                 back: Callable[[Pipe], None] = lambda pipe: None) -> None:
        self._pipes = pipes
        self._fail = fail
        self._back = back
        self._closing = False
        self._lifelines = Lifelines(host_timeout)
        #: What peers need to watch this process's lifeline (published).
        self.address = self._lifelines.address.encode()
        #: The check of our shared-memory receive queue; while its
        #: ``waiting`` holds, the loop's turns :meth:`poll` for its canary.
        self.queue_check = canary.QueueCheck(
            worker, transports, kind_base(CANARY, my_id), self._queue_stuck)

    def start(self) -> None:
        self._lifelines.start()

    # ------------------------------------------------------------ lifelines

    @staticmethod
    def _key(pipe: Pipe) -> tuple[int, bytes]:
        """A lifeline is one peer process's: its id and UCX address."""
        return pipe.peer_id, pipe.address

    def watch(self, pipe: Pipe) -> None:
        """Connect ``pipe``'s lifeline, once per peer process (any thread)."""
        if pipe.lifeline is None or pipe.watched or self._closing:
            return
        pipe.watched = True
        key = self._key(pipe)
        try:
            self._lifelines.watch(key, pipe.name, pipe.lifeline,
                                  functools.partial(self._cut, key),
                                  on_lost=functools.partial(self._lost, key),
                                  on_back=functools.partial(self._came_back, key))
        except ValueError as exc:
            logger.warning("no lifeline to %s: %s", pipe.name, exc)

    def forget(self, pipe: Pipe) -> None:
        """``pipe``'s peer process is replaced (its worker came back elsewhere)."""
        self._lifelines.forget(self._key(pipe))

    def verify(self, pipe: Pipe) -> None:
        """``pipe`` failed while its lifeline held: ask the peer's port again
        (``back`` if the same process answers; backs off when repeated)."""
        if pipe.lifeline is not None:
            self._lifelines.verify(self._key(pipe))

    def alive(self, pipe: Pipe) -> bool:
        """Whether ``pipe``'s peer process may still live and its lifeline
        will say when it answers again: connected, or lost behind a silent
        host, or being asked after a reset.  Not cut; and not without a
        lifeline, or with one still connecting (it may end without one:
        then nothing would ever say the peer is back)."""
        if pipe.lifeline is None:
            return False
        return self._lifelines.state(self._key(pipe)) in _ANSWERING

    def gone(self, pipe: Pipe) -> tuple[str, bool] | None:
        """(reason, orderly) if ``pipe``'s lifeline already says its peer
        is gone, read at once (:meth:`.watch.lifeline.Lifelines.gone`)."""
        return None if pipe.lifeline is None else self._lifelines.gone(self._key(pipe))

    def state(self, pipe: Pipe) -> str:
        """``pipe``'s lifeline, in words (for ``pipe_info``)."""
        if pipe.lifeline is None:
            return LineState.NONE.value
        state = self._lifelines.state(self._key(pipe))
        return "not connected" if state is None else state.value

    def _current(self, key: tuple[int, bytes]) -> Pipe | None:
        pipe = self._pipes.get(key[0])
        return pipe if pipe is not None and pipe.address == key[1] else None

    # On the lifeline thread, not the progress thread: the verdict must not
    # wait for a loop that may itself be held up.

    def _cut(self, key: tuple[int, bytes], reason: str, orderly: bool) -> None:
        pipe = self._current(key)
        if pipe is not None:
            self._fail(pipe, BrokenError(reason), orderly, True)

    def _lost(self, key: tuple[int, bytes], reason: str) -> None:
        pipe = self._current(key)
        if pipe is not None:
            self._fail(pipe, UnreachableError(reason), False, False)

    def _came_back(self, key: tuple[int, bytes]) -> None:
        pipe = self._current(key)
        if pipe is not None:
            self._back(pipe)

    # --------------------------------------------------------- the queue

    @property
    def stuck(self) -> str | None:
        """Why our receive queue is stuck, or None."""
        return self.queue_check.stuck

    def poll(self) -> bool:
        """Look for the canary while a check waits for it (on the loop);
        whether one does (the loop keeps turning until it comes)."""
        if not self.queue_check.waiting:
            return False
        self.queue_check.poll()
        return True

    def check_queue(self, cause: str) -> None:
        """A peer may have died mid-copy into our queue: check it (on the loop)."""
        if not self._closing:
            self.queue_check.start(cause)

    def excuse_stall(self, seconds: float, now: float) -> None:
        """Move the canary's clock on by ``seconds`` we were not listening,
        so a stall of ours is not taken for a stuck receive queue."""
        log = logger.warning if seconds > canary.WAIT_S / 2 else logger.debug
        log("progress thread stalled for %.1f s (machine overloaded, or the GIL or a "
            "callback held it)", seconds)
        self.queue_check.excuse(seconds, now)

    def _queue_stuck(self, reason: str) -> None:
        for pipe in list(self._pipes.values()):
            if pipe.fifo:  # open, or still waiting for its handshake's answer
                self._fail(pipe, BrokenError(reason), False, True)

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
        self.queue_check.close()

    def stats(self) -> dict[str, object]:
        return {"fifo_checks": self.queue_check.checks, "fifo_stuck": self.queue_check.stuck,
                "lifeline_cuts": self._lifelines.cuts, "lifelines_lost": self._lifelines.losses,
                "lifelines_back": self._lifelines.returns}
