"""The processes of one benchmark run: spawn, rendezvous, collect, clean up.

Every run (one series: an implementation under one transport choice) gets
fresh processes (spawn start method: no inherited threads or UCX state, and
UCX reads ``UCX_*`` once per process). Rank 0's process measures against
rank 1's and reports through a queue to the process that spawned it, under
one deadline; whatever happens, the children are stopped in ``finally``.
Starting and stopping them, and their dying with this process, is
:mod:`ucxrpc._launch`'s; the results queue, the progress messages and the
CPU accounting are the benchmark's own.

- Locally (:func:`run_local`) both ranks are children of this process and
  rendezvous on ``tcp://127.0.0.1:<free port>``.
- Across hosts (:mod:`ucxrpc.bench.hosts`) each host's ``ucxrpc bench``
  spawns its own rank's child; the rendezvous address comes through a
  c10d store.

The child side (:func:`child_main`) is the same in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import resource
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .._launch import free_port, spawn, stop_processes
from .workload import CALLER, PEER, WorkloadConfig, run_workload

__all__ = ["ChildSpec", "RunOutcome", "StoreAddress", "busy_load", "child_main", "collect",
           "run_local", "start_children", "stop_children"]

SHUTDOWN_GRACE_S = 30.0
# How often a waiting parent looks at its children and the other host.
_POLL_S = 0.5

#: Called with a short label each time rank 0 finishes a step.
ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class StoreAddress:
    """A c10d TCPStore (host, port) and the key prefix of this benchmark."""

    host: str
    port: int
    prefix: str


@dataclass(frozen=True)
class ChildSpec:
    """Everything one benchmark child needs (pickled to a spawned process).

    ``device``/``peer_device`` are this rank's and the other rank's tensor
    devices (``"cpu"``, ``"cuda:0"``); ``store`` is set across hosts, where
    the raw baseline exchanges its UCX address through it under ``key``.
    ``deadline_wall`` (``time.time()``) is when the run must be over: the
    child exits by itself a grace after it (:func:`start_children`).
    ``parent_pid`` names the coordinator; the child's tie to it is the
    launcher's (:func:`ucxrpc._launch.die_with_parent`).
    """

    impl: str
    rank: int
    init_method: str
    cfg: WorkloadConfig
    device: str
    peer_device: str
    parent_pid: int
    deadline_wall: float
    store: StoreAddress | None = None
    key: str = ""


@dataclass
class RunOutcome:
    """What one run produced.

    ``result`` is rank 0's measurements (``None`` on failure or on rank 1);
    ``error`` a message with the child traceback; ``warnings`` things that
    went wrong after the result arrived (e.g. a shutdown that had to be
    killed); ``cpu_others`` the fraction of all CPUs other processes used
    meanwhile.
    """

    key: str
    result: dict[str, Any] | None = None
    error: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    cpu_others: float | None = None


# --- child side ---------------------------------------------------------------

class _Link:
    """A child's way back to its parent (results queue) and to its peer."""

    def __init__(self, spec: ChildSpec, results: Any, exchange: Callable[[bytes], bytes]) -> None:
        self.rank, self.results, self.exchange = spec.rank, results, exchange
        self.errored = False

    def report(self, result: dict[str, Any]) -> None:
        self.results.put(("result", self.rank, result))

    def progress(self, label: str) -> None:
        self.results.put(("progress", self.rank, label))

    def error(self, text: str) -> None:
        if not self.errored:
            self.errored = True
            self.results.put(("error", self.rank, text))


def _queue_exchange(to_peer: Any, from_peer: Any, timeout_s: float) -> Callable[[bytes], bytes]:
    def exchange(mine: bytes) -> bytes:
        to_peer.put(mine)
        try:
            return from_peer.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer address not received within {timeout_s} s") from None
    return exchange


def _store_exchange(spec: ChildSpec, timeout_s: float) -> Callable[[bytes], bytes]:
    def exchange(mine: bytes) -> bytes:
        from datetime import timedelta

        import torch.distributed as dist

        assert spec.store is not None
        store = dist.PrefixStore(f"{spec.store.prefix}/{spec.key}/raw", dist.TCPStore(
            spec.store.host, spec.store.port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s)))
        # hex: torch's Store API is typed for str values; a UCX address is binary
        store.set(str(spec.rank), mine.hex())
        return bytes.fromhex(bytes(store.get(str(1 - spec.rank))).decode())
    return exchange


