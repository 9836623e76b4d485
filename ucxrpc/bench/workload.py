"""What the benchmark measures through a torch.distributed.rpc-like module.

One workload, :func:`run_workload`, runs unchanged on any module with
torch.distributed.rpc's API (``torch.distributed.rpc`` itself, or
``ucxrpc``): it only calls ``rpc_sync`` and ``rpc_async`` on module-level
functions of this module. The processes around it are
:mod:`ucxrpc.bench.launch`'s; the raw-UCX counterpart is
:mod:`ucxrpc.bench.raw`.

Timing: ``time.perf_counter`` around each call; no allocation inside timed
loops (send tensors are allocated and filled once per size); every size is
warmed up before it is timed, since the first large transfers page-fault.
Per size the result keeps the minimum, median and maximum over the timed
calls (:func:`size_stats`).

CPU per call: every figure also carries ``cpu_us``, the CPU time (user +
system, all threads) both processes spent over its timed calls, divided by
the calls: what a busy node pays per call.  The peer's share is read with
one extra call before and after the timed run, outside the timing.

torch is imported inside the functions that use it; ucxx never is.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .plan import default_sizes, format_size

__all__ = [
    "DEFAULT_SIZES",
    "SECTIONS",
    "WorkloadConfig",
    "bidir_send",
    "consume",
    "count_steps",
    "cpu_seconds",
    "describe_config",
    "echo",
    "noop",
    "quick_config",
    "run_workload",
    "size_stats",
]

KiB, MiB = 1 << 10, 1 << 20
#: 4 KiB … 256 MiB in powers of 4 (the CPU default).
DEFAULT_SIZES = default_sizes("cpu")
#: Per-size sections of a result, with the bytes each timed call moves per
#: byte of message: one-way sends it once, an echo and a bidirectional
#: exchange twice.
SECTIONS = {"one_way": 1, "round_trip": 2, "bidirectional": 2}

PEER = "worker1"
CALLER = "worker0"


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the workload; the defaults are the full benchmark.

    Attributes:
        sizes: bandwidth message sizes in bytes.
        latency_iters / latency_warmup: timed and untimed no-op ``rpc_sync``.
        async_outstanding / async_repeats: ``rpc_async`` calls in flight per
            round and rounds; the reported figure is the median round.
        target_s / min_iters / max_iters / warmup_iters: timed iterations per
            size and section are enough for ``target_s`` (estimated from the
            last warm-up call), within ``[min_iters, max_iters]``: the time
            budget per size.
        dict_tensors / dict_tensor_bytes / dict_min_iters: the dict echo.
        transports: passed to ucxrpc's ``transports=`` and the raw baseline
            (``UCX_TLS``); TensorPipe ignores it.
        device: ``"cpu"`` or ``"cuda"``: where the tensors live.
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
    device: str = "cpu"
    num_worker_threads: int = 16
    rpc_timeout: float = 60.0


def quick_config(**overrides: Any) -> WorkloadConfig:
    """A smoke-test configuration: small sizes, few iterations (seconds)."""
    base: dict[str, Any] = dict(sizes=(4 * KiB, 64 * KiB, 1 * MiB), latency_iters=200,
                                latency_warmup=20, async_outstanding=1000, async_repeats=3,
                                target_s=0.05, dict_min_iters=5)
    base.update(overrides)
    return WorkloadConfig(**base)


def describe_config(cfg: WorkloadConfig) -> dict[str, Any]:
    """The configuration as JSON-ready data."""
    doc = dataclasses.asdict(cfg)
    doc["transports"] = list(cfg.transports) if cfg.transports else None
    doc["sizes"] = list(cfg.sizes)
    return doc


def count_steps(impl: str, cfg: WorkloadConfig) -> int:
    """How many progress steps a run of ``impl`` reports (see ``progress``)."""
    fixed = 1 if impl == "ucxx" else 3    # latency; RPC also throughput and dict echo
    return fixed + len(SECTIONS) * len(cfg.sizes)


def size_stats(times: Sequence[float], size: int, factor: int) -> dict[str, Any]:
    """Per-size figures from the seconds of each timed call.

    ``gbps`` is ``factor * size`` bytes over the median time, in 1e9 bytes
    per second; ``gbps_min`` / ``gbps_max`` come from the slowest / fastest
    call, ``min_s`` / ``median_s`` / ``max_s`` are the times themselves.
    """
    if not times:
        raise ValueError("no timed calls")
    ordered = sorted(times)
    median = statistics.median(ordered)
    moved = factor * size / 1e9
    return {"bytes": size, "iters": len(ordered), "gbps": moved / median,
            "gbps_min": moved / ordered[-1], "gbps_max": moved / ordered[0],
            "min_s": ordered[0], "median_s": median, "max_s": ordered[-1]}


# --- remote functions (module level so both agents can pickle them) -------

def noop() -> None:
    return None


def consume(t: Any) -> None:
    return None


def echo(x: Any) -> Any:
    return x


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system, every thread)."""
    return time.process_time()


def _cpu_both(rpc: Any) -> float:
    return cpu_seconds() + rpc.rpc_sync(PEER, cpu_seconds)


def _cpu_us(start: float, end: float, calls: int) -> float:
    return (end - start) / max(1, calls) * 1e6


# The bidirectional test's send tensor on worker1, kept across calls so that
# only the first (warm-up) call of a size allocates; one size at a time.
_peer_tensor: dict[tuple[int, str], Any] = {}


def bidir_send(module: str, to: str, size: int, device: str) -> None:
    """Run on the peer: send ``size`` bytes back to ``to`` while it sends to us."""
    key = (size, device)
    tensor = _peer_tensor.get(key)
    if tensor is None:
        _peer_tensor.clear()
        tensor = _peer_tensor[key] = filled_tensor(size, device)
    importlib.import_module(module).rpc_sync(to, consume, args=(tensor,))


