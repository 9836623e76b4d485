"""Run test code in worker processes: the one helper every multi-process test uses.

``run_workers(target, world_size)`` starts ``world_size`` processes with the
*spawn* start method and calls ``target(rank, world_size, init_method, *args)``
in each. All children share one deadline. What each child returns comes back
in rank order; what each child raises comes back as its formatted traceback
inside :class:`WorkerFailed`; a child still running at the deadline has its
Python stacks dumped and included in :class:`WorkerTimeout`. Whatever happens,
every child is terminated, then killed, before ``run_workers`` returns or
raises.

Rules for targets (they run in a fresh interpreter):

* a target is a module-level function of an importable module (not a lambda,
  not a nested function, not a bound method);
* its arguments and its return value must pickle;
* environment for the child goes through ``env=``: it is set before the
  target's module is imported, so before any ``ucxx`` import (importing
  ``ucxx`` reads and sets ``UCX_*`` variables).

Ports come from :func:`free_port`, which binds port 0; never guess them.

Only the standard library is imported here, so that a child's start-up costs
what its target's module costs and nothing more.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

__all__ = [
    "FAILURE_GRACE_S",
    "WorkerError",
    "WorkerFailed",
    "WorkerTimeout",
    "child_pids",
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

# How long a signalled child gets to write its stacks, and how long terminate
# gets before kill.
_STACK_DUMP_WAIT_S = 1.0
_TERMINATE_WAIT_S = 1.0
_POLL_S = 0.05

# The signal on which children dump every thread's Python stack. UCX uses
# SIGHUP for its own debug dumps (UCX_DEBUG_SIGNO), so not that one.
_DUMP_SIGNAL = signal.SIGUSR1

_OK = "ok"
_ERROR = "error"


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


def free_port(host: str = "127.0.0.1") -> int:
    """:func:`ucxrpc.rendezvous.free_port`, imported only when called: this
    module is imported by every rank it starts, which must reach its target
    without loading torch.distributed first (test_workers_helper's deadlines)."""
    from ucxrpc.rendezvous import free_port as port

    return port(host)


def run_workers(
    target: Callable[..., object],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    init_method: str | None = None,
) -> list[object]:
    """Run ``target(rank, world_size, init_method, *args)`` in ``world_size`` spawned processes.

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
    module_name, qualname = _target_ref(target)
    if init_method is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    deadline = time.monotonic() + timeout
    ctx = multiprocessing.get_context("spawn")
    results_queue = ctx.Queue()
    procs: list[BaseProcess] = []
    with tempfile.TemporaryDirectory(prefix="ucxrpc-workers-") as stack_dir:
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_run_rank,
                    args=(module_name, qualname, rank, world_size, init_method,
                          payload, dict(env or {}), results_queue, stack_dir),
                    name=f"worker-rank{rank}",
                )
                proc.start()
                procs.append(proc)
            return _collect(procs, results_queue, deadline, timeout, Path(stack_dir))
        finally:
            for proc in procs:
                stop_worker(proc)
            results_queue.close()
            results_queue.join_thread()


def spawn_worker(
    target: Callable[..., object],
    *args: Any,
    env: dict[str, str] | None = None,
) -> BaseProcess:
    """Start one spawned process running ``target(*args)`` and return it at once.

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
    module_name, qualname = _target_ref(target)
    payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_run_single,
        args=(module_name, qualname, payload, dict(env or {})),
        name=f"worker-{qualname}",
    )
    proc.start()
    return proc


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


def stop_worker(proc: BaseProcess, timeout: float = _TERMINATE_WAIT_S) -> None:
    """Stop ``proc``: SIGTERM (and SIGCONT, should it be stopped), wait up to
    ``timeout`` s, then SIGKILL and reap it.

    Idempotent; safe on a process that has already exited or never started.
    """
    if proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        try:  # a stopped process (SIGSTOP) takes the SIGTERM only once continued
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)
    else:
        proc.join(0)


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


def _target_ref(target: Callable[..., object]) -> tuple[str, str]:
    """Return (module, qualname) for ``target`` after checking a child can import it."""
    module_name = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname or "." in qualname:
        raise TypeError(
            f"worker target must be a module-level function of an importable module, got {target!r}"
        )
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    if getattr(module, qualname, None) is not target:
        raise TypeError(
            f"worker target {module_name}.{qualname} is not reachable by that name; "
            "use a module-level function"
        )
    return module_name, qualname


