"""Raw UCX through ucxx's core API: the ceiling ucxrpc is measured against.

The UCX side (worker, endpoint from the peer's worker address, tag send and
receive, polling waits, lane query) is :class:`ucxrpc.transport.ucx.baseline.Pair`,
since only ``transport/`` imports ucxx; this module decides what is sent. No serialization, no threads, no Python
futures: what is left is UCX plus the unavoidable Python call per message.

Rank 0 drives; rank 1 serves. Rank 0 announces each batch with a control
message ``[op, size, count]`` and then runs ``count`` iterations:

- ``PING_PONG``: rank 0 sends ``size`` bytes, rank 1 sends them back
  (the round trip figures, in the run's device memory).
- ``HOST_PING_PONG``: the same in host memory whatever the device: with 8
  bytes, the latency figure, the floor of ucxrpc's no-op ``rpc_sync``
  (which carries no tensor).  An 8-byte ping-pong in CUDA memory is a
  device transfer each way (UCX copies it through its CUDA transports):
  on an H100 it took 326 µs where the host no-op took 258-370, and was
  read as the machine's floor (reviews/gpu-percall-2026-11-28.md); with
  ``--device cuda`` it is reported beside, as ``device_latency``.
- ``ONE_WAY``: rank 0 sends ``size`` bytes, rank 1 answers with 8 bytes
  (the analogue of ``rpc_sync(consume, t)`` returning ``None``).
- ``BIDIR``: both send ``size`` bytes to each other at once.
- ``STOP``: rank 1 acknowledges and both leave.

Buffers are allocated once and reused. What is sent first (rank 0's bytes,
rank 1's in ``BIDIR``) is allocated as the RPC series' tensors are
(:func:`~ucxrpc.bench.workload.filled_tensor`: torch's allocator, host
memory handed to UCX as a numpy view): the baseline moves the same kind
of memory as the calls it is the ceiling of.  Numpy asks the kernel for
transparent huge pages for host arrays from 4 MiB and torch's allocator
does not, and the kernel's copy in ``sendmsg`` reads huge pages faster: a
256 MiB send across two simulated hosts took 110-114 ms from numpy's
memory against 113-120 ms from torch's (three runs alternating the two,
benchmarks/runs/AY.md), a head start the raw baseline had over every
tensor ucxrpc and torch's agent sent.  What lands is received into numpy
arrays (huge pages, as ucxrpc's pooled receive buffers are); CUDA memory
comes from torch either way.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from ..transport.ucx.baseline import Pair, prepare_environment
from ..transport.ucx.binding import ucx_version
from .plan import format_size
from .workload import WorkloadConfig, percentile, size_stats

__all__ = ["raw_peer"]

PING_PONG, ONE_WAY, STOP, BIDIR, HOST_PING_PONG = 1, 2, 3, 4, 5
_SECTION_OPS = {"one_way": ONE_WAY, "round_trip": PING_PONG, "bidirectional": BIDIR}


def _buffer(nbytes: int, fill: int, device: str, *, sent: bool = False) -> Any:
    """A buffer with every page already touched (no faults when timed);
    ``sent``: bytes sent first, allocated as the RPC series' tensors are
    (the module's docstring says why)."""
    if device == "cpu" and not sent:
        import numpy as np

        buf = np.empty(max(nbytes, 8), dtype=np.uint8)
        buf.fill(fill)
        return buf
    from .workload import filled_tensor

    tensor = filled_tensor(max(nbytes, 8), device, fill)
    return tensor.numpy() if device == "cpu" else tensor  # (the view keeps the tensor)


class _Driver:
    """Rank 0: announces batches, times each iteration with perf_counter."""

    def __init__(self, pair: Pair, cfg: WorkloadConfig, device: str) -> None:
        import numpy as np

        self.pair, self.cfg = pair, cfg
        largest = max(cfg.sizes, default=8)
        self.send_buf = _buffer(largest, 1, device, sent=True)
        self.recv_buf = _buffer(largest, 0, device)
        self.device = device
        self.ack = _buffer(8, 0, "cpu")
        self.host_send, self.host_recv = _buffer(8, 1, "cpu"), _buffer(8, 0, "cpu")
        self.ctrl = np.zeros(3, dtype=np.int64)
        self.ctrl_arr = pair.Array(self.ctrl)

    def _announce(self, op: int, size: int, count: int) -> None:
        self.ctrl[:] = (op, size, count)
        self.pair.wait(self.pair.send(self.ctrl_arr, self.pair.tag_ctrl))

    def batch(self, op: int, size: int, count: int) -> list[float]:
        """Run ``count`` iterations of ``op``; seconds per iteration."""
        import time

        pair, Array = self.pair, self.pair.Array
        if op == HOST_PING_PONG:
            send, back = Array(self.host_send[:size]), Array(self.host_recv[:size])
        else:
            send = Array(self.send_buf[:size])
            back = Array(self.ack if op == ONE_WAY else self.recv_buf[:size])
        tag_back = pair.tag_data if op == BIDIR else pair.tag_reply
        times = [0.0] * count
        self._announce(op, size, count)
        clock = time.perf_counter
        for i in range(count):
            start = clock()
            reply = pair.recv(back, tag_back)
            sent = pair.send(send, pair.tag_data)
            pair.wait(sent, reply)
            times[i] = clock() - start
        return times

    def stop(self) -> None:
        reply = self.pair.recv(self.pair.Array(self.ack), self.pair.tag_reply)
        self._announce(STOP, 0, 0)
        self.pair.wait(reply)

    def sized(self, section: str, size: int) -> dict[str, Any]:
        """Warm up, size the batch to ~target_s, time it."""
        cfg, op = self.cfg, _SECTION_OPS[section]
        warm = self.batch(op, size, cfg.warmup_iters)
        estimate = max(warm[-1], 1e-7)
        count = max(cfg.min_iters, min(cfg.max_iters, math.ceil(cfg.target_s / estimate)))
        return size_stats(self.batch(op, size, count), size, 1 if op == ONE_WAY else 2)

    def latency(self, op: int, what: str) -> dict[str, Any]:
        """An 8-byte ping-pong's percentiles, after a warm-up."""
        cfg = self.cfg
        self.batch(op, 8, cfg.latency_warmup)
        lat = sorted(self.batch(op, 8, cfg.latency_iters))
        return {"p50_us": percentile(lat, 50) * 1e6, "p99_us": percentile(lat, 99) * 1e6,
                "mean_us": sum(lat) / len(lat) * 1e6, "min_us": lat[0] * 1e6,
                "max_us": lat[-1] * 1e6, "n": len(lat), "what": what}

    def run(self, step: Callable[[str], None]) -> dict[str, Any]:
        cfg = self.cfg
        result: dict[str, Any] = {
            "latency": self.latency(HOST_PING_PONG, "8-byte tag ping-pong, host memory")}
        if self.device != "cpu":
            result["device_latency"] = self.latency(
                PING_PONG, f"8-byte tag ping-pong, {self.device} memory")
        step("latency")
        for section in _SECTION_OPS:
            result[section] = []
            for size in cfg.sizes:
                result[section].append(self.sized(section, size))
                step(f"{section.replace('_', '-')} {format_size(size)}")
        return result


def _serve(pair: Pair, cfg: WorkloadConfig, device: str) -> None:
    """Rank 1: follow rank 0's batches until STOP."""
    import numpy as np

    Array = pair.Array
    largest = max(cfg.sizes, default=8)
    buf = _buffer(largest, 0, device)       # every message lands here
    out = _buffer(largest, 2, device, sent=True)  # what BIDIR sends back
    host = _buffer(8, 0, "cpu")             # HOST_PING_PONG's
    ack = Array(_buffer(8, 0, "cpu"))
    ctrl = np.zeros(3, dtype=np.int64)
    ctrl_arr = Array(ctrl)
    while True:
        pair.wait(pair.recv(ctrl_arr, pair.tag_ctrl))
        op, size, count = (int(x) for x in ctrl)
        if op == STOP:
            pair.wait(pair.send(ack, pair.tag_reply))
            return
        data = Array((host if op == HOST_PING_PONG else buf)[:size])
        if op == BIDIR:
            mine = Array(out[:size])
            for _ in range(count):
                pair.wait(pair.recv(data, pair.tag_data), pair.send(mine, pair.tag_data))
            continue
        answer = ack if op == ONE_WAY else data
        for _ in range(count):
            pair.wait(pair.recv(data, pair.tag_data))
            pair.wait(pair.send(answer, pair.tag_reply))


def raw_peer(rank: int, cfg: WorkloadConfig, device: str,
             exchange: Callable[[bytes], bytes],
             report: Callable[[dict[str, Any]], None],
             progress: Callable[[str], None] | None = None) -> None:
    """Body of one raw-UCX process (call it in a fresh spawned child).

    Args:
        rank: 0 measures, 1 serves.
        cfg: what to measure (both ranks need the same sizes);
            ``cfg.transports`` goes to ``UCX_TLS``, ``cfg.rpc_timeout``
            bounds every single wait.
        device: this side's buffers: ``"cpu"`` or ``"cuda:N"``.
        exchange: sends this worker's address to the peer and returns the
            peer's (bounded by the caller's timeout).
        report: rank 0 hands its measurements (the schema of
            :mod:`ucxrpc.bench.report`) plus ``transports`` and
            ``ucx_version`` to it, once, before leaving.
        progress: rank 0 calls it with a label after each step.

    Raises:
        TimeoutError: a request did not finish within ``cfg.rpc_timeout``.
        RuntimeError: ucxx was already imported in this process, or UCX
            reported an error (unconverted: a measurement tool).
    """
    prepare_environment(cfg.transports)
    if device != "cpu":
        import torch

        # UCX detects CUDA memory through the context current on this thread.
        torch.cuda.set_device(torch.device(device))
        torch.cuda.synchronize()
    pair = Pair(exchange, cfg.rpc_timeout)
    if rank != 0:
        _serve(pair, cfg, device)
        return
    driver = _Driver(pair, cfg, device)
    result = driver.run(progress or (lambda label: None))
    driver.stop()
    result["transports"] = pair.transports()
    result["ucx_version"] = ucx_version()
    result["settings"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    report(result)
