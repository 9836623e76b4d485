"""Start rank processes, watch them, stop them: the one launcher of the tests,
the benchmark and the examples.

Private (``_launch``): it is the harness of ucxrpc's own programs, not part
of the ``torch.distributed.rpc`` surface ucxrpc mirrors; user jobs start
under torchrun or their own launcher.  torch's
``torch.distributed.elastic.multiprocessing.start_processes`` is not used:
it imports torch (seconds of start-up for a child whose target needs none),
and it neither reports a rank's return value nor ties children to the
parent's death.

Contract:

* :func:`start` runs ``target(*args[r])`` for every rank ``r`` in a process
  of its own, made with the *spawn* start method (no inherited threads, UCX
  or CUDA state), and returns a :class:`Ranks` that owns them;
  :func:`spawn` does the same for one process whose result nobody collects.
  ``target`` is a module-level function of an importable module.
* ``method="forkserver"`` forks each child from a server that imported
  :data:`FORKSERVER_PRELOAD` (torch) once, instead: about 2 s less CPU a
  child, for callers that start many (the tests).  Importing torch touches
  no GPU and starts only numpy's BLAS pool, which its fork handlers remake
  in a child, so such a child is as fresh as a spawned one, minus that
  import; it gets the environment the caller has at the start, as a
  spawned child does, not the server's.
* ``env`` is applied in the child before the target's module is imported
  (importing ``ucxx`` reads ``UCX_*``).  ``args`` are unpickled before that,
  at the child's start: keep them free of objects whose module must see
  ``env`` (pickle such arguments to bytes yourself).
* A child dies with its parent: the kernel SIGKILLs it when the thread that
  started it is gone (``PR_SET_PDEATHSIG``, Linux), so even a parent killed
  by SIGKILL leaves no orphan; a forked child, whose parent is the server,
  when the process that started it has ended (a pidfd it waits on).  With
  ``lifetime`` it also exits (code
  :data:`LIFETIME_EXIT_CODE`) that many seconds after it was started.
* Every wait is bounded by a timeout given in seconds (``None``: no limit).
* Processes are stopped by pid, never by name: SIGTERM (with SIGCONT, for a
  stopped one), then SIGKILL after a grace, then reaped.  Stopping is
  idempotent and never raises.
* :meth:`Ranks.collect` gives each rank's :class:`Outcome`: its return
  value, or why it failed (its traceback, or how its process ended), and its
  exit code.
* :func:`free_port` is the one place ports come from: the kernel picks them.

Only the standard library is imported here.  A child loads this file by its
path, not through ``import ucxrpc._launch``, because importing the package
runs ``ucxrpc/__init__.py`` (torch and the RPC stack, about 2 s) before the
target's own module and before ``env``.  The copy is registered as
``ucxrpc._launch``, so a target's module that does ``from ucxrpc._launch
import ...`` gets it without importing the package; ``import
ucxrpc._launch`` followed by attribute access would import the package and
then not find ``_launch`` on it, so write the ``from`` form.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import multiprocessing
import os
import pickle
import random
import queue as queue_module
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

__all__ = ["FORKSERVER_PRELOAD", "LIFETIME_EXIT_CODE", "START_METHODS", "Outcome", "Ranks",
           "die_with_parent", "free_port", "load_target", "spawn", "start", "stop_process",
           "stop_processes", "target_ref"]

#: Exit code of a child whose ``lifetime`` ran out.
LIFETIME_EXIT_CODE = 124  # what timeout(1) uses

#: How :func:`start` and :func:`spawn` may make a child.
START_METHODS = ("spawn", "forkserver")
#: What the forkserver imports before it forks any child.  Not ucxx or
#: ucxrpc: importing ucxx reads and sets ``UCX_*`` variables, which a child's
#: ``env`` must be able to set first.
FORKSERVER_PRELOAD = ["torch"]

# How long stop_process's SIGTERM gets before SIGKILL.
_TERMINATE_WAIT_S = 1.0
# How long a rank that exited unreported gets for its report to arrive: the
# queue's feeder thread flushes it at exit, but the parent may look first.
_LATE_REPORT_WAIT_S = 0.5
_POLL_S = 0.05
# How often a forked child without a pidfd checks that its starter lives.
_PARENT_POLL_S = 0.5
_OK = "ok"
_ERROR = "error"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a store or a
    lifeline to bind.  The one helper the tests, the benchmarks and the
    examples use.

    It is taken below the kernel's ephemeral range, where nothing is handed
    out unasked: a port of that range (bind to port 0) may meanwhile become
    another socket's, and a client connecting to it before its server
    listens may even get it as its own source port and connect to itself
    (TCP's simultaneous open), so that the server's bind then fails with
    EADDRINUSE (``test_lifecycle_errors``, 2026-11-30).  Another process
    may still bind the same port first, a small race nobody papers over."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _LOW_PORTS[0], min(_LOW_PORTS[1], _ephemeral_start() - 1)
    for port in random.sample(range(low, high + 1), min(64, high - low + 1)):
        if port in _given:  # this process may not have bound it yet
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.append(port)
        return port
    with socket.socket(family, socket.SOCK_STREAM) as s:  # a crowded host: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Where :func:`free_port` looks: above the well-known and common service
#: ports, below the ephemeral range (Linux's default starts at 32768).
_LOW_PORTS = (20000, 32767)
#: The ports :func:`free_port` gave this process lately: not given twice.
_given: deque[int] = deque(maxlen=256)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux only).

    Covers what no ``finally`` can: the parent itself being killed.  Also
    usable as ``preexec_fn`` of ``subprocess.Popen`` (the setting survives
    ``exec``).  The kernel watches the parent *thread* that started this
    process, so start children from a thread that outlives them.

    Args:
        parent_pid: the parent this process should have; if it is gone
            already (this process was reparented before the call), exit at
            once.  ``None``: no such check.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def target_ref(target: Callable[..., object]) -> tuple[str, str]:
    """Return ``(module, name)`` of ``target`` after checking that a child can import it.

    Raises:
        TypeError: ``target`` is not a module-level function of an importable
            module (a lambda, a nested function, a bound method).
    """
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


def load_target(module_name: str, qualname: str) -> Callable[..., object]:
    """The function :func:`target_ref` named, imported (in a child)."""
    target: Callable[..., object] = getattr(importlib.import_module(module_name), qualname)
    return target


def spawn(target: Callable[..., object], args: tuple[Any, ...] = (), *,
          env: Mapping[str, str] | None = None, name: str | None = None,
          lifetime: float | None = None, method: str = "spawn") -> BaseProcess:
    """Start one process running ``target(*args)`` and return it at once.

    Nothing is collected from it: an exception is printed to the child's
    stderr and makes its exit code 1.  The caller owns the process and must
    :func:`stop_process` it in a ``finally``.

    Args:
        target: a module-level function of an importable module.
        args: its arguments, unpickled in the child before ``env`` is applied.
        env: environment entries set in the child before ``target``'s module
            is imported.
        name: the process's name (default: the target's name).
        lifetime: seconds from now after which the child exits by itself
            (``None``: no limit).
        method: one of :data:`START_METHODS` (see the module docstring).

    Raises:
        TypeError: ``target`` is not an importable module-level function.
        ValueError: an unknown ``method``.
    """
    return _spawn(_context(method), target, args, env, name, lifetime, rank=None,
                  reports=None)


def _context(method: str) -> Any:
    """The multiprocessing context of ``method``, its server's imports set."""
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {START_METHODS}, got {method!r}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Read when the server starts, once per process: whoever starts it
        # first decides (tests/compat preloads its suites in a process of
        # its own).
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _spawn(ctx: Any, target: Callable[..., object], args: tuple[Any, ...],
           env: Mapping[str, str] | None, name: str | None, lifetime: float | None,
           rank: int | None, reports: Any) -> BaseProcess:
    module_name, qualname = target_ref(target)
    forked = ctx.get_start_method() == "forkserver"
    # Builtin containers, no class of this module: the child unpickles this
    # before it has loaded this module.  A forked child would have the
    # server's environment, so it is sent the caller's, as a spawned child
    # inherits it.
    child = {"module": module_name, "qualname": qualname, "args": tuple(args),
             "env": dict(env or {}), "rank": rank, "reports": reports,
             "parent_pid": os.getpid(), "forked": forked,
             "environ": dict(os.environ) if forked else None,
             "end": None if lifetime is None else time.monotonic() + lifetime}
    # The child runs _BOOTSTRAP (see the module docstring): `exec` pickles
    # by name, where a function of this module would import the package.
    proc = ctx.Process(target=exec, args=(_BOOTSTRAP, {"path": __file__, "child": child}),
                       name=name or qualname)
    proc.start()
    return proc


