"""When the progress loop may poll an idle worker, and when it must sleep.

Between two turns of the loop (:mod:`.progress`), whoever turns it either
polls again or sleeps in epoll; the *strategy* has the last word:

* :class:`Blocking` never polls an idle worker: it arms it and sleeps in
  epoll, woken by UCX (a message, a rendezvous step) or by
  :meth:`.progress.ProgressThread.wake`.
  No CPU while waiting; every wake-up costs a context switch (tens to
  hundreds of µs on a VM).
* :class:`Polling` polls while a message is expected (data in flight, or a
  reply or request due within ``spin_s``), yielding the CPU each idle turn,
  then sleeps as :class:`Blocking` does.  Fastest on a quiet host; on a busy
  one the polling thread takes the core the peer or the user's own threads
  need, and every hand-off waits for a scheduler slice (measured: a 16 KiB
  call took 4 ms instead of 0.2, benchmarks/runs/E.md/F).
* :class:`Adaptive` (the default) polls as :class:`Polling` does while the
  thread has a core to itself, and blocks as soon as it has not: each idle
  turn yields the CPU and times the yield, and yields that come back late
  (a few in a window) mean another thread or process is waiting for this
  core (or for our GIL).  It then blocks for a back-off that doubles while
  the contention lasts, and tries polling again after it.

:class:`Why` names every reason a turn polls or sleeps, the strategies'
refusals among them; :meth:`.progress.ProgressThread.decide` gives one per
turn.  A strategy is a few counters that any turner consults and knows
nothing of who turns the loop, so it lives apart from the thread that does.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..._states import StateEnum

__all__ = ["POLLS", "Adaptive", "Blocking", "Mode", "Polling", "Strategy", "Why", "mode_of",
           "strategy"]

#: A yield longer than this means another runnable thread held this core (or
#: our GIL) for about a scheduler slice: a free core returns from
#: ``sched_yield`` in a microsecond, and our own threads' Python between two
#: calls (tens of µs) stays far below it (at 250 µs, that work alone counted
#: as contention and a quiet host's latency doubled).
CONTENDED_YIELD_S = 1e-3
#: Contention: this many late yields within a window of that many.
LATE_YIELDS = 4
YIELD_WINDOW = 32
#: The first back-off after contention is seen, and the longest.
BACKOFF_S = 0.02
MAX_BACKOFF_S = 0.2


class Mode(StateEnum):
    """The progress strategies, by the name ``progress=`` takes."""

    ADAPTIVE = "adaptive"
    POLLING = "polling"
    BLOCKING = "blocking"


class Why(StateEnum):
    """Why a turn of the loop polls, or why it sleeps in epoll instead
    (:meth:`.progress.ProgressThread.decide`).  The first two poll."""

    IN_FLIGHT = "data in flight"
    AWAITED = "a reply or request is due"
    QUIET = "nothing came for spin_s"
    CONTENDED = "another thread or process wants this core (adaptive back-off)"
    BLOCKING = "the blocking mode never polls"
    COMPUTING = "a pool thread runs user code (polling would take its GIL)"
    PEER_COPYING = "a peer copies our memory in two halves on two cores"
    NOTHING_DUE = "no call in flight and no peer calling lately"


#: The reasons that poll; the rest sleep in epoll.
POLLS = frozenset({Why.IN_FLIGHT, Why.AWAITED})


class Strategy:
    """When the loop may poll an idle worker instead of sleeping.

    Called by the thread that turns the loop: the progress thread, or a
    thread driving it (their calls may overlap for a turn; the state is a
    few counters, and a lost update only shifts a back-off).
    """

    mode: Mode
    #: What :meth:`may_poll` saying no means.
    refusal = Why.CONTENDED

    #: Until when (``time.monotonic()``) polling is refused: a plain
    #: attribute, which the loop and every frame sent read without a call
    #: (issue 52).  Never for the polling strategy, always for the blocking
    #: one, a back-off's end for the adaptive one.
    blocked_until = -math.inf

    def may_poll(self, now: float) -> bool:
        """Whether to poll the next turn, given that a message is expected."""
        return now >= self.blocked_until

    #: A yield longer than this is one to report (:meth:`spun`): the
    #: native spin returns on it.  Only the adaptive strategy has one.
    late_s = float("inf")

    def yielded(self, now: float, took: float) -> None:
        """The loop gave up the CPU between two polls, for ``took`` seconds."""

    def spun(self, now: float, quick: int, late: float) -> None:
        """The native spin (csrc/loop.c's ``spun``) gave up
        the CPU ``quick`` times promptly, then, if ``late``, once for
        ``late`` seconds: as many :meth:`yielded` calls, in one.  Not
        called for a spin that yielded neither way (nothing to count)."""
        if late:
            self.yielded(now, late)

    def info(self) -> dict[str, Any]:
        return {"mode": self.mode.value}


class Blocking(Strategy):
    mode = Mode.BLOCKING
    refusal = Why.BLOCKING
    blocked_until = math.inf


class Polling(Strategy):
    mode = Mode.POLLING


class Adaptive(Strategy):
    """Polls while yields come back promptly; blocks once :data:`LATE_YIELDS`
    of a window of :data:`YIELD_WINDOW` came back late.

    One late yield proves little (a garbage collection, the hypervisor taking
    the vCPU for a moment); a core shared with another runnable thread makes
    nearly every yield late, so a few in a window is the signal.  Measured
    here: a single late yield as the signal left the loop blocking for good
    after a burst of 30,000 rpc_async calls, doubling a quiet host's latency.
    """

    mode = Mode.ADAPTIVE

    def __init__(self, contended_s: float = CONTENDED_YIELD_S, backoff_s: float = BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, late: int = LATE_YIELDS,
                 window: int = YIELD_WINDOW) -> None:
        self._contended_s = contended_s
        self._first = backoff_s
        self._max = max_backoff_s
        self._backoff = backoff_s
        self._need = late
        self._window = window
        self.late_s = contended_s
        self._seen = 0  # yields in the current window
        self._late = 0  # late ones among them
        self.blocked_until = 0.0
        self.contended = 0  # times contention was seen

    def yielded(self, now: float, took: float) -> None:
        self._seen += 1
        if took > self._contended_s:
            self._late += 1
            if self._late >= self._need:
                self._block(now)
                return
        if self._seen >= self._window:
            self._seen = self._late = 0

    def spun(self, now: float, quick: int, late: float) -> None:
        # The prompt yields only move the window on (as yielded() would,
        # one by one: a window ends every _window yields, late or not).
        self._seen += quick
        if self._seen >= self._window:
            self._seen = self._late = 0
        if late:
            self.yielded(now, late)

    def _block(self, now: float) -> None:
        self.contended += 1
        self._seen = self._late = 0
        # Contention again soon after the last back-off: it lasts, so the
        # probing (a few lost slices each time) becomes rarer.
        recent = now - self.blocked_until < self._backoff
        self._backoff = min(self._backoff * 2, self._max) if recent else self._first
        self.blocked_until = now + self._backoff

    def info(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "contended": self.contended,
                "blocking_for_s": round(max(0.0, self.blocked_until - time.monotonic()), 3)}


def mode_of(name: Mode | str) -> Mode:
    """The :class:`Mode` named ``name``.

    Raises:
        ValueError: no such mode, with the names there are.
    """
    try:
        return Mode(name)
    except ValueError:
        names = ", ".join(repr(m.value) for m in Mode)
        raise ValueError(f"unknown progress mode {name!r}: expected one of {names}") from None


def strategy(mode: Mode | str) -> Strategy:
    """A new strategy object for ``mode`` (a :class:`Mode` or its name)."""
    return {Mode.ADAPTIVE: Adaptive, Mode.POLLING: Polling,
            Mode.BLOCKING: Blocking}[mode_of(mode)]()
