"""The native core's ``Loop`` (csrc/loop.c) as C code: a drive's paths
(reached, given up, a turn that raises an Exception, one that raises what
is no Exception, a spin handing frames on, a spin that raises) leave every
object with the reference count it came with, the owner handed back and
the baton free; a Ctrl-C held over a failed drive keeps the failure as its
context; its arguments are checked by name.  What the loop means
for the progress thread and its drivers is
tests/transport/loop/test_progress.py's to hold."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest

from ucxrpc import _core
from ucxrpc.transport.loop import progress
from ucxrpc.transport.loop.progress import _MOVES, Owner
from ucxrpc.transport.loop.strategy import POLLS, Polling, Why

OWNERS = (Owner.THREAD, Owner.DRIVER, Owner.LINGER, Owner.STOPPED)


class Stop(BaseException):
    """What is no Exception (as KeyboardInterrupt is not): a drive lets it out."""


class Harness:
    """A Loop on an eventfd, with callables a test steers."""

    def __init__(self, *, spin: bool = False) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.park = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.linger = _core.timer_new()
        self.turns = 0
        self.turn_raises: BaseException | None = None
        self.spin_raises: BaseException | None = None
        self.spin_gives: object = None
        self.why = Why.AWAITED
        self.errors: list[BaseException] = []
        self.taken: list[object] = []
        self.strategy = Polling()
        self.loop = _core.Loop(
            OWNERS, _MOVES, Why.AWAITED, POLLS, progress=self._progress, turn=self._turn,
            expected=self._expected, pending=lambda: False, quiet=lambda: True,
            spin=self._spin if spin else None, on_taken=self.taken.append if spin else None,
            sleep=lambda now, timeout: False, on_error=self.errors.append,
            strategy=self.strategy, wake_fd=self.fd, park_fd=self.park, linger_fd=self.linger,
            spin_s=1.0, spin_chunk_s=250e-6, linger_s=0.002, sleep_s=0.1)

    def _progress(self) -> None:
        pass

    def _turn(self) -> bool:
        self.turns += 1
        if self.turn_raises is not None:
            raise self.turn_raises
        return False

    def _expected(self, overdue: bool) -> Why:
        return self.why

    def _spin(self, wake_fd: int, budget: float, late: float) -> tuple[int, int, float, object]:
        if self.spin_raises is not None:
            raise self.spin_raises
        return (0, 1, 0.0, self.spin_gives)

    def close(self) -> None:
        for fd in (self.fd, self.park, self.linger):
            os.close(fd)


def _after(n: int):
    """done() that holds from its n-th call on."""
    calls = [0]

    def done() -> bool:
        calls[0] += 1
        return calls[0] >= n
    return done


def test_every_path_of_a_drive_keeps_reference_counts_balanced_and_hands_the_loop_back():
    h = Harness(spin=True)
    frames = ["a frame"]
    err = ValueError("a turn failed")
    stop = Stop()
    watched = [Owner.THREAD, Owner.DRIVER, Owner.LINGER, Why.AWAITED, Why.NOTHING_DUE,
               h.strategy, frames, err, stop, h.loop]
    try:
        def paths() -> None:
            h.why, h.spin_gives, h.turn_raises, h.spin_raises = Why.AWAITED, None, None, None
            assert h.loop.drive(_after(3))  # reached, spinning
            h.spin_gives = frames
            assert h.loop.drive(_after(2)) and h.taken.pop() is frames  # handed on
            h.spin_gives = None
            h.why = Why.NOTHING_DUE
            assert not h.loop.drive(_after(10**9))  # nothing expected: given up
            h.why = Why.IN_FLIGHT
            h.turn_raises = err  # an Exception: logged, the drive goes on
            h.spin_raises = err
            assert h.loop.drive(_after(3)) and h.errors and set(map(id, h.errors)) == {id(err)}
            h.errors.clear()
            h.why = Why.AWAITED
            assert h.loop.drive(_after(3)) and h.errors and set(map(id, h.errors)) == {id(err)}
            h.errors.clear()
            h.turn_raises = h.spin_raises = stop  # no Exception: out of the drive
            h.why = Why.IN_FLIGHT
            with pytest.raises(Stop):
                h.loop.drive(_after(10**9))
            h.why = Why.AWAITED
            with pytest.raises(Stop):
                h.loop.drive(_after(10**9))
            assert h.loop.owner is Owner.THREAD and h.loop.driver is None
            assert not _core.turning()
        paths()
        h.errors.clear()
        gc.collect()
        before = [sys.getrefcount(o) for o in watched]
        for _ in range(300):
            paths()
        gc.collect()
        assert [sys.getrefcount(o) for o in watched] == before
        h.turn_raises = None
        assert h.loop.turn() is False  # the baton is free
        assert h.loop.drives > 0 and h.loop.spins > 0 and h.loop.driven_turns > 0
    finally:
        h.close()


def test_a_drive_refuses_inside_a_guarded_section_on_the_progress_thread_and_beside_a_driver():
    h = Harness()
    try:
        outer = _core.guard()
        assert not h.loop.drive(lambda: True) and h.loop.drives == 0
        _core.unguard(outer)
        h.loop.thread_ident = threading.get_ident()
        assert not h.loop.drive(lambda: True)
        h.loop.thread_ident = None
        assert h.loop.hand(Owner.DRIVER, 12345)  # another thread drives
        assert not h.loop.drive(lambda: True)
        assert h.loop.hand(Owner.THREAD)
        h.why = Why.NOTHING_DUE  # reached, nothing more expected: it lingers
        assert h.loop.drive(lambda: True) and h.loop.owner is Owner.LINGER
        assert h.loop.hand(Owner.STOPPED) and h.loop.stopping
        assert not h.loop.drive(lambda: True)
    finally:
        h.close()


def test_done_raising_ends_the_drive_with_its_error_and_the_loop_handed_back():
    h = Harness()
    try:
        def done() -> bool:
            raise LookupError("done() failed")
        # A cold type cache: the guard's attribute, looked up with the error
        # pending, once cleared that error (a drive then returned NULL with
        # none set), whether it did depending on what ran before.
        sys._clear_type_cache()
        with pytest.raises(LookupError, match="done"):
            h.loop.drive(done)
        assert h.loop.owner is Owner.THREAD and not _core.turning()
        assert h.loop.turn() is False
    finally:
        h.close()


@pytest.mark.parametrize("bad, message", [
    (dict(owners=OWNERS[:3]), "owners is a tuple of 4"),
    (dict(moves={}), "no moves for"),
    (dict(spin_s="x"), "must be real number"),
    (dict(on_taken=None), "a spin needs its on_taken"),
    (dict(nonsense=1), "unexpected or repeated argument 'nonsense'"),
])
def test_bad_arguments_are_named(bad, message):
    fd = os.eventfd(0)
    args = dict(owners=OWNERS, moves=_MOVES, awaited=Why.AWAITED, polls=POLLS,
                progress=lambda: None, turn=lambda: False, expected=lambda o: Why.QUIET,
                pending=lambda: False, quiet=lambda: True, spin=lambda *a: (0, 0, 0.0, None),
                on_taken=lambda t: None, sleep=lambda n, t: False, on_error=lambda e: None,
                strategy=Polling(), wake_fd=fd, park_fd=fd, linger_fd=fd, spin_s=1.0,
                spin_chunk_s=1e-4, linger_s=0.002, sleep_s=0.1)
    args.update(bad)
    try:
        with pytest.raises((TypeError, ValueError), match=message):
            _core.Loop(**args)
        args.pop("nonsense", None)
        args.pop("sleep_s")
        with pytest.raises(TypeError, match="missing argument 'sleep_s'"):
            _core.Loop(**args)
    finally:
        os.close(fd)


def test_a_ctrl_c_held_over_a_failed_drive_is_raised_with_the_failure_as_its_context():
    # A Python `finally:` that raises keeps what it interrupted as the new
    # error's __context__; the drive delivers a Ctrl-C held meanwhile in
    # place of its own error, and must not lose that error (the Outlet's
    # send keeps it the same way).
    h = Harness()
    guard = progress._sigint
    saved = guard.held, guard._previous
    try:
        def done() -> bool:
            guard.held = (signal.SIGINT, None)  # a Ctrl-C while the guard holds it
            raise LookupError("done() failed")
        guard._previous = signal.default_int_handler
        with pytest.raises(KeyboardInterrupt) as caught:
            h.loop.drive(done)
        assert isinstance(caught.value.__context__, LookupError), caught.value.__context__
        assert "done() failed" in str(caught.value.__context__)
        assert guard.held is None  # delivered once
        assert h.loop.owner is Owner.THREAD and not _core.turning()
    finally:
        guard.held, guard._previous = saved
        h.close()
