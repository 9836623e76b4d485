"""The calls this worker made and waits for: their futures, by message id
and by peer, and their deadlines.

Thread-safety: every method may be called from any thread.  A future is
completed outside the table's locks, since its callbacks may make calls.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from .remote_errors import timeout_error

__all__ = ["Call", "CallTable"]


@dataclass
class Call:
    future: torch.futures.Future
    peer: int


class CallTable:
    """Outstanding calls, and the thread that fails them at their deadline."""

    def __init__(self, name: str) -> None:
        self._calls: dict[int, Call] = {}
        self._by_peer: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        # One FIFO per timeout value keeps deadlines sorted for free: a
        # deque append per call instead of a heap push.
        self._deadlines: dict[float, deque[tuple[float, int]]] = {}
        self._timer_cv = threading.Condition()
        self._closed = False
        self._timer = threading.Thread(target=self._expire, name=f"ucxrpc-timeouts-{name}",
                                       daemon=True)
        self.timeouts = 0

    def __len__(self) -> int:
        return len(self._calls)

    def start(self) -> None:
        self._timer.start()

    def add(self, msg_id: int, future: torch.futures.Future, peer: int) -> None:
        with self._lock:
            self._calls[msg_id] = Call(future, peer)
            self._by_peer.setdefault(peer, set()).add(msg_id)

    def arm(self, msg_id: int, timeout: float) -> None:
        """Fail call ``msg_id`` with torch's timeout error in ``timeout`` s,
        unless it is answered first."""
        # Under the timer's lock, which the timer thread takes to compact a
        # queue (see _expire).
        entry = (time.monotonic() + timeout, msg_id)
        with self._timer_cv:
            q = self._deadlines.get(timeout)
            if q is None:
                q = self._deadlines[timeout] = deque()
            q.append(entry)
            if len(q) == 1:
                self._timer_cv.notify()

    def armed(self) -> int:
        """Deadlines held (answered calls' entries included until dropped)."""
        return sum(len(q) for q in list(self._deadlines.values()))

    def pop(self, msg_id: int) -> Call | None:
        """Take call ``msg_id`` out (None: answered, failed or timed out)."""
        with self._lock:
            call = self._calls.pop(msg_id, None)
            if call is not None:
                peer_calls = self._by_peer.get(call.peer)
                if peer_calls is not None:
                    peer_calls.discard(msg_id)
        return call

    def fail(self, msg_id: int, exc: BaseException) -> None:
        call = self.pop(msg_id)
        if call is not None:
            call.future.set_exception(exc)

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        """Fail every call waiting on ``peer``."""
        with self._lock:
            ids = list(self._by_peer.pop(peer, ()))
        for msg_id in ids:
            self.fail(msg_id, exc)

    def close(self, exc: BaseException) -> None:
        """Stop the timer and fail what is left with ``exc``; idempotent."""
        self._closed = True
        with self._timer_cv:
            self._timer_cv.notify()
        for msg_id in list(self._calls):
            self.fail(msg_id, exc)

    def _expire(self) -> None:
        """Fail calls whose deadline passed; forget answered ones.

        An answered call's entry would otherwise stay until its deadline:
        at 20k calls/s with the 60 s default, over a million entries.  So
        answered entries at a queue's head go at once, and a queue that
        holds far more entries than calls are outstanding (answered calls
        queued behind a slow one) is rebuilt without them.
        """
        while not self._closed:
            expired: list[tuple[int, float]] = []
            with self._timer_cv:
                now = time.monotonic()
                wait = 1.0
                calls = self._calls
                for timeout, q in list(self._deadlines.items()):
                    while q and (q[0][0] <= now or q[0][1] not in calls):
                        _, msg_id = q.popleft()
                        if msg_id in calls:
                            expired.append((msg_id, timeout))
                    if len(q) > 2 * len(calls) + 1024:
                        q = self._deadlines[timeout] = deque(e for e in q if e[1] in calls)
                    if q:
                        # Capped: answered entries are dropped soon too.
                        wait = min(wait, q[0][0] - now, 0.1)
                if not expired:
                    self._timer_cv.wait(max(wait, 0.0))
            # Failed outside the lock: a future's callbacks may make calls.
            for msg_id, timeout in expired:
                if msg_id in calls:
                    self.timeouts += 1
                    self.fail(msg_id, timeout_error(timeout))