def _rpc_module_and_options(spec: ChildSpec) -> tuple[Any, Any]:
    cfg = spec.cfg
    rpc: Any
    options: Any
    if spec.impl == "torch":
        import torch.distributed.rpc as torch_rpc

        rpc, options = torch_rpc, torch_rpc.TensorPipeRpcBackendOptions(
            init_method=spec.init_method, num_worker_threads=cfg.num_worker_threads,
            rpc_timeout=cfg.rpc_timeout)
    else:
        import ucxrpc

        rpc, options = ucxrpc, ucxrpc.UcxRpcBackendOptions(
            init_method=spec.init_method, num_worker_threads=cfg.num_worker_threads,
            rpc_timeout=cfg.rpc_timeout,
            transports=list(cfg.transports) if cfg.transports else None)
    if spec.device != "cpu":
        # Both ways: the bidirectional test sends from worker1 too.
        options.set_device_map(f"worker{1 - spec.rank}", {spec.device: spec.peer_device})
    return rpc, options


def _rpc_peer(spec: ChildSpec, link: _Link) -> None:
    # torch's RPC init warns about a deprecated ProcessGroup use of its own.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    if spec.device != "cpu":
        import torch

        torch.cuda.set_device(torch.device(spec.device))
    rpc, options = _rpc_module_and_options(spec)
    name = CALLER if spec.rank == 0 else PEER
    rpc.init_rpc(name, rank=spec.rank, world_size=2, rpc_backend_options=options)
    try:
        if spec.rank == 0:
            try:
                result = run_workload(rpc, spec.cfg, spec.device, spec.peer_device,
                                      link.progress)
                get_pipe_info = getattr(rpc, "get_pipe_info", None)
                if get_pipe_info is not None:
                    result["pipe_info"] = get_pipe_info()
                link.report(result)
            except BaseException:
                link.error(traceback.format_exc())   # before shutdown, which may hang
                raise
    finally:
        rpc.shutdown()


def child_main(spec: ChildSpec, results: Any, to_peer: Any = None, from_peer: Any = None) -> None:
    """Entry point of every benchmark child (spawned)."""
    # Inherited from torchrun: it would make torch's tcp:// rendezvous (used by
    # both RPC libraries) connect as a client to a store rank 0 must host.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    timeout_s = spec.cfg.rpc_timeout
    exchange = _store_exchange(spec, timeout_s) if spec.store is not None else \
        _queue_exchange(to_peer, from_peer, timeout_s)
    link = _Link(spec, results, exchange)
    try:
        if spec.impl == "ucxx":
            from .raw import raw_peer

            raw_peer(spec.rank, spec.cfg, spec.device, link.exchange, link.report,
                     link.progress)
        else:
            _rpc_peer(spec, link)
    except BaseException:
        link.error(traceback.format_exc())
        raise
    results.put(("done", spec.rank, None))


# --- parent side --------------------------------------------------------------

class CpuMeter:
    """CPU time *other* processes took while a run was going on.

    Whole-machine busy time from ``/proc/stat`` minus what this process and
    its reaped children (the benchmark workers) used, as a fraction of all
    CPUs over the wall time. Polling benchmarks want a free core per process;
    anything else running distorts them, and this says by how much.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def own() -> float:
        """CPU seconds this process and its reaped children used so far."""
        return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

    @classmethod
    def _sample(cls) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / ticks    # all but idle, iowait
        return busy, cls.own(), time.monotonic()

    def others(self, exclude: float = 0.0) -> float | None:
        """Fraction of all CPUs used by other processes since construction,
        less ``exclude`` CPU seconds (the peer rank's, when it shares this
        machine: ``--hosts netns``)."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy, own, wall = (b - a for a, b in zip(self._start, end))
        return max(0.0, min(1.0, (busy - own - exclude) / (wall * (os.cpu_count() or 1))))


# A busy process: killed with the bench even if the bench itself is killed
# (PR_SET_PDEATHSIG; the ppid check covers a bench gone before the prctl).
_BUSY = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit()
while True:
    pass
"""


@contextlib.contextmanager
def busy_load(n: int) -> Iterator[list[int]]:
    """Run ``n`` CPU-bound processes (a Python loop each) meanwhile: a busy
    machine, as a training node always is, for every implementation alike.
    Yields their pids; they are killed (by pid) and reaped on the way out.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _BUSY, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def _take(outcome: RunOutcome, item: tuple[str, int, Any], on_progress: ProgressFn | None,
          done: set[int]) -> None:
    kind, rank, payload = item
    if kind == "result":
        outcome.result = payload
    elif kind == "error":
        outcome.error = f"worker{rank} failed:\n{payload}"
    elif kind == "progress":
        if on_progress is not None:
            on_progress(payload)
    else:
        done.add(rank)


