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

Rules for targets, and for a group's setups and scenarios (they run in a
fresh interpreter, torch already imported):

* a target is a module-level function of an importable module (not a lambda,
  not a nested function, not a bound method);
* its arguments and its return value must pickle;
* environment for the child goes through ``env=``: it is set before the
  target's module is imported, so before any ``ucxx`` import (importing
  ``ucxx`` reads and sets ``UCX_*`` variables).

Ports come from :func:`free_port`, which binds port 0; never guess them.

``worker_group(setup, world_size)`` is the same start, once for a whole
test module: a pytest fixture whose :class:`WorkerGroup` keeps its ranks up
(``setup``, a generator function, brings each up before its ``yield`` and
down after it) and runs one scenario per test on rank 0,
``group.run(scenario, *args)``: a test module of a dozen scenarios pays
one start-up, not a dozen.  A scenario that raises fails its test with its
traceback; a rank that dies, or a scenario still running at its deadline
(its stacks are dumped first), fails it too; after any of those the next
scenario gets a freshly started group, so one failure hides nothing and
leaks into nothing.  ``check=``, run on rank 0 after each scenario that
passed, fails a scenario that left the group unfit for the next one.

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
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from multiprocessing.connection import (Client, Connection, answer_challenge,
                                        deliver_challenge)
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ucxrpc._launch import (Outcome, Ranks, free_port, load_target, spawn, start, stop_process,
                            target_ref)