def stop_processes(procs: Sequence[BaseProcess], timeout: float = _TERMINATE_WAIT_S) -> None:
    """Stop every process in ``procs``: SIGTERM (and SIGCONT, should one be
    stopped), wait up to ``timeout`` s in all, then SIGKILL and reap.

    Idempotent; never raises; safe on processes that have exited or never
    started.  Signals go to each process's pid, never to a name or a group.
    """
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        pid = proc.pid
        if pid is not None and proc.is_alive():
            proc.terminate()
            try:  # a stopped process (SIGSTOP) takes the SIGTERM only once continued
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    end = time.monotonic() + timeout
    for proc in started:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout)


def stop_process(proc: BaseProcess, timeout: float = _TERMINATE_WAIT_S) -> None:
    """:func:`stop_processes` for one process."""
    stop_processes([proc], timeout)


@dataclass
class Outcome:
    """What became of one rank, as far as :class:`Ranks` has seen.

    ``exitcode`` is ``None`` while the process runs (negative: killed by
    that signal).  ``reported`` says the target returned or raised and the
    child said so.  ``error`` says why the rank failed: the child's
    traceback, or how its process ended; ``None`` when it has not failed.
    ``value`` is the target's return value.
    """

    rank: int
    pid: int | None
    exitcode: int | None = None
    reported: bool = False
    value: object = None
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.exitcode is None

    @property
    def ok(self) -> bool:
        """The target returned and nothing went wrong (so far: the process
        may still be exiting)."""
        return self.reported and self.error is None


