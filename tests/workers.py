"""Run test code in worker processes: the one helper every multi-process test uses.

``run_workers(target, world_size)`` starts ``world_size`` processes, forked
from a server that imported torch once (the launcher's ``forkserver``
method: a fresh interpreter but for that import, which cost each child
about 2 s of CPU and the suite minutes), and calls ``target(rank,
world_size, init_method, *args)`` in each. All children share one deadline.
What each child returns comes back in rank order; what each child raises
comes back as its formatted traceback inside :class:`WorkerFailed`; a child
still running at the deadline has its Python stacks dumped and included in
:class:`WorkerTimeout`. Whatever happens, every child is terminated, then
killed, before ``run_workers`` returns or raises.

Starting, watching and stopping the processes is :mod:`ucxrpc._launch`'s
(the launcher the benchmark and the examples use too); what is the tests'
own lives here: the error types, the failure grace, and the stack dumps
(faulthandler in every child, on :data:`_DUMP_SIGNAL` from the parent).

Rules for targets (they run in a fresh interpreter, torch already imported):

* a target is a module-level function of an importable module (not a lambda,
  not a nested function, not a bound method);
* its arguments and its return value must pickle;
* environment for the child goes through ``env=``: it is set before the
  target's module is imported, so before any ``ucxx`` import (importing
  ``ucxx`` reads and sets ``UCX_*`` variables).

Ports come from :func:`free_port`, which binds port 0; never guess them.

Only the standard library and ``ucxrpc._launch`` (standard library only) are
imported here, so that a child's start-up costs what its target's module
costs beyond torch and nothing more.  Import the launcher with ``from
ucxrpc._launch import``: in a child, that finds the copy the launcher
loaded without importing the ``ucxrpc`` package (torch and ucxx).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ucxrpc._launch import (Outcome, Ranks, free_port, load_target, spawn, start, stop_process,
                            target_ref)

__all__ = [
    "FAILURE_GRACE_S",
    "WorkerError",
    "WorkerFailed",
    "WorkerTimeout",
    "child_pids",
    "forkserver_pid",
    "free_port",
    "run_with_victim",
    "run_workers",
    "spawn_worker",
    "stop_worker",
]

#: After one rank fails, how long the others get to finish or fail on their
#: own (a peer's failure usually makes them fail too, and their tracebacks
#: explain more) before they are stopped.
FAILURE_GRACE_S = 5.0

#: How children are made (ucxrpc._launch.START_METHODS).  "spawn" gives each
#: its own interpreter from scratch, as the benchmark's workers get.
START_METHOD = "forkserver"

# How long a signalled child gets to write its stacks.
_STACK_DUMP_WAIT_S = 1.0
_POLL_S = 0.05

# The signal on which children dump every thread's Python stack. UCX uses
# SIGHUP for its own debug dumps (UCX_DEBUG_SIGNO), so not that one.
_DUMP_SIGNAL = signal.SIGUSR1


class WorkerError(Exception):
    """Base of the errors :func:`run_workers` raises about its children."""


class WorkerFailed(WorkerError):
    """One or more ranks raised, crashed, or returned something unusable.

    Attributes:
        failures: rank -> what went wrong there (a formatted traceback, or a
            description of how the process ended), for every failed rank.
        stopped: rank -> dumped stacks (may be empty) of ranks that were
            still running when they were stopped because of the failures.
        results: rank -> value, for the ranks that returned normally.
    """

    def __init__(
        self,
        failures: Mapping[int, str],
        *,
        stopped: Mapping[int, str] | None = None,
        results: Mapping[int, object] | None = None,
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.stopped = dict(sorted((stopped or {}).items()))
        self.results = dict(sorted((results or {}).items()))
        parts = [f"rank(s) {sorted(self.failures)} failed"]
        if self.stopped:
            parts.append(f"rank(s) {sorted(self.stopped)} were still running and were stopped")
        lines = ["; ".join(parts)]
        for rank, text in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{text.rstrip()}")
        for rank, stacks in self.stopped.items():
            lines.append(f"--- rank {rank} (stopped) stacks ---\n{stacks.rstrip() or '(none dumped)'}")
        super().__init__("\n".join(lines))


class WorkerTimeout(WorkerError):
    """Ranks were still running when the shared deadline passed.

    Attributes:
        ranks: the ranks that were still running, ascending.
        stacks: rank -> the Python stacks of every thread of that rank, dumped
            just before it was stopped ('' if it could not dump them).
        timeout: the deadline, in seconds from the start.
        results: rank -> value, for the ranks that returned normally.
        failures: rank -> traceback, for ranks that failed before the deadline.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        stacks: Mapping[int, str],
        timeout: float,
        *,
        results: Mapping[int, object] | None = None,
        failures: Mapping[int, str] | None = None,
    ) -> None:
        self.ranks = sorted(ranks)
        self.stacks = dict(sorted(stacks.items()))
        self.timeout = timeout
        self.results = dict(sorted((results or {}).items()))
        self.failures = dict(sorted((failures or {}).items()))
        lines = [f"rank(s) {self.ranks} still running after the {timeout:g} s deadline"]
        for rank in self.ranks:
            text = self.stacks.get(rank, "").rstrip() or "(no stacks dumped)"
            lines.append(f"--- rank {rank} stacks ---\n{text}")
        for rank, text in self.failures.items():
            lines.append(f"--- rank {rank} failed ---\n{text.rstrip()}")
        super().__init__("\n".join(lines))


