"""Ctrl-C held back while the main thread is inside a turn of the loop.

A thread waiting for a reply may turn the progress loop itself
(:meth:`.progress.ProgressThread.drive`); when that thread is the main
thread, Python raises ``KeyboardInterrupt`` there at whatever bytecode it
is running, and a turn cut in half could lose a message it was handling
for another thread, or leave a counter it was updating wrong.  torch's
``rpc_sync`` waits in C++, where Ctrl-C waits for the reply; here it still
interrupts the wait, but only between two turns.

:class:`SigintGuard` replaces the Python-level SIGINT handler (only one
that is a Python callable: ``SIG_IGN``/``SIG_DFL`` are left alone) with one
that passes the signal on at once unless ``holding()`` says the main
thread is inside a turn; then it keeps it until :meth:`deliver`, called
after the turn, hands it to the handler it replaced.  Where the turn (a
drive, a send) failed meanwhile, the ``KeyboardInterrupt`` delivered
after it is raised in place of that error, with it as its
``__context__``, as a ``finally:`` that raises would leave it (loop.c's
``core_chain_over``).  Installing costs a
few µs, so it is done once per process while any loop uses it, not per
wait.  A handler the user installs later simply takes over.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

__all__ = ["SigintGuard"]


class SigintGuard:
    """Holds SIGINT while ``holding()`` is true in the main thread.

    :meth:`install` and :meth:`uninstall` are counted (one per loop that
    starts and closes) and act on the main thread only, as
    :func:`signal.signal` must; elsewhere they do nothing.
    """

    def __init__(self, holding: Callable[[], bool]) -> None:
        self._holding = holding
        self._lock = threading.Lock()
        self._users = 0
        self._previous: Callable[[int, FrameType | None], Any] | None = None
        #: The SIGINT held back (its handler's arguments), or None: a plain
        #: attribute, tested between every two turns of a drive.
        self.held: tuple[int, FrameType | None] | None = None

    def install(self) -> bool:
        """Take over SIGINT's Python handler if this is the main thread and
        that handler is a Python callable; returns whether this call counts
        (pass the result to :meth:`uninstall`)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with self._lock:
            if self._users == 0:
                previous = signal.getsignal(signal.SIGINT)
                if not callable(previous):
                    return False
                self._previous = previous
                signal.signal(signal.SIGINT, self._handler)
            self._users += 1
            return True

    def uninstall(self, counted: bool) -> bool:
        """Give SIGINT back to the handler replaced, once the last user is
        gone (if nobody replaced ours meanwhile); returns whether this
        call was counted off (False off the main thread: try again there)."""
        if not counted or threading.current_thread() is not threading.main_thread():
            return False
        with self._lock:
            self._users -= 1
            if self._users == 0:
                if signal.getsignal(signal.SIGINT) == self._handler:
                    signal.signal(signal.SIGINT, self._previous)
                self._previous = None
        return True

    def deliver(self) -> None:
        """Hand a held SIGINT to the replaced handler (which raises
        ``KeyboardInterrupt`` by default); cheap when none is held."""
        held, self.held = self.held, None
        if held is not None and self._previous is not None:
            self._previous(*held)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._holding():
            self.held = (signum, frame)
            return
        previous = self._previous
        if previous is not None:
            previous(signum, frame)
