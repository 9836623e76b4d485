"""The progress thread: who turns the loop that makes UCX move, and how it waits.

UCX moves bytes and completes requests only inside ``worker.progress()``.
One thread per transport calls it, turn after turn; whether it polls again
or sleeps in epoll between turns is the *strategy*'s word (:mod:`.strategy`).

A thread that waits for a message (a caller blocked in ``rpc_sync``, an idle
pool thread expecting the next request) may :meth:`ProgressThread.drive`
the loop itself: it takes the *baton* (the lock a turn runs under), turns
on its own thread, and the progress thread parks until it is done.  The
message is then handled on the thread that wants it, with no hand-off
between threads: each costs a futex wake-up and, on a busy host, a
scheduler slice.  One driver at a time; the strategy still decides
whether polling pays, and a driver that may not poll returns to block as
before while the progress thread takes over again.

The loop itself knows nothing of frames or pipes: the transport hands it a
``turn`` (one round of work; True if anything happened), ``expected``
(what to expect, as a :class:`Why`: data moving, so poll; else, for up to
``spin_s`` after the last event, whether a reply or request is likely soon)
and ``pending`` (work queued for the loop: do not sleep).  UCX progress and
epoll waits run without the GIL.

A driver's idle turns, while a message is awaited and the transport has
nothing else in flight (``quiet``), are the transport's native ``spin``
(csrc/ucp.c): UCX progress, a look for a frame and a timed yield, repeated
without a Python call until something happens, a chunk
(:data:`SPIN_CHUNK_S`) at a time.  The frames it finds come taken and are
handed on (``on_taken``) without another turn; a drive that starts on a
quiet transport, or whose spin just handed frames on, spins again without
a turn where it will spin (csrc/loop.c's ``drive_turns`` says why).

Everything a driver does (the owner's moves, the baton, its turns and
spins, the strategy's questions) runs in the native core's ``Loop``
(csrc/loop.c): a drive runs twice on each side of every call, and in
Python it was ~40 calls a side of a no-op (issue 52, Run AZ).  The
progress thread's own loop, its parking and the epoll waits stay here.

Two pieces of state say everything about the loop at a glance, both in
``_get_debug_info()["progress"]``:

* **Who turns it** (:class:`Owner`), moved only by the core's ``hand``
  (:meth:`ProgressThread._hand`), checked against :data:`_MOVES`: the
  progress thread; a driver; the progress thread parked for
  :data:`LINGER_S` after a driver left with nothing left to do (its
  caller is likely back at once); or stopped.
* **Whether a turn may poll, and why** (:class:`Why`), decided in one
  place, :meth:`ProgressThread.decide`, from its inputs in this order: data
  in flight; whether a message is due (idle for less than ``spin_s``, and
  the transport's ``awaited``: no peer copying our memory on two cores,
  no pool thread running user code, a call in flight or a peer calling us
  lately); then the strategy's word (a contended core, or the blocking
  mode, may not poll).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any, Callable

from ..._core import Loop, guard, timer_new, turning, turning_bind, unguard
from ..._states import StateEnum
from .interrupts import SigintGuard
from .strategy import POLLS, Strategy, Why

__all__ = ["Owner", "ProgressThread", "guard", "unguard"]

logger = logging.getLogger(__name__)

#: Epoll waits are bounded so UCX's timers (its wire-up's and its TCP
#: transport's; UCP's keepalive is off, ucx/environment.py) still run on an
#: idle worker.
SLEEP_S = 0.1
#: Once nothing has happened for :data:`IDLE_AFTER_S`, the progress thread's
#: waits grow to this.  Everything that needs the loop soon wakes it (UCX's
#: event descriptor, :meth:`ProgressThread.wake` from a caller), so only the
#: timers lose precision, and they are coarser: UCX's own and the pruning
#: of ended pipes' requests (1 s).  Each idle turn costs ~0.1-0.25 ms of
#: Python on a slow host: ten a second were half of an idle agent's CPU,
#: whose peer was unreachable and who called nobody (2.6 of 4.2 ms/s,
#: 2026-11-29).
IDLE_SLEEP_S = 0.5
IDLE_AFTER_S = 2.0
#: How long the progress thread stays parked after a driver left with
#: nothing expected (its caller got its reply; a pool thread took the request
#: it waited for): the same thread is likely back within microseconds, and
#: waking the progress thread in between would take the core and the GIL
#: from it.  Also the longest a message nobody waits for can wait then.
#: The parked thread looks every LINGER_S while drives come and go; once one
#: drive lasted a whole look, it sleeps through the drives (a one-shot timer,
#: csrc/loop.c arms it, measures the lingering then: see _park).
LINGER_S = 0.002
#: A deep-parked thread's longest wait all the same: a safety net only (the
#: linger timer or a wake-up ends every wait that matters).
PARK_CHECK_S = 0.1
#: A turn longer than this means the loop was not listening (an overloaded
#: machine, the GIL held elsewhere, a slow callback).
STALL_S = 0.5
#: The longest a driver spins natively (``spin``) before its own checks run
#: again (``done()``, a stop, Ctrl-C, what ``awaited`` says): a deadline
#: the timeouts thread passed, say, is seen within it.
SPIN_CHUNK_S = 250e-6

#: Ctrl-C held while the main thread drives the loop or sends: the thread's
#: flag is the native core's (``turning``), set by :func:`guard` and by a
#: drive (interrupts.py).
_sigint = SigintGuard(turning)
turning_bind(_sigint)

# guard() enters a section Ctrl-C must not cut in half (a send: a frame
# handed to UCX but not yet watched would leave the pipe waiting for it for
# good) and returns what unguard() needs; it nests.  unguard(outer) leaves
# it, the outermost one raising a Ctrl-C held meanwhile.  Both native
# (csrc/loop.c): a send's two calls.


def _loop_error(exc: BaseException) -> None:
    # A turn's or a spin's error, logged by the native loop (csrc/loop.c's
    # swallow): the loop goes on.
    logger.error("progress loop error (continuing)", exc_info=exc)


class Owner(StateEnum):
    """Who turns the loop (the core's ``hand``, :meth:`ProgressThread._hand`, moves it)."""

    THREAD = "progress thread"
    DRIVER = "a waiting caller"
    LINGER = "progress thread, parked after a driver left"
    STOPPED = "stopped"


#: The moves :meth:`ProgressThread._hand` allows (the core's copy of it is
#: made from this one, once per loop).  A driver takes the loop
#: from the progress thread, turning or lingering, never from another
#: driver; it gives it back at once (work left, or it gave up) or lets the
#: progress thread linger; stopping ends everything.
_MOVES: dict[Owner, frozenset[Owner]] = {
    Owner.THREAD: frozenset({Owner.DRIVER, Owner.STOPPED}),
    Owner.LINGER: frozenset({Owner.DRIVER, Owner.THREAD, Owner.STOPPED}),
    Owner.DRIVER: frozenset({Owner.THREAD, Owner.LINGER, Owner.STOPPED}),
    Owner.STOPPED: frozenset(),
}


class ProgressThread:
    """One thread that runs ``turn`` until :meth:`stop`, sleeping in epoll
    on ``fd`` (UCX's event fd, armed by ``arm``) when nothing is expected.

    Args:
        name: the thread's name.
        progress: ``worker.progress`` (called first in every turn).
        turn: the rest of a turn; returns True if it handled anything.
        expected: ``expected(overdue)``, what the loop may expect:
            :attr:`Why.IN_FLIGHT` while data is moving (sends or receives
            incomplete), whatever ``overdue`` says; else :attr:`Why.QUIET`
            when ``overdue`` (``spin_s`` passed since the last event); else
            :attr:`Why.AWAITED` where a message is likely soon (a reply to
            a call in flight, say), so that polling pays, or why not.  One
            callable, not one per question: the loop asks before every
            spin and as every drive ends (issue 52).
        spin_s: how long after the last event an awaited message is polled for.
        pending: whether work waits for the loop, so it must not sleep.
        arm: arms the worker's event fd; False if events are already there.
        fd: the worker's event fd.
        strategy: when to poll rather than sleep.
        on_stall: ``(seconds, now)`` after a turn that took over
            :data:`STALL_S`.
        on_start: called first on the thread, before its first turn (the
            transport makes its CUDA context current there).
        spin: the idle turns of a driver while a message is awaited, in
            native code: ``spin(wake_fd, budget_s, late_s)`` returns
            ``(why, quick_yields, late_s, taken)`` (``ucp_spin`` in
            csrc/ucp.c, bound to the worker by the transport), ``taken`` the
            frames it found, taken off UCX, or None; None: every idle turn
            is a Python turn.
        on_taken: hands on the frames a spin took (the receiver's
            ``taken``), under the baton, as a turn would.
        quiet: whether a turn would do nothing but look for a frame (no
            request, task or check in flight): only then may ``spin`` stand
            in for turns.

    Thread-safety: :meth:`wake` may be called from any thread.
    """

    def __init__(self, *, name: str, progress: Callable[[], None], turn: Callable[[], bool],
                 expected: Callable[[bool], Why], spin_s: float, pending: Callable[[], bool],
                 arm: Callable[[], bool], fd: int, strategy: Strategy,
                 on_stall: Callable[[float, float], None],
                 on_start: Callable[[], object] | None = None,
                 spin: Callable[[int, float, float], tuple[int, int, float, Any]] | None = None,
                 quiet: Callable[[], bool] | None = None,
                 on_taken: Callable[[Any], None] | None = None) -> None:
        self._on_start = on_start
        self._pending = pending
        self._arm = arm
        self._on_stall = on_stall
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(fd, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        # Where the progress thread parks while another thread drives: a
        # descriptor of its own, so that a wake-up meant for a driver asleep
        # in _sleep is not taken by the parked thread (UCX's descriptor stays
        # readable while a driver consumes its events).
        self._park_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._park_poll = select.epoll()
        self._park_poll.register(self._park_fd, select.EPOLLIN)
        # The linger timer, for a thread parked deep (_park): armed as a
        # driver leaves the loop to linger, disarmed as the next one takes
        # it (the core's hand), it ends the wait when the lingering ran out,
        # so the thread need not wake to look during long drives.  Looking
        # every LINGER_S through them woke it three to four times a 16 MiB
        # call across two hosts on each side, each wake-up preempting a
        # thread that moved the data, ~25% of the call; arming it for every
        # drive cost a no-op call two timerfd_settime on each side, ~2 µs
        # each on a VM, one on its critical path (benchmarks/runs/AS.md).
        self._linger_fd = timer_new()
        self._park_poll.register(self._linger_fd, select.EPOLLIN)
        # The owner (moved only by the core's hand, as _MOVES allows), the
        # baton (held for a turn, by whoever turns), the flags wakers read,
        # and a driver's turns: the native core (csrc/loop.c), as a drive
        # runs on both sides of every call (issue 52).
        self._core = Loop(
            (Owner.THREAD, Owner.DRIVER, Owner.LINGER, Owner.STOPPED), _MOVES, Why.AWAITED,
            POLLS, progress=progress, turn=turn, expected=expected, pending=pending,
            quiet=quiet or (lambda: False),
            spin=spin if quiet is not None and on_taken is not None else None,
            on_taken=on_taken, sleep=self._sleep, on_error=_loop_error, strategy=strategy,
            wake_fd=self._wake_fd, park_fd=self._park_fd, linger_fd=self._linger_fd,
            spin_s=spin_s, spin_chunk_s=SPIN_CHUNK_S, linger_s=LINGER_S, sleep_s=SLEEP_S)
        self._core.last_why = Why.QUIET  # (for debug info, until a turn decides)
        #: Turn the loop on the calling thread until ``done()`` holds, or
        #: until nothing is expected for ``spin_s``: the caller then blocks
        #: as it would have, and the progress thread takes over again.
        #: Between turns the driver polls where the strategy lets it (its
        #: idle turns the native ``spin`` while the transport is ``quiet``),
        #: and otherwise waits in epoll itself (``_sleep``).  Returns
        #: whether ``done()`` held; at once (False) where driving cannot
        #: help: on the progress thread, inside a turn (a callback), or while
        #: another thread drives.  On the main thread, Ctrl-C ends the drive
        #: between two turns and raises ``KeyboardInterrupt`` from here
        #: (interrupts.py).  As it ends, a driver that reached ``done()``
        #: with nothing more expected or pending leaves the progress thread
        #: parked to linger (:data:`LINGER_S`); otherwise it hands the loop
        #: back at once.  Native (``Loop.drive``, csrc/loop.c).
        self.drive: Callable[[Callable[[], bool]], bool] = self._core.drive
        #: Make the loop turn again now if it sleeps (a few flag tests when
        #: it does not): whoever waits in _sleep or spins, or the progress
        #: thread parked with no driver (lingering after one left); with
        #: ``force``, the parked thread whoever drives.  Any thread.
        self.wake: Callable[..., None] = self._core.wake
        #: :meth:`wake` for a send left in flight: whoever sleeps in the
        #: loop (the progress thread, or a driver in epoll or in its native
        #: spin) turns again, but a progress thread parked while lingering
        #: after a driver (:data:`LINGER_S`) is left to linger.  The sender
        #: is that driver more often than not (a caller about to wait for
        #: its reply, a pool thread about to wait for the next request),
        #: back within microseconds; woken, the progress thread took the
        #: loop and the GIL in between, once a call: a 16 MiB ``rpc_sync``
        #: across two hosts had it turn 376 times in 400 calls, two threads
        #: of the sending process progressing one transfer
        #: (benchmarks/runs/AR.md).  Where no driver comes, the progress
        #: thread resumes on its own within LINGER_S.
        self.nudge: Callable[[], None] = self._core.nudge
        self._yield = self._core.yield_
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ident: int | None = None  # the thread's, set as it starts (current)
        self._release_on_exit = False
        self._sigint_counted = False
        self.turns = 0
        self.sleeps = 0
        self.arm_busy = 0
        self.park_wakes = 0

    @property
    def strategy(self) -> Strategy:
        """When to poll rather than sleep: the one given, for the loop's
        life (the transport reads it for every frame it sends too)."""
        return self._core.strategy

    @property
    def current(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.get_ident() == self._ident

    @property
    def owner(self) -> Owner:
        """Who turns the loop now."""
        return self._core.owner

    @property
    def last_why(self) -> Why:
        """The last answer of :meth:`decide` (for debug info)."""
        return self._core.last_why

    @property
    def drives(self) -> int:
        return self._core.drives

    @property
    def driven_turns(self) -> int:
        return self._core.driven_turns

    @property
    def spins(self) -> int:
        return self._core.spins

    def _hand(self, to: Owner, driver: int | None = None, *, only_from: Owner | None = None
              ) -> bool:
        """Move the loop to ``to`` (``driver``: the driving thread's ident)
        if :data:`_MOVES` allows it from where it is (and it is at
        ``only_from``, where given); whether it moved.  The one place
        ownership changes (the native core's ``hand``: a drive moves it
        there without a call back to Python).  A move to LINGER out of a
        deep park arms the linger timer; one to DRIVER disarms it."""
        return self._core.hand(to, driver, only_from)

    def decide(self, now: float, idle_s: float) -> Why:
        """Whether the next turn may poll, and why (:data:`POLLS` poll):
        what ``expected`` says, idle over ``spin_s`` making it overdue; then
        the strategy, which may refuse to poll what is expected.  The
        answer is kept in :attr:`last_why`.  (Native: a drive decides
        without a call back to Python.)"""
        return self._core.decide(now, idle_s)

    def start(self) -> None:
        self._sigint_counted = _sigint.install()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and wait up to ``timeout`` for its turn to end;
        idempotent.  Requests still in flight stay with UCX (the transport
        closes them); from the loop's own thread it returns at once."""
        self._hand(Owner.STOPPED)
        self.wake(force=True)
        if self._thread.is_alive() and not self.current:
            self._thread.join(timeout)

    def close(self) -> None:
        """Release the epoll and wake descriptors, after :meth:`stop`;
        idempotent.  Called from the loop's own thread, the loop releases
        them as it exits; a thread that did not stop in time keeps them
        (closing them under it would hand their numbers to other files)."""
        if _sigint.uninstall(self._sigint_counted):
            self._sigint_counted = False
        if self.current:
            self._release_on_exit = True
        elif self._thread.is_alive():
            logger.warning("%s did not stop; its descriptors stay open", self._thread.name)
        else:
            self._release()

    def _release(self) -> None:
        if not self._epoll.closed:
            # First: a wake-up racing the close must not write a number the
            # process may give to another file (another agent's descriptor).
            self._core.forget()
            self._epoll.close()
            self._park_poll.close()
            os.close(self._wake_fd)
            os.close(self._park_fd)
            os.close(self._linger_fd)

    def info(self) -> dict[str, Any]:
        core = self._core
        return {**core.strategy.info(), "owner": core.owner.value,
                "poll_decision": core.last_why.value, "turns": self.turns,
                "sleeps": self.sleeps, "arm_busy": self.arm_busy, "drives": core.drives,
                "driven_turns": core.driven_turns, "spins": core.spins,
                "park_wakes": self.park_wakes}

    def _run(self) -> None:
        self._ident = threading.get_ident()
        self._core.thread_ident = self._ident  # (it never drives)
        try:
            if self._on_start is not None:
                self._on_start()
            self._loop()
        finally:
            if self._release_on_exit:
                self._release()

    def _loop(self) -> None:
        core = self._core
        checked = last_event = time.monotonic()
        slept = 0.0  # the timeout of the wait since `checked`: no stall
        while not core.stopping:
            if core.owner is Owner.DRIVER:
                self._park()
                checked = last_event = time.monotonic()
                slept = 0.0
                continue
            if core.owner is Owner.LINGER:  # a driver left while this thread turned
                core.hand(Owner.THREAD, only_from=Owner.LINGER)
            self.turns += 1
            busy = core.turn()  # (under the baton)
            now = time.monotonic()
            # Turns are measured from here to here, so a stall anywhere (UCX,
            # a callback, an epoll wait overrunning its timeout, the GIL) is
            # seen once; the wait's own timeout is no stall.
            if now - checked - slept > STALL_S:
                self._on_stall(now - checked - slept, now)
            checked, slept = now, 0.0
            if busy:
                last_event = now
                continue  # more may be there: look again before anything else
            if core.decide(now, now - last_event) in POLLS:
                core.yield_(now)
                continue
            slept = IDLE_SLEEP_S if now - last_event > IDLE_AFTER_S else SLEEP_S
            core.sleeping = True
            try:
                woken = self._sleep(now, slept)
            finally:
                core.sleeping = False
            if woken:
                # A waker (a call just sent: its reply is due) ended the
                # sleep: expect a message.  Not after a sleep that timed out
                # or that UCX ended (its keepalive, say: the next turn shows
                # whether anything came): an idle worker would then poll for
                # spin_s each time, 10% of a core (2026-11-26).
                last_event = time.monotonic()

    def _park(self) -> None:
        """Wait while another thread drives, and for :data:`LINGER_S` after
        it left, unless woken.

        While drives come and go (a caller's no-op calls), the thread looks
        every LINGER_S, as a timer per drive would cost each call two
        syscalls; once one drive has lasted a whole look (a large transfer),
        it parks *deep*: it sleeps until the linger timer, armed as a driver
        leaves (the core's hand), says the lingering ran out, or until
        woken, and looks again after a short drive.  What it changes of the
        owner's state it changes in one native call each (``fired``,
        ``deepen``): a driver's hand never sees half of it."""
        core = self._core
        core.parked = True  # (a driver leaving reads it after moving the owner)
        seen = core.drives
        try:
            while core.owner is Owner.DRIVER or (
                    core.owner is Owner.LINGER
                    and time.monotonic() - core.driver_left < LINGER_S):
                events = self._park_poll.poll(PARK_CHECK_S if core.park_deep else LINGER_S)
                self.park_wakes += 1
                if any(fd == self._park_fd for fd, _ in events):
                    break  # woken: work for the loop
                if events:  # the linger timer: look again, as before
                    try:
                        os.read(self._linger_fd, 8)
                    except BlockingIOError:
                        pass
                    core.fired()
                elif not core.park_deep:
                    core.deepen(seen)  # one drive lasted a look: deep
                    seen = core.drives
        finally:
            core.park_deep = False
            core.parked = False
            try:
                os.eventfd_read(self._park_fd)
            except BlockingIOError:
                pass
        core.hand(Owner.THREAD, only_from=Owner.LINGER)  # a new driver keeps it

    def _sleep(self, now: float, timeout: float) -> bool:
        """Wait in epoll for UCX or :meth:`wake`, up to ``timeout``; the
        caller set its sleeping flag first (so a waker that changed state
        after the checks here writes the wake descriptor).  True when work
        waited for the loop or :meth:`wake` was called meanwhile, False when
        it ran out or UCX ended it (or had work before it could wait)."""
        woken = False
        try:
            if self._pending() or self._core.stopping:
                return True
            if self._arm():
                self.sleeps += 1
                self._epoll.poll(timeout)
            else:
                # UCX has work to do before it can wait (a rendezvous moving
                # fragment by fragment, say): turn again, but not before
                # anyone else who wants this core had it.
                self.arm_busy += 1
                self._yield(now)
        finally:
            # Whether wake() wrote while we slept, read from the descriptor
            # rather than from what ended the wait: a write landing as the
            # wait timed out (the waker saw us asleep) was otherwise drained
            # here unseen, and the wake-up lost.
            try:
                woken = os.eventfd_read(self._wake_fd) > 0
            except BlockingIOError:
                pass
        return woken