def collect(outcome: RunOutcome, procs: list[Any], results: Any, deadline: float,
            on_progress: ProgressFn | None = None, want_result: bool = True,
            peer_failed: Callable[[], str | None] | None = None) -> None:
    """Wait for rank 0's result (or, on rank 1, for the child to finish), then
    for every child's exit, within ``deadline``; children still running
    after the grace period are left to :func:`stop_children`.

    ``peer_failed`` is polled while waiting: a message from it (the other
    host's rank failed) ends the wait with that error.
    """
    done: set[int] = set()
    polled = time.monotonic()

    def finished() -> bool:
        if outcome.error is not None:
            return True
        return outcome.result is not None if want_result else bool(done)

    while not finished():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            outcome.error = "deadline passed before the run finished"
            return
        try:
            _take(outcome, results.get(timeout=min(_POLL_S, remaining)), on_progress, done)
        except queue.Empty:
            pass
        if finished() or time.monotonic() - polled < _POLL_S:
            continue
        polled = time.monotonic()
        failed = peer_failed() if peer_failed is not None else None
        if failed:
            outcome.error = failed
            return
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead or all(p.exitcode is not None for p in procs):
            try:   # a result or traceback may still be in flight on the queue
                while not finished():
                    _take(outcome, results.get(timeout=1.0), on_progress, done)
            except queue.Empty:
                pass
            if not finished():
                outcome.error = "; ".join(f"{p.name} exited with code {p.exitcode}"
                                          for p in dead) or "the children exited without finishing"
    grace_end = min(deadline, time.monotonic() + SHUTDOWN_GRACE_S)
    for p in procs:
        p.join(max(0.0, grace_end - time.monotonic()))
        if p.is_alive():
            outcome.warnings.append(f"{p.name} did not exit within {SHUTDOWN_GRACE_S:.0f} s "
                                    "after the measurements (shutdown hung?); killed")
        elif p.exitcode != 0 and outcome.error is None:
            outcome.warnings.append(f"{p.name} exited with code {p.exitcode} after reporting")


def start_children(procs: list[Any], specs: list[ChildSpec], names: list[str], results: Any,
                   peers: list[tuple[Any, Any]]) -> None:
    """Start one spawned child per spec, appending each to ``procs`` as it
    starts, so the caller's ``finally`` (:func:`stop_children`) sees every
    started one.

    A child dies with this process, and exits by itself
    :data:`SHUTDOWN_GRACE_S` after its spec's deadline: a hung RPC shutdown
    must not outlive the benchmark.
    """
    for spec, name, peer in zip(specs, names, peers):
        lifetime = spec.deadline_wall + SHUTDOWN_GRACE_S - time.time()
        procs.append(spawn(child_main, (spec, results, *peer), name=name, lifetime=lifetime))


def stop_children(procs: list[Any], queues: list[Any]) -> None:
    """Stop what still runs (by pid: SIGTERM, then SIGKILL), reap it, and
    release the queues; never raises."""
    stop_processes(procs)
    for q in queues:
        q.close()
        q.cancel_join_thread()


def run_local(key: str, impl: str, cfg: WorkloadConfig, deadline: float,
              on_progress: ProgressFn | None = None) -> RunOutcome:
    """Run one series in two spawned processes on this host.

    Args:
        key: the series' name (kept in the outcome and the child names).
        impl: ``"torch"`` (TensorPipe agent), ``"ucxrpc"``, or ``"ucxx"``
            (raw UCX).
        cfg: what to measure; ``cfg.device == "cuda"`` puts both ranks on
            ``cuda:0`` (one GPU shared by two processes).
        deadline: ``time.monotonic()`` value by which everything, shutdown
            included, must be over; the children are killed then at the
            latest.
        on_progress: called in this process with each step's label.

    Returns:
        A :class:`RunOutcome`; failures are reported in it, not raised.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results, to_1, to_0 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    deadline_wall = time.time() + (deadline - time.monotonic())
    init_method = f"tcp://127.0.0.1:{free_port()}"
    specs = [ChildSpec(impl, rank, init_method, cfg, device, device, os.getpid(), deadline_wall)
             for rank in (0, 1)]
    outcome = RunOutcome(key)
    meter = CpuMeter()
    start = time.monotonic()
    procs: list[Any] = []
    try:
        start_children(procs, specs, [f"{key}-worker{r}" for r in (0, 1)], results,
                       [(to_1, to_0), (to_0, to_1)])
        collect(outcome, procs, results, deadline, on_progress)
    finally:
        stop_children(procs, [results, to_1, to_0])
        outcome.wall_s = time.monotonic() - start
        outcome.cpu_others = meter.others()
    return outcome