class Ranks:
    """The processes one :func:`start` launched, ``procs[r]`` running rank ``r``.

    A context manager: leaving it stops every process (:meth:`stop`).
    """

    def __init__(self, procs: list[BaseProcess], reports: Any) -> None:
        self.procs = procs
        self._reports = reports
        self._outcomes = [Outcome(rank, p.pid) for rank, p in enumerate(procs)]
        self._stopped = False

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def outcomes(self) -> list[Outcome]:
        """Each rank's outcome as of the last :meth:`poll`, in rank order (copies)."""
        return [dataclasses.replace(out) for out in self._outcomes]

    def poll(self, wait: float = 0.0) -> None:
        """Take the reports that arrive within ``wait`` s (then those already
        there) and note the processes that have exited."""
        self._drain(wait)
        for rank, proc in enumerate(self.procs):
            out = self._outcomes[rank]
            if out.exitcode is not None or proc.exitcode is None:
                continue
            if not out.reported:
                self._drain(_LATE_REPORT_WAIT_S)
            out.exitcode = proc.exitcode
            if not out.reported:
                out.error = _describe_exit(proc.exitcode, "without reporting a result")
            elif out.exitcode != 0 and out.error is None:
                out.error = _describe_exit(proc.exitcode, "after returning its result")

    def collect(self, timeout: float | None, *,
                failure_grace: float | None = None) -> list[Outcome]:
        """Wait until every rank has exited, ``timeout`` s have passed, or
        ``failure_grace`` s have passed since the first rank failed; return
        every rank's :class:`Outcome`, in rank order.

        Ranks still running then are left running (``exitcode`` ``None``),
        for the caller to look at (dump their stacks, say) before
        :meth:`stop`.  ``None`` for either limit: no limit.  Never raises
        for a rank's failure: that is in its outcome.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at: float | None = None
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            self.poll(max(0.0, wait))
            if all(out.exitcode is not None for out in self._outcomes):
                break
            now = time.monotonic()
            if failed_at is None and any(out.error for out in self._outcomes):
                failed_at = now
            if deadline is not None and now >= deadline:
                break
            if failure_grace is not None and failed_at is not None \
                    and now >= failed_at + failure_grace:
                break
        return self.outcomes

    def stop(self, timeout: float = _TERMINATE_WAIT_S) -> None:
        """Stop every rank still running (:func:`stop_processes`) and release
        the report queue.  Idempotent; never raises."""
        stop_processes(self.procs, timeout)
        if not self._stopped:
            self._stopped = True
            self._reports.close()
            self._reports.join_thread()  # nothing was put here: returns at once

    def _drain(self, wait: float) -> None:
        # The first get waits up to `wait`; whatever else is queued is taken
        # without waiting.
        while True:
            try:
                rank, status, data = self._reports.get(timeout=wait)
            except queue_module.Empty:
                return
            wait = 0.0
            out = self._outcomes[rank]
            out.reported = True
            if status == _ERROR:
                out.error = data
                continue
            try:
                out.value = pickle.loads(data)
            except Exception:
                out.error = ("its return value could not be unpickled here:\n"
                             + traceback.format_exc())


def start(target: Callable[..., object], args: Sequence[tuple[Any, ...]], *,
          env: Mapping[str, str] | None = None, names: Sequence[str] | None = None,
          lifetime: float | None = None, method: str = "spawn") -> Ranks:
    """Start ``len(args)`` ranks, rank ``r`` running ``target(*args[r])``.

    What each target returns (it must pickle) or raises comes back in
    :meth:`Ranks.collect`; a rank that raised exits with code 1.

    Args:
        target: a module-level function of an importable module.
        args: one argument tuple per rank, unpickled in the child before
            ``env`` is applied.
        env: environment entries set in every child before ``target``'s
            module is imported.
        names: the processes' names (default ``<target>-rank<r>``).
        lifetime: as for :func:`spawn`.
        method: as for :func:`spawn`.

    Returns:
        The started ranks; the caller must :meth:`Ranks.stop` them (``with``).

    Raises:
        TypeError: ``target`` is not an importable module-level function.
        ValueError: an unknown ``method``.
        Whatever starting a process raises; ranks started by then are stopped.
    """
    target_ref(target)  # before anything starts
    ctx = _context(method)
    reports = ctx.Queue()
    procs: list[BaseProcess] = []
    try:
        for rank, rank_args in enumerate(args):
            name = names[rank] if names is not None else f"{target.__name__}-rank{rank}"
            procs.append(_spawn(ctx, target, rank_args, env, name, lifetime, rank, reports))
    except BaseException:
        Ranks(procs, reports).stop()
        raise
    return Ranks(procs, reports)


def _describe_exit(code: int, what: str) -> str:
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"process {how} {what}"


# --------------------------------------------------------------------------
# Child side: these run in the spawned interpreter.

# The target of every child's Process.  It loads this file under its own
# name unless the child has it already (a __main__ that imported it, say).
_BOOTSTRAP = """\
import importlib.util, sys
launch = sys.modules.get("ucxrpc._launch")
if launch is None:
    spec = importlib.util.spec_from_file_location("ucxrpc._launch", path)
    launch = importlib.util.module_from_spec(spec)
    sys.modules["ucxrpc._launch"] = launch
    spec.loader.exec_module(launch)