def filled_tensor(size: int, device: str, value: int = 1) -> Any:
    """``size`` bytes on ``device``, every page touched, ready to send."""
    import torch

    tensor = torch.empty(size, dtype=torch.uint8, device=device)
    tensor.fill_(value)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return tensor


# --- the workload: runs on rank 0, against any torch-RPC-like module ------

def percentile(sorted_values: list[float], q: float) -> float:
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
        rpc.rpc_sync(PEER, noop)

    _time_calls(call, cfg.latency_warmup)
    gc.collect()
    cpu = _cpu_both(rpc)
    times = sorted(_time_calls(call, cfg.latency_iters))
    cpu_us = _cpu_us(cpu, _cpu_both(rpc), len(times))
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6,
            "mean_us": sum(times) / len(times) * 1e6, "min_us": times[0] * 1e6,
            "max_us": times[-1] * 1e6, "n": len(times), "what": "rpc_sync(noop)",
            "cpu_us": cpu_us}


def _measure_async(rpc: Any, cfg: WorkloadConfig) -> dict[str, Any]:
    import torch

    def burst(n: int) -> float:
        start = time.perf_counter()
        futures = [rpc.rpc_async(PEER, noop) for _ in range(n)]
        torch.futures.wait_all(futures)
        return n / (time.perf_counter() - start)

    burst(max(1, cfg.async_outstanding // 10))   # warm-up
    runs = []
    cpu = 0.0
    for _ in range(cfg.async_repeats):
        gc.collect()
        before = _cpu_both(rpc)
        runs.append(burst(cfg.async_outstanding))
        cpu += _cpu_both(rpc) - before
    ordered = sorted(runs)
    return {"calls_per_s": ordered[len(ordered) // 2], "runs": runs, "stat": "median",
            "outstanding": cfg.async_outstanding,
            "cpu_us": _cpu_us(0.0, cpu, cfg.async_outstanding * cfg.async_repeats)}


def _sized_call(rpc: Any, section: str, tensor: Any, peer_device: str) -> Callable[[], None]:
    """One timed call of ``section`` with ``tensor``.

    bidirectional: the peer is asked (``rpc_async``, not waited for) to send
    a tensor of the same size back with a nested ``rpc_sync``; meanwhile this
    side sends its own, so both directions are in flight at once.
    """
    if section == "one_way":
        return lambda: rpc.rpc_sync(PEER, consume, args=(tensor,))
    if section == "round_trip":
        return lambda: rpc.rpc_sync(PEER, echo, args=(tensor,))
    back = (rpc.__name__, CALLER, tensor.numel(), peer_device)

    def both_ways() -> None:
        incoming = rpc.rpc_async(PEER, bidir_send, args=back)
        rpc.rpc_sync(PEER, consume, args=(tensor,))
        incoming.wait()

    return both_ways


def _measure_size(rpc: Any, cfg: WorkloadConfig, section: str, size: int, device: str,
                  peer_device: str) -> dict[str, Any]:
    call = _sized_call(rpc, section, filled_tensor(size, device), peer_device)
    count = _adaptive_count(call, cfg.target_s, cfg.min_iters, cfg.max_iters, cfg.warmup_iters)
    gc.collect()
    cpu = _cpu_both(rpc)
    stats = size_stats(_time_calls(call, count), size, SECTIONS[section])
    stats["cpu_us"] = _cpu_us(cpu, _cpu_both(rpc), count)
    return stats


def _measure_dict_echo(rpc: Any, cfg: WorkloadConfig, device: str) -> dict[str, Any]:
    import torch

    elems = cfg.dict_tensor_bytes // 4
    payload = {f"t{i}": torch.full((elems,), float(i), device=device)
               for i in range(cfg.dict_tensors)}

    def call() -> None:
        rpc.rpc_sync(PEER, echo, args=(payload,))

    count = _adaptive_count(call, cfg.target_s, cfg.dict_min_iters, cfg.max_iters,
                            max(cfg.warmup_iters, 5))
    gc.collect()
    cpu = _cpu_both(rpc)
    times = sorted(_time_calls(call, count))
    cpu_us = _cpu_us(cpu, _cpu_both(rpc), count)
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6,
            "n": count, "tensors": cfg.dict_tensors, "tensor_bytes": cfg.dict_tensor_bytes,
            "cpu_us": cpu_us}


def run_workload(rpc: Any, cfg: WorkloadConfig, device: str = "cpu",
                 peer_device: str | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure against ``worker1`` with ``rpc``'s ``rpc_sync``/``rpc_async``.

    Args:
        rpc: any module with torch.distributed.rpc's API, already initialised
            as ``worker0`` (with device maps both ways when ``device`` is a
            GPU).
        cfg: what to measure.
        device / peer_device: where this side's and ``worker1``'s tensors
            live (``"cpu"``, ``"cuda:0"``); the peer's defaults to ours.
        progress: called with a short label after each of the
            :func:`count_steps` steps.

    Returns:
        The schema of :mod:`ucxrpc.bench.report`.
    """
    step = progress or (lambda label: None)
    peer = peer_device or device
    result: dict[str, Any] = {"latency": _measure_latency(rpc, cfg)}
    step("latency")
    result["async"] = _measure_async(rpc, cfg)
    step("throughput")
    for section in SECTIONS:
        result[section] = []
        for size in cfg.sizes:
            result[section].append(_measure_size(rpc, cfg, section, size, device, peer))
            step(f"{section.replace('_', '-')} {format_size(size)}")
    result["dict_echo"] = _measure_dict_echo(rpc, cfg, device)
    step("dict echo")
    return result
