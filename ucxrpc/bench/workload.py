"""The benchmark workload and the two-process runner around it.

One workload, :func:`run_workload`, runs unchanged on any module with
torch.distributed.rpc's API (``torch.distributed.rpc`` itself, or
``ucxrpc``): it only calls ``rpc_sync`` and ``rpc_async`` on module-level
functions. :func:`run_implementation` spawns two fresh processes (spawn start
method: no inherited threads or UCX state), rendezvous on
``tcp://127.0.0.1:<free port>``, lets ``worker0`` measure against
``worker1``, and collects the result through a queue under one deadline,
killing the children in ``finally``. The raw-UCX baseline
(:mod:`ucxrpc.transport.baseline`) runs under the same runner.

Timing: ``time.perf_counter`` around each call; no allocation inside timed
loops (send tensors are allocated and filled once per size); every size is
warmed up before it is timed, since the first large transfers page-fault.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import os
import queue
import resource
import socket
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "DEFAULT_SIZES",
    "IMPLEMENTATIONS",
    "RunOutcome",
    "WorkloadConfig",
    "consume",
    "echo",
    "noop",
    "quick_config",
    "run_implementation",
    "run_workload",
]

KiB, MiB = 1 << 10, 1 << 20
#: 4 KiB … 256 MiB in powers of 4.
DEFAULT_SIZES = tuple(4 * KiB * 4 ** i for i in range(9))
#: Implementation keys: the two RPC modules and the raw UCX baseline.
IMPLEMENTATIONS = ("ucxrpc", "torch", "ucxx")

_PEER = "worker1"
_SHUTDOWN_GRACE_S = 30.0


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the workload; the defaults are the full benchmark.

    Attributes:
        sizes: bandwidth message sizes in bytes.
        latency_iters / latency_warmup: timed and untimed no-op ``rpc_sync``.
        async_outstanding / async_repeats: ``rpc_async`` calls in flight per
            round and rounds; the reported figure is the median round.
        target_s / min_iters / max_iters / warmup_iters: timed iterations per
            bandwidth size are enough for ``target_s`` (estimated from the
            last warm-up call), within ``[min_iters, max_iters]``.
        dict_tensors / dict_tensor_bytes / dict_min_iters: the dict echo.
        transports: passed to ucxrpc's ``transports=`` and the raw baseline
            (``UCX_TLS``); TensorPipe ignores it.
        num_worker_threads / rpc_timeout: backend options for both agents.
    """

    sizes: tuple[int, ...] = DEFAULT_SIZES
    latency_iters: int = 2000
    latency_warmup: int = 200
    async_outstanding: int = 10_000
    async_repeats: int = 3
    target_s: float = 0.3
    min_iters: int = 3
    max_iters: int = 100_000
    warmup_iters: int = 2
    dict_tensors: int = 100
    dict_tensor_bytes: int = 4 * KiB
    dict_min_iters: int = 20
    transports: tuple[str, ...] | None = None
    num_worker_threads: int = 16
    rpc_timeout: float = 60.0


def quick_config(**overrides: Any) -> WorkloadConfig:
    """A smoke-test configuration: small sizes, few iterations (seconds)."""
    base: dict[str, Any] = dict(sizes=(4 * KiB, 64 * KiB, 1 * MiB), latency_iters=200,
                                latency_warmup=20, async_outstanding=1000, async_repeats=3,
                                target_s=0.05, dict_min_iters=5)
    base.update(overrides)
    return WorkloadConfig(**base)


# --- remote functions (module level so both agents can pickle them) -------

def noop() -> None:
    return None


def consume(t: Any) -> None:
    return None


def echo(x: Any) -> Any:
    return x


# --- the workload: runs on rank 0, against any torch-RPC-like module ------

def _percentile(sorted_values: list[float], q: float) -> float:
    index = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(index, len(sorted_values) - 1)]


def _time_calls(call: Callable[[], Any], count: int) -> list[float]:
    """Seconds per call for ``count`` calls; the list is preallocated."""
    times = [0.0] * count
    clock = time.perf_counter
    for i in range(count):
        start = clock()
        call()
        times[i] = clock() - start
    return times