def run_workers(
    target: Callable[..., object],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    init_method: str | None = None,
) -> list[object]:
    """Run ``target(rank, world_size, init_method, *args)`` in ``world_size`` new processes.

    Args:
        target: a module-level function of an importable module.
        world_size: number of processes, ranks ``0 .. world_size - 1``.
        args: extra positional arguments, pickled once and given to every rank.
        timeout: one deadline, in seconds from the call, shared by all ranks:
            start-up, the target and process exit must all fit in it. Keep it
            below the test's pytest-timeout so this error, with its stacks,
            is the one reported.
        env: environment entries set in every child before the target's
            module is imported.
        init_method: rendezvous address passed to every rank; default
            ``tcp://127.0.0.1:{free_port()}``, fresh for each call.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        TypeError: ``target`` is not an importable module-level function.
        WorkerFailed: a rank raised, died, returned something that does not
            pickle, or did not exit after returning (a leaked non-daemon
            thread, say). Once one rank has failed, the others get
            :data:`FAILURE_GRACE_S` to finish before they are stopped.
        WorkerTimeout: ranks were still running at the deadline (their stacks
            are dumped into the error first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    module_name, qualname = target_ref(target)
    if init_method is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    # Pickled here and unpickled by _run_rank, after env is applied: the
    # launcher unpickles its own arguments before that.
    payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ucxrpc-workers-") as stack_dir:
        ranks = start(
            _run_rank,
            [(module_name, qualname, rank, world_size, init_method, payload, stack_dir)
             for rank in range(world_size)],
            env=env,
            names=[f"worker-rank{rank}" for rank in range(world_size)],
            method=START_METHOD,
        )
        with ranks:
            return _collect(ranks, deadline, timeout, Path(stack_dir))


def spawn_worker(
    target: Callable[..., object],
    *args: Any,
    env: dict[str, str] | None = None,
) -> BaseProcess:
    """Start one new process running ``target(*args)`` and return it at once.

    For tests that need to kill a worker (SIGKILL) mid-run or otherwise drive
    a process by hand. Nothing is collected from it: a raised exception is
    printed to the child's stderr and makes its exit code 1.

    The caller owns the process and MUST stop it in a ``finally``::

        proc = spawn_worker(serve, port, env={"UCX_TLS": "tcp"})
        try:
            ...
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            stop_worker(proc)

    Args:
        target: a module-level function of an importable module.
        *args: its arguments; they must pickle.
        env: environment entries set in the child before the target's module
            is imported.

    Raises:
        TypeError: ``target`` is not an importable module-level function.
    """
    module_name, qualname = target_ref(target)
    payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    return spawn(_run_single, (module_name, qualname, payload), env=env,
                 name=f"worker-{qualname}", method=START_METHOD)


def run_with_victim(victim: Callable[..., object], target: Callable[..., object],
                    world_size: int, *, args: tuple[Any, ...] = (),
                    timeout: float = 60.0, env: dict[str, str] | None = None) -> list[object]:
    """Run a job whose last rank is a process the test may kill.

    Ranks ``0 .. world_size - 2`` run ``target(rank, world_size - 1,
    init_method, *args)`` through :func:`run_workers` (so ``args`` usually
    carries the full world size); rank ``world_size - 1`` runs
    ``victim(rank, world_size, init_method)`` as a :func:`spawn_worker`
    process on the same rendezvous, stopped in ``finally``.  ``env`` goes to
    every process.  Returns the other ranks' results.
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_worker(victim, world_size - 1, world_size, init_method, env=env)
    try:
        return run_workers(target, world_size - 1, args=args, init_method=init_method,
                           timeout=timeout, env=env)
    finally:
        stop_worker(proc)


#: Stop a :func:`spawn_worker` process: SIGTERM (and SIGCONT, should it be
#: stopped), then SIGKILL after a grace, then reap it; idempotent.
stop_worker = stop_process


def forkserver_pid() -> int | None:
    """The pid of the server :data:`START_METHOD` forks workers from, or
    None before it started: the workers' parent, a helper that lives as
    long as this process."""
    from multiprocessing import forkserver

    pid: int | None = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid


