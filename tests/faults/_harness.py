"""Parent-side helper: a job whose last rank is a victim the test may kill or stop.

Like :func:`tests.workers.run_with_victim`, but the victim is SIGKILLed
first in cleanup: a SIGSTOPped victim ignores the SIGTERM that
:func:`tests.workers.stop_worker` starts with, until it is continued.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

from tests.workers import free_port, run_workers, spawn_worker, stop_worker


def run_with_victim(victim: Callable[..., object], target: Callable[..., object],
                    world_size: int, *, args: tuple[Any, ...] = (),
                    timeout: float = 60.0) -> list[object]:
    """Ranks ``0 .. world_size - 2`` run ``target(rank, world_size - 1,
    init_method, *args)`` through :func:`run_workers`; the last rank runs
    ``victim(rank, world_size, init_method)`` in a process killed in
    ``finally``, whatever state it is in.  Returns the other ranks' results.
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_worker(victim, world_size - 1, world_size, init_method)
    try:
        return run_workers(target, world_size - 1, args=args, init_method=init_method,
                           timeout=timeout)
    finally:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)  # works on a stopped process too
            except ProcessLookupError:
                pass
        stop_worker(proc)