launch._child_main(child)
"""


def _child_main(child: dict[str, Any]) -> None:
    """Run one child: tie it to its parent, apply ``env``, call the target,
    report what became of it when it is a rank."""
    parent_pid = child["parent_pid"]
    if child["forked"]:
        # Its parent is the server, which lives on while any child it forked
        # does (each holds the server's end-of-clients pipe open): tie the
        # child to the process that started it instead.
        _die_with(parent_pid)
    else:
        die_with_parent(parent_pid)
    if child["end"] is not None:
        threading.Thread(target=_watchdog, args=(parent_pid, child["end"]),
                         name="ucxrpc-launch-watchdog", daemon=True).start()
    if child["environ"] is not None:
        os.environ.clear()
        os.environ.update(child["environ"])
    os.environ.update(child["env"])
    rank, reports = child["rank"], child["reports"]
    if reports is None:  # spawn(): an exception is multiprocessing's to print
        _load(child)(*child["args"])
        return
    message: tuple[int, str, bytes | str]  # (rank, _OK, pickled value) or (rank, _ERROR, text)
    try:
        value = _load(child)(*child["args"])
        try:
            message = (rank, _OK, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            message = (rank, _ERROR, "its return value does not pickle:\n" + traceback.format_exc())
    except BaseException:
        message = (rank, _ERROR, traceback.format_exc())
    reports.put(message)
    # Process exit joins the queue's feeder thread, so the message is in the
    # pipe before the parent sees this process end.
    if message[1] == _ERROR:
        sys.exit(1)


def _load(child: Mapping[str, Any]) -> Callable[..., object]:
    return load_target(child["module"], child["qualname"])


def _watchdog(parent_pid: int, end: float) -> None:
    # time.monotonic() is CLOCK_MONOTONIC, one clock for all processes of the
    # host, so the parent's `end` means the same here.  The check on the
    # process that started this one covers a platform without
    # PR_SET_PDEATHSIG (a forked child's parent is the server: not getppid).
    while not _ended(parent_pid) and time.monotonic() < end:
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    print(f"ucxrpc launcher: {multiprocessing.current_process().name} exits: "
          f"{'parent gone' if _ended(parent_pid) else 'lifetime over'}",
          file=sys.stderr, flush=True)
    os._exit(LIFETIME_EXIT_CODE)


def _die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` (not its parent) ends, as
    :func:`die_with_parent` does for a parent: a thread waits on a pidfd of
    it (polls, where the kernel has none).  At once if it is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (OSError, AttributeError):  # no pidfd: Linux before 5.3
        fd = -1
    threading.Thread(target=_await_end, args=(pid, fd), name="ucxrpc-launch-parent",
                     daemon=True).start()


def _await_end(pid: int, fd: int) -> None:
    if fd >= 0:
        select.select([fd], [], [])  # readable once the process has ended
    # A sandbox's pidfd may also wake early: what the kernel says of the
    # process decides, polled where there is no pidfd.
    while not _ended(pid):
        time.sleep(_PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        return False