__all__ = [
    "FAILURE_GRACE_S",
    "ScenarioFailed",
    "WorkerError",
    "WorkerFailed",
    "WorkerGroup",
    "WorkerTimeout",
    "child_pids",
    "forkserver_pid",
    "free_port",
    "run_with_victim",
    "run_workers",
    "spawn_worker",
    "stop_worker",
    "worker_group",
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


def thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``/proc``: R, S, T ...)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread exited meanwhile
        # The command name is in parentheses and may contain spaces.
        states.append(stat[stat.rfind(")") + 2:].split()[0])
    return states


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it is stopped.

    ``kill`` returns when the signal is queued, not when the process stops:
    the kernel wakes one thread to take it, and only that thread stops the
    others.  On a loaded machine that takes tens of milliseconds (18 ms
    measured on the 2-core VM beside four busy processes), during which a
    running thread, a spinning progress thread above all, still answers.
    A test whose premise is "the peer is stopped" waits for it here.
    """
    os.kill(pid, signal.SIGSTOP)
    if not Path(f"/proc/{pid}/task").is_dir():
        return  # no /proc: nothing to wait on
    deadline = time.monotonic() + timeout
    while True:
        states = thread_states(pid)
        if all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} not stopped {timeout:g} s after SIGSTOP: "
                               f"its threads' states are {states}")
        time.sleep(0.001)


# --------------------------------------------------------------------------
# A group of ranks kept up across the tests of a module.


class ScenarioFailed(WorkerError):
    """A scenario raised on rank 0 (or passed and then failed the group's
    check); the ranks are still up.

    Attributes:
        scenario: the scenario's name.
        text: what rank 0 reported: the formatted traceback.
    """

    def __init__(self, scenario: str, text: str, *, after: bool = False) -> None:
        self.scenario = scenario
        self.text = text
        what = ("passed, then the group's check failed: it left the group unfit for the "
                "next scenario" if after else "failed on rank 0")
        super().__init__(f"scenario {scenario} {what}\n--- rank 0 ---\n{text.rstrip()}")


class WorkerGroup:
    """``world_size`` ranks started once and kept up, running scenarios on rank 0.

    Each rank runs ``setup(rank, world_size, init_method, *args)``, a
    generator function that yields once: before the ``yield`` it brings the
    rank up (``init_rpc``, say), after it it takes the rank down
    (``rpc.shutdown()``).  Between the two, rank 0 runs what :meth:`run`
    sends it, one scenario at a time, on its main thread; the other ranks
    wait (their agents serve on their own threads).  The ranks are started
    as :func:`run_workers` starts them (forked from the forkserver, ``env``
    applied first, faulthandler on, tied to this process) under one shared
    start-up deadline, and stopped by pid whatever happens.

    After a scenario fails (raised, failed ``check``, killed a rank, or
    hung past its deadline) the ranks are stopped and the next :meth:`run`
    starts a fresh group: one failure neither hides nor taints the next
    scenario.  A group that could not start is not started again: every
    later :meth:`run` raises that first failure at once.

    Args:
        setup: a module-level generator function of an importable module.
        world_size: number of ranks, ``0 .. world_size - 1``.
        args: extra arguments for ``setup``; they must pickle.
        env: environment entries set in every rank before ``setup``'s module
            is imported.
        check: a module-level function run on rank 0 with no arguments after
            each scenario that passed; if it raises, that scenario fails
            (:class:`ScenarioFailed`) and the group is started afresh.
        start_timeout: the deadline, in seconds, shared by all ranks to be
            up (``setup`` run to its ``yield``).
        stop_timeout: the deadline, in seconds, for all ranks to run the
            rest of ``setup`` and exit at :meth:`close`.
    """

    def __init__(self, setup: Callable[..., Generator[object, None, None]], world_size: int, *,
                 args: tuple[Any, ...] = (), env: dict[str, str] | None = None,
                 check: Callable[[], object] | None = None, start_timeout: float = 45.0,
                 stop_timeout: float = 30.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._setup = target_ref(setup)
        self._check = None if check is None else target_ref(check)
        self.world_size = world_size
        self._args = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
        self._env = env
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._ranks: Ranks | None = None
        self._conns: list[Connection] = []
        self._listener: socket.socket | None = None
        self._stack_dir: tempfile.TemporaryDirectory[str] | None = None
        self._start_failure: WorkerError | None = None
        #: How many times ranks were started (a restart after a failure counts).
        self.starts = 0

    # -- the parent's calls

    @property
    def pids(self) -> list[int | None]:
        """The ranks' pids, in rank order; empty while no group is up."""
        return [] if self._ranks is None else [p.pid for p in self._ranks.procs]

    def run(self, scenario: Callable[..., object], *args: Any, timeout: float = 60.0) -> object:
        """Run ``scenario(*args)`` on rank 0 and return what it returned.

        Starts the group first if it is not up (the first scenario, or the
        one after a failure).

        Args:
            scenario: a module-level function of an importable module.
            args: its arguments; they and its return value must pickle.
            timeout: seconds the scenario (and the group's check) may run.

        Raises:
            ScenarioFailed: it raised on rank 0, or the check failed after it.
            WorkerFailed: a rank died meanwhile, or the group did not start.
            WorkerTimeout: it was still running at the deadline (the stacks
                of every rank are in the error).
        """
        ref = target_ref(scenario)
        payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
        if self._start_failure is not None:
            raise self._start_failure
        if self._ranks is None:
            self._start()
        deadline = time.monotonic() + timeout
        try:
            status, data = self._ask(ref, payload, deadline, timeout)
            if status == _ERROR:
                raise ScenarioFailed(ref[1], data)
            value = pickle.loads(data)
            if self._check is not None:
                status, data = self._ask(self._check, pickle.dumps(()), deadline, timeout)
                if status == _ERROR:
                    raise ScenarioFailed(ref[1], data, after=True)
            return value
        except BaseException:
            self._kill()  # the next scenario gets a fresh group
            raise

    def close(self) -> None:
        """Take every rank down through the rest of ``setup`` and stop them.

        Idempotent.  Raises :class:`WorkerFailed` (or :class:`WorkerTimeout`)
        when a rank failed on its way down; the processes are stopped anyway.
        """
        if self._ranks is None:
            return
        ranks, stack_dir = self._ranks, self._stack_dir
        assert stack_dir is not None
        try:
            for conn in self._conns:
                try:
                    conn.send((_STOP,))
                except OSError:
                    pass  # that rank is gone: its outcome says why
            _collect(ranks, time.monotonic() + self._stop_timeout, self._stop_timeout,
                     Path(stack_dir.name))
        finally:
            self._kill()

    # -- inside

    def _start(self) -> None:
        self.starts += 1
        authkey = os.urandom(16)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._stack_dir = tempfile.TemporaryDirectory(prefix="ucxrpc-group-")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        module_name, qualname = self._setup
        try:
            self._ranks = start(
                _serve_rank,
                [(module_name, qualname, rank, self.world_size, init_method, self._args,
                  self._stack_dir.name, self._listener.getsockname(), authkey)
                 for rank in range(self.world_size)],
                env=self._env,
                names=[f"group-rank{rank}" for rank in range(self.world_size)],
                method=START_METHOD,
            )
            self._conns = self._await_ready(authkey, time.monotonic() + self._start_timeout)
        except WorkerError as exc:
            self._start_failure = exc
            self._kill()
            raise
        except BaseException:
            self._kill()
            raise

    def _await_ready(self, authkey: bytes, deadline: float) -> list[Connection]:
        """Every rank's connection, in rank order, once each said it is up
        (as multiprocessing's Listener accepts, with a deadline)."""
        assert self._ranks is not None and self._stack_dir is not None
        assert self._listener is not None
        conns: dict[int, Connection] = {}
        while len(conns) < self.world_size:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                pass
            else:
                sock.setblocking(True)
                conn = Connection(sock.detach())
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    conns[conn.recv()] = conn
                else:
                    conn.close()
            self._ranks.poll()
            if any(out.error is not None or not out.running for out in self._ranks.outcomes):
                self._raise_broken("while starting")
            if time.monotonic() >= deadline:
                waiting = [r for r in range(self.world_size) if r not in conns]
                stacks = _dump_stacks(self._ranks.procs, waiting, Path(self._stack_dir.name))
                for conn in conns.values():
                    conn.close()
                raise WorkerTimeout(waiting, stacks, self._start_timeout)
        return [conns[rank] for rank in range(self.world_size)]

    def _ask(self, ref: tuple[str, str], payload: bytes, deadline: float,
             timeout: float) -> tuple[str, Any]:
        """Have rank 0 run ``ref`` and return its (status, data) reply."""
        assert self._ranks is not None and self._stack_dir is not None
        conn = self._conns[0]
        try:
            conn.send((_RUN, ref[0], ref[1], payload))
        except OSError:
            self._raise_broken(f"when asked to run {ref[1]}")
        gone = False
        while True:
            if gone:
                time.sleep(_POLL_S)
            else:
                try:
                    if conn.poll(_POLL_S):
                        reply: tuple[str, Any] = conn.recv()
                        return reply
                except (EOFError, OSError):
                    gone = True  # rank 0 is gone: its outcome will say why
            self._ranks.poll()
            if any(out.error is not None or not out.running for out in self._ranks.outcomes):
                self._raise_broken(f"while running {ref[1]}")
            if time.monotonic() >= deadline:
                stacks = _dump_stacks(self._ranks.procs, list(range(self.world_size)),
                                      Path(self._stack_dir.name))
                raise WorkerTimeout([0], stacks, timeout)

    def _raise_broken(self, when: str) -> None:
        """Raise :class:`WorkerFailed` for a group a rank of which ended or failed."""
        assert self._ranks is not None and self._stack_dir is not None
        outcomes = self._ranks.collect(FAILURE_GRACE_S, failure_grace=0.0)
        stack_dir = Path(self._stack_dir.name)
        failures = {out.rank: f"({when}) " + (_with_own_stacks(out, stack_dir)
                                               if out.error is not None else
                                               f"process exited with code {out.exitcode}")
                    for out in outcomes if out.error is not None or not out.running}
        running = [out.rank for out in outcomes if out.running]
        stopped = _dump_stacks(self._ranks.procs, running, stack_dir) if running else {}
        raise WorkerFailed(failures, stopped=stopped)

    def _kill(self) -> None:
        """Stop every rank by pid and drop the group (idempotent)."""
        ranks, self._ranks = self._ranks, None
        conns, self._conns = self._conns, []
        listener, self._listener = self._listener, None
        stack_dir, self._stack_dir = self._stack_dir, None
        try:
            if ranks is not None:
                ranks.stop()
        finally:
            for conn in conns:
                conn.close()
            if listener is not None:
                listener.close()
            if stack_dir is not None:
                stack_dir.cleanup()


