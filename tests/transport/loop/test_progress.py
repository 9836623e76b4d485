"""The progress thread (ucxrpc/transport/loop/progress.py) and its strategies (strategy.py).

* The strategies' rules: blocking never polls, polling always may, adaptive
  stops polling when a yield comes back late and backs off for longer while
  contention lasts.
* The loop on a real descriptor: it starts, sleeps when nothing is expected
  (an idle worker turns a few times a second, no more), wakes when its fd
  fires or :meth:`wake` is called, never sleeps with work pending, stops
  from another thread or its own, and its adaptive strategy sees a thread
  that holds the GIL as contention.
* A thread waiting for a message drives the loop itself (one at a time,
  never from inside a turn), the progress thread parks meanwhile and takes
  over when it leaves; Ctrl-C in a driving main thread waits for the turn.
  Its idle turns on a quiet transport are the native spin, a chunk at a
  time, ended by an event or a wake-up; a transport with work in flight
  is turned in Python.
* Every mode between two processes over real UCX pipes: small and large
  messages both ways, and a close with a large transfer still in flight.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import pytest

from tests.workers import run_workers
from ucxrpc.transport.loop import progress
from ucxrpc.transport.loop import strategy as strategies
from ucxrpc.transport.loop.progress import ProgressThread
from ucxrpc.transport.loop.strategy import Adaptive, Blocking, Mode, Polling, Why

pytestmark = pytest.mark.timeout(120)

MODES = [m.value for m in Mode]


# --------------------------------------------------------------- strategies

def test_blocking_never_polls_and_polling_always_may():
    assert not Blocking().may_poll(0.0)
    p = Polling()
    p.yielded(0.0, 1.0)  # a late yield changes nothing
    assert p.may_poll(0.0)


def _late(a: Adaptive, now: float, times: int = 1) -> None:
    for _ in range(times):
        a.yielded(now, 5e-3)


def test_adaptive_backs_off_after_late_yields_and_longer_while_they_last():
    a = Adaptive(contended_s=1e-3, backoff_s=0.1, max_backoff_s=0.4, late=3, window=8)
    a.yielded(10.0, 1e-4)  # a prompt yield: the core was free
    _late(a, 10.0, 2)      # two late ones in the window: not yet a pattern
    assert a.may_poll(10.0) and a.contended == 0
    _late(a, 10.0)         # the third: someone else wants the core
    assert a.contended == 1
    assert not a.may_poll(10.05) and a.may_poll(10.1)
    # Contended again right after the back-off: it doubles, up to the cap.
    _late(a, 10.1, 3)
    assert not a.may_poll(10.29) and a.may_poll(10.3)
    _late(a, 10.3, 3)
    _late(a, 10.7, 3)
    assert not a.may_poll(11.09) and a.may_poll(11.1)  # 0.4, the cap
    # Contention long after the last back-off starts from the first again.
    _late(a, 100.0, 3)
    assert not a.may_poll(100.09) and a.may_poll(100.1)
    assert a.info()["mode"] == "adaptive" and a.contended == 5


def test_adaptive_forgives_a_lone_late_yield():
    a = Adaptive(contended_s=1e-3, late=3, window=8)
    for i in range(100):  # one late yield in every window of 8 (a GC pause, say)
        a.yielded(float(i), 5e-3 if i % 8 == 0 else 1e-5)
    assert a.contended == 0 and a.may_poll(100.0)


def test_a_native_spins_yields_count_as_yields_one_by_one_would():
    """``spun`` takes the prompt yields of a native spin and its late one:
    the prompt ones only move the window on, so a late yield now and then
    stays forgiven, and late ones in one window still mean contention."""
    a = Adaptive(contended_s=1e-3, late=3, window=8)
    for i in range(50):
        a.spun(float(i), 7, 5e-3)  # 7 prompt, 1 late: one late in every window of 8
    assert a.contended == 0 and a.may_poll(50.0)
    a.spun(60.0, 1, 5e-3)
    a.spun(60.0, 0, 5e-3)
    a.spun(60.0, 0, 5e-3)  # three late ones in one window
    assert a.contended == 1 and not a.may_poll(60.0)
    assert a.late_s == 1e-3
    p = Polling()
    p.spun(0.0, 3, 1.0)  # polling takes no notice
    assert p.may_poll(0.0) and p.late_s == float("inf")


def test_strategy_by_name_and_a_clear_error_for_an_unknown_one():
    for mode in Mode:
        assert strategies.strategy(mode.value).mode is mode
    with pytest.raises(ValueError, match=r"unknown progress mode 'spin'.*'adaptive'"):
        strategies.strategy("spin")


def test_backend_option_is_checked():
    import ucxrpc as rpc

    assert rpc.UcxRpcBackendOptions().progress in MODES
    assert rpc.UcxRpcBackendOptions(progress="blocking").progress == "blocking"
    with pytest.raises(ValueError, match=r"unknown progress mode 'fast': expected one of 'adaptive'"):
        rpc.UcxRpcBackendOptions(progress="fast")


# ------------------------------------------------------------------- loop

class _Loop:
    """A ProgressThread on an eventfd standing in for UCX's: ``fire()`` is
    an event from the network; ``expect``/``pending`` are what the
    transport would say."""

    def __init__(self, strategy: strategies.Strategy, awaited=None, spin_s: float = 0.0,
                 spin=None, quiet=None) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.expect = False
        self.pending = False
        self.events = 0
        self.tasks: list[threading.Event] = []
        self.calls: list = []  # run inside a turn, on whichever thread turns
        self.seen = threading.Event()
        self.seen_on = ""  # the thread whose turn saw the last event
        self.stalls: list[float] = []  # what on_stall was told
        self.turn_instead = None  # a test's own turn (the loop holds this one's)
        self.loop = ProgressThread(
            name="test-progress", progress=lambda: None, turn=self._turn,
            expected=self._expected, spin_s=spin_s,
            pending=lambda: self.pending, arm=lambda: True, fd=self.fd,
            strategy=strategy, on_stall=lambda s, now: self.stalls.append(s),
            on_start=self._started,
            spin=spin, quiet=quiet, on_taken=self._taken)
        self.started_on: tuple[str, int] | None = None  # thread, turns before it
        self._awaited = awaited

    def _expected(self, overdue: bool) -> Why:
        # As the transport answers (Transport._expected): data in flight,
        # else nothing once overdue, else what ``awaited`` says.
        if self.expect:
            return Why.IN_FLIGHT
        if overdue:
            return Why.QUIET
        return Why.AWAITED if self._awaited is None else self._awaited()

    def _started(self) -> None:
        self.started_on = (threading.current_thread().name, self.loop.turns)

    def _taken(self, taken: list[int]) -> None:
        # What a spin took (the events it read), handed on as a turn would.
        self.events += sum(taken)
        self.seen_on = threading.current_thread().name
        self.seen.set()

    def _turn(self) -> bool:
        if self.turn_instead is not None:
            return self.turn_instead()
        try:
            taken = [os.eventfd_read(self.fd)]
        except BlockingIOError:
            pass
        else:
            self._taken(taken)
            return True
        while self.calls:
            self.calls.pop()()
            return True
        while self.tasks:
            self.tasks.pop().set()
            return True
        return False

    def fire(self) -> None:
        os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        self.loop.stop()
        self.loop.close()
        os.close(self.fd)


@pytest.fixture(params=MODES)
def loop(request):
    lp = _Loop(strategies.strategy(request.param))
    lp.loop.start()
    yield lp
    lp.close()


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_an_idle_loop_sleeps_and_an_event_wakes_it(loop):
    _wait_for(lambda: loop.loop.sleeps >= 1, "the first sleep")
    before = loop.loop.turns
    time.sleep(0.3)
    # Asleep in epoll, bounded at progress.SLEEP_S: a few turns, not a spin.
    assert loop.loop.turns - before <= 0.3 / progress.SLEEP_S + 3, loop.loop.info()
    for i in range(1, 4):
        loop.seen.clear()
        loop.fire()
        assert loop.seen.wait(10), f"event {i} was not seen"
    assert loop.events == 3


def test_a_long_idle_loop_sleeps_longer_and_its_sleeps_are_no_stalls(monkeypatch):
    # Idle for IDLE_AFTER_S, the progress thread's waits grow from SLEEP_S
    # to IDLE_SLEEP_S (an idle agent's CPU is mostly its idle turns); an
    # event still ends a wait at once.  A wait as long as its own timeout is
    # no stall, even one longer than STALL_S: only an overrun would be.
    monkeypatch.setattr(progress, "IDLE_AFTER_S", 0.3)
    monkeypatch.setattr(progress, "IDLE_SLEEP_S", 0.5)
    monkeypatch.setattr(progress, "STALL_S", 0.4)
    lp = _Loop(strategies.strategy("blocking"))
    lp.loop.start()
    try:
        _wait_for(lambda: lp.loop.sleeps >= 1, "the first sleep")
        time.sleep(0.6)  # idle for longer than IDLE_AFTER_S
        before = lp.loop.turns
        time.sleep(1.5)
        # At SLEEP_S, 15 turns; at IDLE_SLEEP_S, 3 (4 if one ended as this began).
        assert lp.loop.turns - before <= 1.5 / 0.5 + 2, lp.loop.info()
        lp.seen.clear()
        lp.fire()
        assert lp.seen.wait(10), "an event did not end a long idle sleep"
        assert lp.stalls == [], lp.stalls
    finally:
        lp.close()


@pytest.mark.parametrize("mode", ["polling", "adaptive"])
def test_a_sleep_that_times_out_is_no_event_to_poll_after(mode):
    # A worker whose peer called it last expects the next request for spin_s
    # after each event.  A sleep that merely ran out is no event: counted as
    # one, an idle callee polled for spin_s after every SLEEP_S (10% of a
    # core at the defaults).  A wake() is one: a call was just sent.  spin_s
    # here is 15 sleeps and five times the window watched below: a loop that
    # counted its sleeps as events would poll through that window.
    spin_s = 15 * progress.SLEEP_S
    lp = _Loop(strategies.strategy(mode), awaited=lambda: strategies.Why.AWAITED, spin_s=spin_s)
    started = time.monotonic()
    lp.loop.start()
    try:
        # The loop expects an event for spin_s from its start and polls till
        # then; a loaded host's adaptive back-off sleeps before, and polls
        # again after.  Past spin_s, and once asleep, it is idle.
        idle_from = started + spin_s + 2 * progress.SLEEP_S
        _wait_for(lambda: lp.loop.sleeps >= 1 and time.monotonic() > idle_from,
                  "the first sleep once idle", timeout=20.0)
        before = lp.loop.turns
        time.sleep(0.3)
        assert lp.loop.turns - before <= 0.3 / progress.SLEEP_S + 3, lp.loop.info()
        if mode == "polling":  # adaptive may be backing off on a busy host
            lp.loop.wake()
            # Counted once polling: the wake may end a sleep the loop was
            # entering as it came, counted after a count taken before it.
            _wait_for(lambda: lp.loop.turns - before > 100, "polling after a wake")
            sleeps = lp.loop.sleeps
            _wait_for(lambda: lp.loop.turns - before > 1000, "polling on")
            assert lp.loop.sleeps == sleeps
    finally:
        lp.close()


def test_on_start_runs_on_the_loop_thread_before_its_first_turn(loop):
    # Where the transport makes its CUDA context current (cudactx.py).
    _wait_for(lambda: loop.loop.turns >= 1, "the first turn")
    assert loop.started_on == ("test-progress", 0)


def test_wake_from_another_thread_runs_queued_work(loop):
    _wait_for(lambda: loop.loop.sleeps >= 1, "the first sleep")
    done = threading.Event()
    loop.tasks.append(done)
    loop.loop.wake()
    assert done.wait(10), "wake() did not make the loop turn"


def test_pending_work_keeps_it_awake():
    lp = _Loop(Blocking())
    lp.pending = True
    lp.loop.start()
    try:
        _wait_for(lambda: lp.loop.turns > 1000, "turns with work pending")
        assert lp.loop.sleeps == 0
    finally:
        lp.close()


def test_a_wake_after_close_writes_no_descriptor_the_process_reused():
    # A caller's wake racing a shutdown wrote the closed wake descriptor's
    # number, which the process may have given to another file since (in a
    # process that starts RPC again, another agent's wake descriptor).
    lp = _Loop(Polling())
    lp.loop.start()
    lp.close()
    reused = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(4)]
    try:
        lp.loop.wake(force=True)
        lp.loop.nudge()
        for fd in reused:
            with pytest.raises(BlockingIOError):
                os.eventfd_read(fd)  # nothing was written to it
    finally:
        for fd in reused:
            os.close(fd)


def test_stop_and_close_from_its_own_thread_release_everything():
    lp = _Loop(Polling())
    stopped = threading.Event()

    def turn() -> bool:
        lp.loop.stop()  # as a callback on the loop may (a transport closing)
        lp.loop.close()
        stopped.set()
        return False

    lp.turn_instead = turn
    lp.loop.start()
    assert stopped.wait(10)
    lp.loop._thread.join(10)
    assert not lp.loop._thread.is_alive()
    assert lp.loop._epoll.closed  # released by the loop as it left
    lp.loop.close()  # idempotent
    lp.loop.stop()
    os.close(lp.fd)


def test_adaptive_sees_a_thread_holding_the_gil_as_contention():
    lp = _Loop(Adaptive())
    lp.expect = True  # a message is due: it would poll
    stop = threading.Event()

    def hog() -> None:  # pure Python: gives the GIL up only when forced
        n = 0
        while not stop.is_set():
            n += 1

    hogger = threading.Thread(target=hog, daemon=True)
    lp.loop.start()
    hogger.start()
    try:
        _wait_for(lambda: lp.loop.strategy.contended >= 1, "contention to be seen")
        _wait_for(lambda: lp.loop.sleeps >= 1, "the loop to sleep instead of polling")
    finally:
        stop.set()
        hogger.join(10)
        lp.close()


# ------------------------------------------------ a waiting thread drives

def _started(strategy: strategies.Strategy, expect: bool) -> _Loop:
    lp = _Loop(strategy)
    lp.expect = expect  # True: data "in flight", so a driver keeps polling
    lp.loop.start()
    return lp


def _drive_on_thread(lp: _Loop, done, name: str = "waiter") -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["reached"] = lp.loop.drive(done)
        out["seen_on"] = lp.seen_on

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


def test_a_waiting_thread_turns_the_loop_and_the_progress_thread_parks():
    lp = _started(Polling(), expect=True)
    try:
        t, out = _drive_on_thread(lp, lambda: lp.events >= 1)
        _wait_for(lambda: lp.loop.drives == 1 and lp.loop._core.parked, "the progress thread to park")
        turns = lp.loop.turns
        time.sleep(0.05)
        assert lp.loop.turns == turns, "the progress thread turned while another thread drove"
        lp.fire()
        t.join(10)
        # The event was handled on the thread that waited for it.
        assert out == {"reached": True, "seen_on": "waiter"}
        assert lp.loop.driven_turns > 0 and lp.loop.info()["drives"] == 1
    finally:
        lp.close()


def test_one_driver_at_a_time_never_from_a_turn_nor_when_polling_may_not():
    lp = _started(Polling(), expect=True)
    release = threading.Event()
    try:
        t, out = _drive_on_thread(lp, release.is_set)
        _wait_for(lambda: lp.loop.drives == 1, "the first driver")
        assert lp.loop.drive(lambda: False) is False  # another thread drives
        nested: list[bool] = []
        lp.calls.append(lambda: nested.append(lp.loop.drive(lambda: False)))
        _wait_for(lambda: nested, "the call inside the driver's turn")
        assert nested == [False]  # turns do not nest
        release.set()
        t.join(10)
        assert out["reached"] is True
        # On the progress thread itself (a callback there): never.
        lp.calls.append(lambda: nested.append(lp.loop.drive(lambda: False)))
        _wait_for(lambda: len(nested) == 2, "the call on the progress thread")
        assert nested == [False, False] and lp.loop.drives == 1
    finally:
        lp.close()


def test_where_polling_may_not_the_driver_waits_in_epoll_itself():
    # The blocking mode (or a contended core): the waiting thread does not
    # poll, and does not hand the loop back either; it sleeps in epoll, and
    # the event wakes it, not the parked progress thread.
    lp = _started(Blocking(), expect=True)
    try:
        t, out = _drive_on_thread(lp, lambda: lp.events >= 1)
        _wait_for(lambda: lp.loop._core.driver_sleeping and lp.loop._core.parked, "the driver to sleep")
        turns, driven = lp.loop.turns, lp.loop.driven_turns
        time.sleep(0.05)
        assert lp.loop.driven_turns - driven <= 1, "a sleeping driver polled"
        assert lp.loop.turns == turns, "the progress thread turned while another thread drove"
        lp.fire()
        t.join(10)
        assert out == {"reached": True, "seen_on": "waiter"}
    finally:
        lp.close()


def test_wake_reaches_a_sleeping_driver_not_the_parked_thread():
    lp = _started(Blocking(), expect=True)
    ran: list[str] = []
    try:
        t, out = _drive_on_thread(lp, lambda: bool(ran))
        _wait_for(lambda: lp.loop._core.driver_sleeping and lp.loop._core.parked, "the driver to sleep")
        lp.calls.append(lambda: ran.append(threading.current_thread().name))
        lp.loop.wake()  # as a sender does after queueing work for the loop
        t.join(10)
        assert out["reached"] is True and ran == ["waiter"]
    finally:
        lp.close()


class _Spin:
    """What the native spin does, in Python, on the loop's test descriptor:
    returns 0 when an event waits (taken: read, its count the frames), 3
    when woken (the wake-up consumed), 2 when its budget ran out."""

    def __init__(self, lp_fd: list[int]) -> None:
        self.fd = lp_fd
        self.calls: list[tuple[float, float]] = []
        self.woken = 0
        self.quiet = True
        self.raises = 0  # calls left that raise, as UCX's progress may

    def __call__(self, wake_fd: int, budget: float,
                 late: float) -> tuple[int, int, float, list[int] | None]:
        self.calls.append((budget, late))
        if self.raises:
            self.raises -= 1
            raise RuntimeError("UCX progress failed")
        end = time.monotonic() + budget
        quick = 0
        while time.monotonic() < end:
            if _readable(self.fd[0]):
                return 0, quick, 0.0, [os.eventfd_read(self.fd[0])]
            try:
                os.eventfd_read(wake_fd)
            except BlockingIOError:
                quick += 1
                os.sched_yield()
                continue
            self.woken += 1
            return 3, quick, 0.0, None
        return 2, quick, 0.0, None


def _readable(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def _spinning(awaited=True) -> tuple[_Loop, _Spin]:
    box: list[int] = []
    spin = _Spin(box)
    lp = _Loop(Polling(), awaited=lambda: strategies.Why.AWAITED, spin_s=30.0, spin=spin,
               quiet=lambda: spin.quiet)
    box.append(lp.fd)
    lp.loop.start()
    return lp, spin


def test_a_driver_awaiting_a_message_on_a_quiet_transport_spins_natively():
    """While a message is awaited and nothing else is in flight, the
    driver's idle turns are the transport's native spin, a chunk at a time
    (its own checks in between), with the strategy's limit for a late
    yield; the event it finds is taken there and handed on by the driver,
    under the baton, without another turn."""
    lp, spin = _spinning()
    try:
        t, out = _drive_on_thread(lp, lambda: lp.events >= 1)
        _wait_for(lambda: lp.loop.spins >= 3, "the driver to spin")
        assert lp.loop.info()["spins"] == lp.loop.spins
        assert all(0 < budget <= progress.SPIN_CHUNK_S and late == float("inf")
                   for budget, late in spin.calls)
        lp.fire()
        t.join(10)
        assert out == {"reached": True, "seen_on": "waiter"}
    finally:
        lp.close()


def _unstarted_spinning(why: Why) -> tuple[_Loop, _Spin]:
    """A loop whose progress thread never runs (nobody but the driver can
    take an event), the transport quiet, ``expected`` answering ``why``."""
    box: list[int] = []
    spin = _Spin(box)
    lp = _Loop(Polling(), awaited=lambda: why, spin_s=30.0, spin=spin, quiet=lambda: True)
    box.append(lp.fd)
    return lp, spin


def test_a_drive_on_a_quiet_transport_opens_with_the_spin_not_a_turn():
    """What already waits is taken by the spin (Run AU: the opening turn
    was a call to ucxx's progress and three Python calls a drive)."""
    lp, spin = _unstarted_spinning(strategies.Why.AWAITED)
    try:
        lp.fire()
        assert lp.loop.drive(lambda: lp.events >= 1) is True
        assert lp.loop.driven_turns == 0 and lp.loop.spins == 1 and len(spin.calls) == 1
    finally:
        lp.loop.close()


def test_a_driver_that_will_not_spin_turns_before_it_leaves():
    """A driver that may not poll (here a pool thread computes) leaves the
    loop at once, but only after one turn: what already waited is handled
    by it, not left for a progress thread that may be asleep."""
    lp, spin = _unstarted_spinning(strategies.Why.COMPUTING)
    try:
        lp.fire()
        assert lp.loop.drive(lambda: lp.events >= 1) is True
        assert lp.loop.driven_turns == 1 and not spin.calls
        assert lp.loop.drive(lambda: lp.events >= 2) is False  # nothing waits: it leaves
        assert lp.loop.driven_turns == 2 and not spin.calls
    finally:
        lp.loop.close()


def test_a_spin_that_raises_is_logged_and_the_driver_waits_on(caplog):
    """As a turn's error: the caller that happened to drive is not failed."""
    lp, spin = _spinning()
    spin.raises = 2
    try:
        t, out = _drive_on_thread(lp, lambda: lp.events >= 1)
        _wait_for(lambda: lp.loop.spins >= 4, "the driver to spin on")
        lp.fire()
        t.join(10)
        assert out == {"reached": True, "seen_on": "waiter"}
        assert caplog.text.count("progress loop error (continuing)") == 2
    finally:
        lp.close()


def test_a_transport_with_work_in_flight_is_turned_in_python_not_spun():
    lp, spin = _spinning()
    spin.quiet = False
    try:
        t, out = _drive_on_thread(lp, lambda: lp.events >= 1)
        _wait_for(lambda: lp.loop.driven_turns >= 20, "the driver to turn")
        assert lp.loop.spins == 0 and not spin.calls
        lp.fire()
        t.join(10)
        assert out["reached"] is True
    finally:
        lp.close()


def test_wake_ends_a_drivers_spin_and_its_work_runs_on_the_driver(monkeypatch):
    # Chunks of 30 s: only the wake-up can end this spin within the test.
    monkeypatch.setattr(progress, "SPIN_CHUNK_S", 30.0)
    lp, spin = _spinning()
    ran: list[str] = []
    try:
        t, out = _drive_on_thread(lp, lambda: bool(ran))
        _wait_for(lambda: lp.loop._core.driver_spinning, "the driver to spin")
        lp.calls.append(lambda: ran.append(threading.current_thread().name))
        lp.loop.wake()  # as a sender does after queueing work for the loop
        t.join(10)
        assert out.get("reached") is True and ran == ["waiter"] and spin.woken == 1, out
    finally:
        lp.close()


@pytest.mark.parametrize("reached", [False, True], ids=["gave-up", "done"])
def test_the_progress_thread_takes_over_when_the_driver_leaves(reached):
    # Nothing expected: a driver gives up after its first idle turn and
    # hands the loop back at once; one that got what it waited for leaves
    # the progress thread parked for LINGER_S, after which it turns alone.
    lp = _started(Polling(), expect=False)
    try:
        assert lp.loop.drive(lambda: reached) is reached
        lp.fire()
        assert lp.seen.wait(10)
        assert lp.seen_on == "test-progress"
    finally:
        lp.close()


def _answered_loop() -> tuple[_Loop, threading.Event, Callable[[], bool]]:
    """A loop, the event that answers its driver, and the driver's ``done``:
    a reply is awaited until the driver itself saw the answer, nothing after
    it, so the driver leaves the progress thread lingering (Owner.LINGER),
    as a caller does.  (Nothing awaited before the driver saw its answer
    would end its drive there.)"""
    answered, reached = threading.Event(), threading.Event()

    def done() -> bool:
        if answered.is_set():
            reached.set()  # from here on nothing is awaited, as after a reply
            return True
        return False

    lp = _Loop(Polling(), awaited=lambda: Why.NOTHING_DUE if reached.is_set() else Why.AWAITED,
               spin_s=30.0)
    return lp, answered, done


def test_the_parked_thread_sleeps_through_a_drive_and_its_linger_timer_resumes_it(monkeypatch):
    # The parked thread used to wake every LINGER_S to look: three to four
    # times a 16 MiB call across two hosts, each wake-up preempting a thread
    # that moved the data (benchmarks/runs/AS.md).  Once a drive outlasts a
    # look, only the linger timer, armed as the driver leaves, ends its
    # wait; with the safety net out of reach (30 s), nothing else could.
    monkeypatch.setattr(progress, "PARK_CHECK_S", 30.0)
    lp, answered, done = _answered_loop()
    lp.expect = True  # data in flight while the driver drives
    lp.loop.start()
    try:
        t, out = _drive_on_thread(lp, done)
        # One look (LINGER_S) sees the same drive: the thread parks deep.
        _wait_for(lambda: lp.loop._core.park_deep, "the progress thread to park deep")
        wakes = lp.loop.park_wakes
        time.sleep(0.2)  # a hundred LINGER_S
        assert lp.loop.park_wakes == wakes, "the parked thread woke while the driver drove"
        lp.expect = False
        answered.set()
        t.join(10)
        assert out.get("reached") is True, out
        assert lp.loop.owner in (progress.Owner.LINGER, progress.Owner.THREAD)
        lp.fire()
        assert lp.seen.wait(10), "the linger timer did not resume the progress thread"
        assert lp.seen_on == "test-progress" and lp.loop.owner is progress.Owner.THREAD
    finally:
        lp.close()


def test_short_drives_leave_the_linger_timer_alone(monkeypatch):
    # A caller's no-op calls drive for microseconds each: arming the timer
    # as each left and disarming it as the next came cost two syscalls a
    # call on each side, ~2 µs each on a VM, one on the call's critical
    # path (Run AS).  While drives come and go, the parked thread looks
    # every LINGER_S instead, and the timer is not touched.
    lp = _Loop(Polling(), awaited=lambda: Why.NOTHING_DUE)  # each drive leaves it lingering
    lp.loop.start()
    try:
        drives = 0
        end = time.monotonic() + 0.3  # ~150 looks
        while time.monotonic() < end:
            assert lp.loop.drive(lambda: True)
            drives += 1
            time.sleep(0.0002)
        assert lp.loop.drives == drives > 100
        # (A drive preempted for a whole look may park it deep once: far
        # from the two a drive of a timer per drive.)
        arms = lp.loop._core.timer_sets  # (armed or disarmed: csrc/loop.c)
        assert arms <= drives // 10, (arms, drives)
        lp.fire()
        assert lp.seen.wait(10), "the progress thread did not resume after the drives"
    finally:
        lp.close()


def test_a_send_in_flight_nudges_the_loop_but_leaves_a_lingering_thread_parked(monkeypatch):
    # A sender is the driver that just left more often than not, back at
    # once: woken for its send, the progress thread took the loop and the
    # GIL in between, once a call (benchmarks/runs/AR.md).  A lingering
    # thread that long (5 s) shows the difference without timing anything.
    monkeypatch.setattr(progress, "LINGER_S", 5.0)
    lp, answered, done = _answered_loop()
    lp.loop.start()
    try:
        t, out = _drive_on_thread(lp, done)
        _wait_for(lambda: lp.loop._core.parked, "the progress thread to park")
        answered.set()
        t.join(10)
        assert out.get("reached") is True, out
        assert lp.loop._core.parked and lp.loop.owner is progress.Owner.LINGER
        turns = lp.loop.turns
        lp.loop.nudge()
        time.sleep(0.2)
        assert lp.loop._core.parked and lp.loop.turns == turns, "a nudge unparked the lingering thread"
        lp.loop.wake()  # a caller that needs the loop turning now gets it
        _wait_for(lambda: lp.loop.turns > turns, "wake to unpark the progress thread")
        assert lp.loop.owner is progress.Owner.THREAD
    finally:
        lp.close()


def test_a_nudge_wakes_a_progress_thread_asleep_in_epoll():
    lp = _started(Polling(), expect=False)
    try:
        _wait_for(lambda: lp.loop.sleeps >= 1 and lp.loop._core.sleeping, "the loop to sleep")
        sleeps = lp.loop.sleeps
        lp.calls.append(lambda: None)  # work only a turn finds
        lp.loop.nudge()
        _wait_for(lambda: not lp.calls, "the nudged loop to turn")
        assert lp.loop.sleeps <= sleeps + 1  # woken, not timed out sleep after sleep
    finally:
        lp.close()


def test_ctrl_c_in_a_driving_main_thread_waits_for_the_turn_to_end():
    import signal

    assert threading.current_thread() is threading.main_thread()
    # Python's own Ctrl-C handler, whatever the runner left: a shell starts a
    # background job with SIGINT ignored, and then no KeyboardInterrupt comes.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    lp = _started(Polling(), expect=True)  # started here: it guards SIGINT
    finished: list[str] = []

    def in_turn() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecodes where Python would raise it
            pass
        finished.append("turn")

    try:
        lp.calls.append(in_turn)
        with pytest.raises(KeyboardInterrupt):
            lp.loop.drive(lambda: False)
        assert finished == ["turn"]  # raised after the turn, not inside it
        assert lp.loop.owner is progress.Owner.THREAD  # and the loop was handed back
        lp.fire()
        assert lp.seen.wait(10) and lp.seen_on == "test-progress"
    finally:
        lp.close()
        after = signal.signal(signal.SIGINT, inherited)
    assert after is before  # given back at close


# ----------------------------------------------- modes over real UCX pipes

MiB = 1 << 20


def _exchange(rank, world_size, init_method, mode):
    import torch

    import ucxrpc as rpc
    from tests.faults import _common as c

    c.init(rank, world_size, init_method, progress=mode)
    out = {}
    if rank == 0:
        out["small"] = [rpc.rpc_sync("worker1", c.add, args=(i, 1)) for i in range(200)]
        futs = [rpc.rpc_async("worker1", c.add, args=(i, 1)) for i in range(200)]
        out["async"] = [f.wait() for f in futs]
        big = torch.arange(16 * MiB // 4, dtype=torch.float32)
        back = rpc.rpc_sync("worker1", c.echo, args=(big,))
        out["big_equal"] = bool(torch.equal(back, big))
        out["info"] = rpc._get_debug_info()["progress"]
    rpc.shutdown()
    return out


@pytest.mark.processes
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_carries_small_and_large_messages(mode):
    res = run_workers(_exchange, 2, args=(mode,), timeout=90)
    assert res[0]["small"] == list(range(1, 201))
    assert res[0]["async"] == list(range(1, 201))
    assert res[0]["big_equal"]
    assert res[0]["info"]["mode"] == mode
    print(f"\n  {mode}: {res[0]['info']}")


def _close_in_flight(rank, world_size, init_method, mode):
    import torch

    import ucxrpc as rpc
    from tests.faults import _common as c

    c.init(rank, world_size, init_method, progress=mode)
    out = {}
    if rank == 0:
        assert rpc.rpc_sync("worker1", c.add, args=(1, 2)) == 3
        big = torch.ones(64 * MiB // 4)
        fut = rpc.rpc_async("worker1", c.echo, args=(big,))
        start = time.monotonic()
        rpc.shutdown(graceful=False)  # with the transfer still moving
        out["close_s"] = time.monotonic() - start
        try:
            out["result"] = "ok" if torch.equal(fut.wait(), big) else "wrong"
        except RuntimeError as exc:
            out["result"] = f"{type(exc).__name__}: {exc}"
    else:
        rpc.shutdown(timeout=30)
    return out


@pytest.mark.processes
@pytest.mark.parametrize("mode", MODES)
def test_close_with_a_large_transfer_in_flight(mode):
    res = run_workers(_close_in_flight, 2, args=(mode,), timeout=90)
    # The call either finished first or failed with an RPC error; the
    # process closed and exited either way (run_workers checks the exit).
    r = res[0]["result"]
    assert r == "ok" or r.split(":")[0] in {"ClosedError", "BrokenError", "RpcError"}, r
    print(f"\n  {mode}: closed in {res[0]['close_s']:.2f} s; the call: {r}")


# -- the one decision, and who turns the loop ------------------------------------

@pytest.mark.parametrize(
    ("strategy", "in_flight", "awaited", "idle_s", "expected"),
    [
        (strategies.Polling(), True, strategies.Why.NOTHING_DUE, 10.0, strategies.Why.IN_FLIGHT),
        (strategies.Polling(), False, strategies.Why.AWAITED, 0.0, strategies.Why.AWAITED),
        (strategies.Polling(), False, strategies.Why.AWAITED, 10.0, strategies.Why.QUIET),
        (strategies.Polling(), False, strategies.Why.COMPUTING, 0.0, strategies.Why.COMPUTING),
        (strategies.Polling(), False, strategies.Why.PEER_COPYING, 0.0,
         strategies.Why.PEER_COPYING),
        (strategies.Blocking(), True, strategies.Why.AWAITED, 0.0, strategies.Why.BLOCKING),
        (strategies.Blocking(), False, strategies.Why.NOTHING_DUE, 0.0, strategies.Why.NOTHING_DUE),
    ],
)
def test_whether_a_turn_polls_is_decided_in_one_place_with_its_reason(
        strategy, in_flight, awaited, idle_s, expected) -> None:
    lp = _Loop(strategy, awaited=lambda: awaited, spin_s=1.0)
    lp.expect = in_flight
    try:
        assert lp.loop.decide(time.monotonic(), idle_s) is expected
        assert lp.loop.info()["poll_decision"] == expected.value
        assert (expected in strategies.POLLS) == (expected in (strategies.Why.IN_FLIGHT,
                                                              strategies.Why.AWAITED))
    finally:
        lp.close()


def test_a_contended_core_refuses_what_is_expected() -> None:
    adaptive = strategies.Adaptive(late=1)
    now = time.monotonic()
    adaptive.yielded(now, 1.0)  # one yield that came back a second late: blocked a while
    lp = _Loop(adaptive, awaited=lambda: strategies.Why.AWAITED, spin_s=1.0)
    try:
        assert lp.loop.decide(now, 0.0) is strategies.Why.CONTENDED
    finally:
        lp.close()


def test_the_loop_changes_hands_only_as_the_table_allows() -> None:
    lp = _Loop(strategies.Polling())
    loop, owner = lp.loop, progress.Owner
    try:
        assert loop.owner is owner.THREAD
        assert loop._hand(owner.DRIVER, 1) and loop.owner is owner.DRIVER
        assert not loop._hand(owner.DRIVER, 2)  # never from another driver
        assert loop._hand(owner.LINGER) and loop.owner is owner.LINGER
        assert not loop._hand(owner.THREAD, only_from=owner.DRIVER)  # not where it is
        assert loop._hand(owner.THREAD, only_from=owner.LINGER) and loop.owner is owner.THREAD
        assert loop._hand(owner.STOPPED)
        assert not any(loop._hand(o) for o in owner)  # stopped is the end
        assert loop.info()["owner"] == "stopped"
    finally:
        lp.close()