def _adaptive_count(call: Callable[[], Any], target_s: float, lo: int, hi: int,
                    warmup: int) -> int:
    """Run ``warmup`` untimed calls; size the timed run from the last one."""
    estimate = max(_time_calls(call, max(1, warmup))[-1], 1e-7)
    return max(lo, min(hi, math.ceil(target_s / estimate)))


def _measure_latency(rpc: Any, cfg: WorkloadConfig) -> dict[str, Any]:
    def call() -> None:
        rpc.rpc_sync(_PEER, noop)

    _time_calls(call, cfg.latency_warmup)
    gc.collect()
    times = sorted(_time_calls(call, cfg.latency_iters))
    return {"p50_us": _percentile(times, 50) * 1e6, "p99_us": _percentile(times, 99) * 1e6,
            "mean_us": sum(times) / len(times) * 1e6, "n": len(times),
            "what": "rpc_sync(noop)"}


def _measure_async(rpc: Any, cfg: WorkloadConfig) -> dict[str, Any]:
    import torch

    def burst(n: int) -> float:
        start = time.perf_counter()
        futures = [rpc.rpc_async(_PEER, noop) for _ in range(n)]
        torch.futures.wait_all(futures)
        return n / (time.perf_counter() - start)

    burst(max(1, cfg.async_outstanding // 10))   # warm-up
    runs = []
    for _ in range(cfg.async_repeats):
        gc.collect()
        runs.append(burst(cfg.async_outstanding))
    ordered = sorted(runs)
    return {"calls_per_s": ordered[len(ordered) // 2], "runs": runs, "stat": "median",
            "outstanding": cfg.async_outstanding}


def _measure_bandwidth(rpc: Any, cfg: WorkloadConfig, fn: Callable[[Any], Any],
                       size: int, factor: int) -> dict[str, Any]:
    """``rpc_sync(fn, t)`` with one tensor of ``size`` bytes, filled once."""
    import torch

    tensor = torch.empty(size, dtype=torch.uint8)
    tensor.fill_(1)

    def call() -> None:
        rpc.rpc_sync(_PEER, fn, args=(tensor,))

    count = _adaptive_count(call, cfg.target_s, cfg.min_iters, cfg.max_iters, cfg.warmup_iters)
    gc.collect()
    times = sorted(_time_calls(call, count))
    rates = sorted(factor * size / t / 1e9 for t in times)
    return {"bytes": size, "iters": count, "gbps": rates[len(rates) // 2],
            "median_s": times[len(times) // 2], "min_s": times[0]}


def _measure_dict_echo(rpc: Any, cfg: WorkloadConfig) -> dict[str, Any]:
    import torch

    elems = cfg.dict_tensor_bytes // 4
    payload = {f"t{i}": torch.full((elems,), float(i)) for i in range(cfg.dict_tensors)}

    def call() -> None:
        rpc.rpc_sync(_PEER, echo, args=(payload,))

    count = _adaptive_count(call, cfg.target_s, cfg.dict_min_iters, cfg.max_iters,
                            max(cfg.warmup_iters, 5))
    gc.collect()
    times = sorted(_time_calls(call, count))
    return {"p50_us": _percentile(times, 50) * 1e6, "p99_us": _percentile(times, 99) * 1e6,
            "n": count, "tensors": cfg.dict_tensors, "tensor_bytes": cfg.dict_tensor_bytes}


def run_workload(rpc: Any, cfg: WorkloadConfig) -> dict[str, Any]:
    """Measure against ``worker1`` with ``rpc``'s ``rpc_sync``/``rpc_async``.

    ``rpc`` is any module with torch.distributed.rpc's API, already
    initialised as ``worker0``. Returns the schema of
    :mod:`ucxrpc.bench.report`.
    """
    result: dict[str, Any] = {"latency": _measure_latency(rpc, cfg),
                              "async": _measure_async(rpc, cfg)}
    result["one_way"] = [_measure_bandwidth(rpc, cfg, consume, n, 1) for n in cfg.sizes]
    result["round_trip"] = [_measure_bandwidth(rpc, cfg, echo, n, 2) for n in cfg.sizes]
    result["dict_echo"] = _measure_dict_echo(rpc, cfg)
    return result


# --- child processes --------------------------------------------------------

def _rpc_module_and_options(impl: str, init_method: str, cfg: WorkloadConfig) -> tuple[Any, Any]:
    if impl == "torch":
        import torch.distributed.rpc as rpc

        return rpc, rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, num_worker_threads=cfg.num_worker_threads,
            rpc_timeout=cfg.rpc_timeout)
    import ucxrpc

    return ucxrpc, ucxrpc.UcxRpcBackendOptions(
        init_method=init_method, num_worker_threads=cfg.num_worker_threads,
        rpc_timeout=cfg.rpc_timeout,
        transports=list(cfg.transports) if cfg.transports else None)


def _rpc_peer(impl: str, rank: int, init_method: str, cfg: WorkloadConfig,
              link: _Link) -> None:
    # torch's RPC init warns about a deprecated ProcessGroup use of its own.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    rpc, options = _rpc_module_and_options(impl, init_method, cfg)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            try:
                result = run_workload(rpc, cfg)
                get_pipe_info = getattr(rpc, "get_pipe_info", None)
                if get_pipe_info is not None:
                    result["pipe_info"] = get_pipe_info()
                link.report(result)
            except BaseException:
                link.error(traceback.format_exc())   # before shutdown, which may hang
                raise
    finally:
        rpc.shutdown()


class _Link:
    """A child's queues: peer address exchange, result and error reporting."""

    def __init__(self, rank: int, results: Any, to_peer: Any, from_peer: Any,
                 timeout_s: float) -> None:
        self.rank, self.results = rank, results
        self.to_peer, self.from_peer, self.timeout_s = to_peer, from_peer, timeout_s
        self.errored = False

    def exchange(self, mine: bytes) -> bytes:
        self.to_peer.put(mine)
        try:
            return self.from_peer.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer address not received within {self.timeout_s} s") from None

    def report(self, result: dict[str, Any]) -> None:
        self.results.put(("result", self.rank, result))

    def error(self, text: str) -> None:
        if not self.errored:
            self.errored = True
            self.results.put(("error", self.rank, text))


def _watchdog(parent_pid: int, deadline_wall: float) -> None:
    """Exit this child when its parent is gone or the run's deadline passed.

    The parent kills its children in ``finally``, but a parent killed by a
    signal cannot; a hung RPC shutdown would then leave them behind forever.
    """
    while os.getppid() == parent_pid and time.time() < deadline_wall + _SHUTDOWN_GRACE_S:
        time.sleep(1.0)
    os._exit(3)


def _child_main(impl: str, rank: int, init_method: str, cfg: WorkloadConfig,
                results: Any, to_peer: Any, from_peer: Any, parent_pid: int,
                deadline_wall: float) -> None:
    """Entry point of every benchmark child (spawned)."""
    threading.Thread(target=_watchdog, args=(parent_pid, deadline_wall),
                     name="bench-watchdog", daemon=True).start()
    link = _Link(rank, results, to_peer, from_peer, timeout_s=cfg.rpc_timeout)
    try:
        if impl == "ucxx":
            from ..transport.baseline import BaselineConfig, baseline_peer

            baseline_peer(rank, BaselineConfig(
                sizes=cfg.sizes, latency_iters=cfg.latency_iters,
                latency_warmup=cfg.latency_warmup, target_s=cfg.target_s,
                min_iters=cfg.min_iters, max_iters=cfg.max_iters,
                warmup_iters=cfg.warmup_iters, transports=cfg.transports,
                timeout_s=cfg.rpc_timeout), link.exchange, link.report)
        else:
            _rpc_peer(impl, rank, init_method, cfg, link)
    except BaseException:
        link.error(traceback.format_exc())
        raise
    results.put(("done", rank, None))


# --- parent side --------------------------------------------------------------

@dataclass
class RunOutcome:
    """What one implementation's run produced.

    ``result`` is rank 0's measurements (``None`` on failure); ``error`` a
    message with the child traceback; ``warnings`` things that went wrong
    after the result arrived (e.g. a shutdown that had to be killed);
    ``cpu_others`` the fraction of all CPUs other processes used meanwhile.
    """

    impl: str
    result: dict[str, Any] | None = None
    error: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    cpu_others: float | None = None


class _CpuMeter:
    """CPU time *other* processes took while a run was going on.

    Whole-machine busy time from ``/proc/stat`` minus what this process and
    its reaped children (the benchmark workers) used, as a fraction of all
    CPUs over the wall time. Polling benchmarks want a free core per process;
    anything else running distorts them, and this says by how much.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / ticks    # all but idle, iowait
        own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return busy, own, time.monotonic()

    def others(self) -> float | None:
        """Fraction of all CPUs used by other processes since construction."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy, own, wall = (b - a for a, b in zip(self._start, end))
        return max(0.0, min(1.0, (busy - own) / (wall * (os.cpu_count() or 1))))


def _free_port() -> int:
    """A TCP port on loopback that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collect(outcome: RunOutcome, procs: list[Any], results: Any, deadline: float) -> None:
    """Wait for rank 0's result, then both children's exit, within deadline."""
    done: set[int] = set()
    while outcome.result is None and outcome.error is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            outcome.error = "deadline passed before worker0 reported a result"
            return
        try:
            kind, rank, payload = results.get(timeout=min(0.5, remaining))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                outcome.error = "; ".join(f"{p.name} exited with code {p.exitcode}" for p in dead)
                # a traceback may still be in flight on the queue
                try:
                    kind, rank, payload = results.get(timeout=1.0)
                    if kind == "error":
                        outcome.error = f"worker{rank} failed:\n{payload}"
                except queue.Empty:
                    pass
            continue
        if kind == "result":
            outcome.result = payload
        elif kind == "error":
            outcome.error = f"worker{rank} failed:\n{payload}"
        else:
            done.add(rank)
    grace_end = min(deadline, time.monotonic() + _SHUTDOWN_GRACE_S)
    for p in procs:
        p.join(max(0.0, grace_end - time.monotonic()))
        if p.is_alive():
            outcome.warnings.append(f"{p.name} did not exit within {_SHUTDOWN_GRACE_S:.0f} s "
                                    "after the measurements (shutdown hung?); killed")
        elif p.exitcode != 0 and outcome.result is not None:
            outcome.warnings.append(f"{p.name} exited with code {p.exitcode} after reporting")


def run_implementation(impl: str, cfg: WorkloadConfig, deadline: float) -> RunOutcome:
    """Run the workload for ``impl`` in two spawned processes.

    Args:
        impl: ``"torch"`` (TensorPipe agent), ``"ucxrpc"``, or ``"ucxx"``
            (the raw UCX baseline).
        cfg: what to measure.
        deadline: ``time.monotonic()`` value by which everything, shutdown
            included, must be over; the children are killed then at the
            latest.

    Returns:
        A :class:`RunOutcome`; failures are reported in it, not raised.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    ctx = multiprocessing.get_context("spawn")
    results, to_1, to_0 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    outcome = RunOutcome(impl)
    meter = _CpuMeter()
    start = time.monotonic()
    deadline_wall = time.time() + (deadline - time.monotonic())
    procs = [ctx.Process(target=_child_main, name=f"{impl}-worker{rank}", daemon=True,
                         args=(impl, rank, init_method, cfg, results, to_peer, from_peer,
                               os.getpid(), deadline_wall))
             for rank, to_peer, from_peer in ((0, to_1, to_0), (1, to_0, to_1))]
    try:
        for p in procs:
            p.start()
        _collect(outcome, procs, results, deadline)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:   # started
                p.join(5)
        for q in (results, to_1, to_0):
            q.close()
            q.cancel_join_thread()
        outcome.wall_s = time.monotonic() - start
        outcome.cpu_others = meter.others()
    return outcome


def describe_config(cfg: WorkloadConfig) -> dict[str, Any]:
    """The configuration as JSON-ready data."""
    doc = dataclasses.asdict(cfg)
    doc["transports"] = list(cfg.transports) if cfg.transports else None
    doc["sizes"] = list(cfg.sizes)
    return doc