def child_pids(pid: int | None = None) -> list[int]:
    """Return the pids of live (non-zombie) child processes of ``pid`` (default: this process).

    Reads /proc; on a system without it, falls back to the multiprocessing
    children of this process.
    """
    me = os.getpid() if pid is None else pid
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        return sorted(p.pid for p in multiprocessing.active_children() if p.pid is not None)
    found = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # The command name is in parentheses and may contain spaces.
        fields = stat[stat.rfind(")") + 2:].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


# --------------------------------------------------------------------------
# Parent side.


def _collect(ranks: Ranks, deadline: float, timeout: float, stack_dir: Path) -> list[object]:
    """Wait for every rank's report and exit; raise if any failed or the deadline passed."""
    outcomes = ranks.collect(max(0.0, deadline - time.monotonic()),
                             failure_grace=FAILURE_GRACE_S)
    results = {out.rank: out.value for out in outcomes if out.ok}
    failures = {out.rank: _with_own_stacks(out, stack_dir)
                for out in outcomes if out.error is not None}
    running = [out.rank for out in outcomes if out.running]
    if not running:
        if failures:
            raise WorkerFailed(failures, results=results)
        return [results[out.rank] for out in outcomes]
    unreported = [rank for rank in running if not outcomes[rank].reported]
    if time.monotonic() >= deadline:
        stacks = _dump_stacks(ranks.procs, running, stack_dir)
        if unreported:
            raise WorkerTimeout(unreported, stacks, timeout, results=results, failures=failures)
        # Every running rank returned but its process did not exit.
        for rank in running:
            failures[rank] = (
                "returned its result but its process did not exit before the deadline "
                "(a non-daemon thread or a hang at interpreter exit?); its stacks:\n"
                + (stacks.get(rank) or "(none dumped)")
            )
            results.pop(rank, None)
        raise WorkerFailed(failures, results=results)
    # The failure grace is over. Ranks that already returned are only slow
    # to exit; the others are stopped, with their stacks in the error.
    stopped = _dump_stacks(ranks.procs, unreported, stack_dir) if unreported else {}
    raise WorkerFailed(failures, stopped=stopped, results=results)


def _with_own_stacks(outcome: Outcome, stack_dir: Path) -> str:
    """A failed rank's error, with the stacks it wrote itself (faulthandler on
    a fatal signal: SIGSEGV, SIGABRT, ...), should there be any."""
    assert outcome.error is not None
    dumped = _read_stacks(stack_dir, outcome.rank)
    if dumped.strip():
        return outcome.error + "\nfaulthandler output:\n" + dumped
    return outcome.error


def _dump_stacks(procs: Sequence[BaseProcess], ranks: list[int], stack_dir: Path) -> dict[int, str]:
    """Ask the given ranks to dump their stacks and return what each wrote."""
    before = {rank: _stack_size(stack_dir, rank) for rank in ranks}
    for rank in ranks:
        pid = procs[rank].pid
        if pid is None:
            continue
        try:
            os.kill(pid, _DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    # faulthandler writes from the signal handler; wait until each file has
    # grown and stopped growing, or the wait is over.
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    sizes = dict(before)
    while time.monotonic() < end:
        time.sleep(_POLL_S)
        now_sizes = {rank: _stack_size(stack_dir, rank) for rank in ranks}
        if all(now_sizes[r] > before[r] and now_sizes[r] == sizes[r] for r in ranks):
            break
        sizes = now_sizes
    return {rank: _read_stacks(stack_dir, rank) for rank in ranks}


def _stack_file(stack_dir: Path | str, rank: int) -> Path:
    return Path(stack_dir) / f"rank{rank}.stacks"


def _stack_size(stack_dir: Path, rank: int) -> int:
    try:
        return _stack_file(stack_dir, rank).stat().st_size
    except OSError:
        return 0


def _read_stacks(stack_dir: Path, rank: int) -> str:
    try:
        return _stack_file(stack_dir, rank).read_text(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------
# Child side. These run in the spawned interpreter, after the launcher has
# tied it to its parent and applied ``env``.


def _run_rank(
    module_name: str,
    qualname: str,
    rank: int,
    world_size: int,
    init_method: str,
    payload: bytes,
    stack_dir: str,
) -> object:
    # Open for the life of the process (faulthandler keeps a reference): it
    # writes to it on a crash or on _DUMP_SIGNAL from the parent, also after
    # the target has returned.
    stack_file = open(_stack_file(stack_dir, rank), "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    target = load_target(module_name, qualname)
    return target(rank, world_size, init_method, *pickle.loads(payload))


def _run_single(module_name: str, qualname: str, payload: bytes) -> None:
    faulthandler.enable(all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    target = load_target(module_name, qualname)
    target(*pickle.loads(payload))