def worker_group(setup: Callable[..., Generator[object, None, None]], world_size: int, *,
                 args: tuple[Any, ...] = (), env: dict[str, str] | None = None,
                 check: Callable[[], object] | None = None, start_timeout: float = 45.0,
                 stop_timeout: float = 30.0) -> Any:
    """A module-scoped pytest fixture giving a :class:`WorkerGroup`.

    Assign it to a module-level name; that name is the fixture's::

        ranks = worker_group(_two_rpc_workers, 2)

        def test_a_call_comes_back(ranks):
            assert ranks.run(_call_and_check) == 3

    The ranks start when the module's first scenario runs and are taken
    down (the rest of ``setup``) after its last test; a failure there is an
    error of that test.  The arguments are :class:`WorkerGroup`'s.  Tests
    using it start processes: mark them ``processes``.
    """
    import pytest  # here: a worker imports this module, and needs no pytest

    @pytest.fixture(scope="module")
    def group() -> Iterator[WorkerGroup]:
        workers = WorkerGroup(setup, world_size, args=args, env=env, check=check,
                              start_timeout=start_timeout, stop_timeout=stop_timeout)
        try:
            yield workers
        finally:
            workers.close()

    return group


# --------------------------------------------------------------------------
# Parent side: outcomes and stacks.


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


_RUN = "run"
_STOP = "stop"
_OK = "ok"
_ERROR = "error"


def _serve_rank(
    module_name: str,
    qualname: str,
    rank: int,
    world_size: int,
    init_method: str,
    payload: bytes,
    stack_dir: str,
    address: tuple[str, int],
    authkey: bytes,
) -> None:
    """One rank of a :class:`WorkerGroup`: up, serve the parent's requests, down."""
    stack_file = open(_stack_file(stack_dir, rank), "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    setup = load_target(module_name, qualname)
    steps = setup(rank, world_size, init_method, *pickle.loads(payload))
    next(steps)  # up
    with Client(address, authkey=authkey) as conn:
        conn.send(rank)
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return  # the parent is gone, and this process with it
            if message[0] == _STOP:
                break
            _, scenario_module, scenario_name, scenario_payload = message
            try:
                scenario = load_target(scenario_module, scenario_name)
                value = scenario(*pickle.loads(scenario_payload))
                reply = (_OK, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            except BaseException:
                reply = (_ERROR, traceback.format_exc())
            conn.send(reply)
    try:  # down
        next(steps)
    except StopIteration:
        return
    raise RuntimeError(f"{module_name}.{qualname} must yield exactly once")


def _run_single(module_name: str, qualname: str, payload: bytes) -> None:
    faulthandler.enable(all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    target = load_target(module_name, qualname)
    target(*pickle.loads(payload))