def _collect(
    procs: list[BaseProcess],
    results_queue: Any,
    deadline: float,
    timeout: float,
    stack_dir: Path,
) -> list[object]:
    """Wait for every rank's report and exit; raise if any failed or the deadline passed."""
    world_size = len(procs)
    results: dict[int, object] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()
    failed_at: float | None = None

    def drain(wait: float) -> None:
        # The first get waits up to `wait`; whatever else is queued is taken
        # without waiting.
        while True:
            try:
                rank, status, data = results_queue.get(timeout=wait)
            except queue_module.Empty:
                return
            wait = 0.0
            reported.add(rank)
            if status == _OK:
                try:
                    results[rank] = pickle.loads(data)
                except Exception:
                    failures[rank] = "its return value could not be unpickled here:\n" + traceback.format_exc()
            else:
                failures[rank] = data

    while True:
        now = time.monotonic()
        drain(max(0.0, min(_POLL_S, deadline - now)))
        for rank, proc in enumerate(procs):
            if proc.is_alive() or proc.exitcode is None:
                continue
            if rank not in reported:
                drain(0.5)  # a report written just before exit may still be in the pipe
            if rank not in reported:
                reported.add(rank)
                failures[rank] = _describe_exit(proc, "without reporting a result", stack_dir, rank)
            elif proc.exitcode != 0 and rank not in failures:
                failures[rank] = _describe_exit(proc, "after returning its result", stack_dir, rank)
                results.pop(rank, None)
        if failures and failed_at is None:
            failed_at = time.monotonic()
        running = [r for r, p in enumerate(procs) if p.is_alive()]
        if not running:
            break
        now = time.monotonic()
        if now >= deadline:
            stacks = _dump_stacks(procs, running, stack_dir)
            unreported = [r for r in running if r not in reported]
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
            break
        if failed_at is not None and now >= failed_at + FAILURE_GRACE_S:
            # Ranks that already returned are only slow to exit; the others
            # are stopped, with their stacks in the error.
            unreported = [r for r in running if r not in reported]
            stopped = _dump_stacks(procs, unreported, stack_dir) if unreported else {}
            raise WorkerFailed(failures, stopped=stopped, results=results)

    if failures:
        raise WorkerFailed(failures, results=results)
    return [results[rank] for rank in range(world_size)]


def _describe_exit(proc: BaseProcess, what: str, stack_dir: Path, rank: int) -> str:
    code = proc.exitcode
    assert code is not None
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    text = f"process {how} {what}"
    dumped = _read_stacks(stack_dir, rank)
    if dumped.strip():
        text += "\nfaulthandler output:\n" + dumped
    return text


def _dump_stacks(procs: list[BaseProcess], ranks: list[int], stack_dir: Path) -> dict[int, str]:
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
# Child side. These run in the spawned interpreter.


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux only).

    Covers the case no ``finally`` can: the test runner itself being killed.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _prepare_child(env: Mapping[str, str]) -> None:
    _die_with_parent()
    os.environ.update(env)


def _load_target(module_name: str, qualname: str) -> Callable[..., object]:
    module = importlib.import_module(module_name)
    target: Callable[..., object] = getattr(module, qualname)
    return target


def _run_rank(
    module_name: str,
    qualname: str,
    rank: int,
    world_size: int,
    init_method: str,
    payload: bytes,
    env: Mapping[str, str],
    results_queue: Any,
    stack_dir: str,
) -> None:
    _prepare_child(env)
    # Kept open for the life of the process: faulthandler writes to its fd
    # on a crash or on _DUMP_SIGNAL from the parent.
    stack_file = open(_stack_file(stack_dir, rank), "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    try:
        target = _load_target(module_name, qualname)
        args = pickle.loads(payload)
        value = target(rank, world_size, init_method, *args)
        try:
            message = (rank, _OK, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            message = (rank, _ERROR, "its return value does not pickle:\n" + traceback.format_exc())
    except BaseException:
        message = (rank, _ERROR, traceback.format_exc())
    results_queue.put(message)
    # Process exit joins the queue's feeder thread, so the message is in the
    # pipe before the parent sees this process end.
    if message[1] == _ERROR:
        sys.exit(1)


def _run_single(module_name: str, qualname: str, payload: bytes, env: Mapping[str, str]) -> None:
    _prepare_child(env)
    faulthandler.enable(all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    target = _load_target(module_name, qualname)
    target(*pickle.loads(payload))
