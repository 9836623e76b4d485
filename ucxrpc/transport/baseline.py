"""Raw UCX through ucxx's core API: the ceiling ucxrpc's RPC is measured against.

Two processes, one UCX context and worker each, endpoints made from worker
addresses (with peer-failure error handling on, as ucxrpc's are), tag
send/receive into pre-allocated, reused buffers, and the caller polling
``worker.progress()`` — the fastest progress strategy on a small host
(UCX-NOTES pitfall 2) — yielding the CPU every few hundred empty spins. No
serialization, no threads, no Python futures: what is left is UCX plus the
unavoidable Python call overhead per message.

Rank 0 drives; rank 1 serves. Rank 0 announces each batch with a control
message ``[op, size, count]`` and then runs ``count`` iterations:

- ``PING_PONG``: rank 0 sends ``size`` bytes, rank 1 sends them back
  (round-trip bandwidth = 2·size/time; with 8 bytes, the latency figure).
- ``ONE_WAY``: rank 0 sends ``size`` bytes, rank 1 answers with 8 bytes
  (the analogue of ``rpc_sync(consume, t)`` returning ``None``).
- ``STOP``: rank 1 acknowledges and both leave.

The process orchestration (spawn, deadline, killing children) belongs to
the caller (:mod:`ucxrpc.bench.workload`); :func:`baseline_peer` is the body
of one child. ucxx is imported only inside it, after the ``UCX_*``
environment is set, because UCX reads it once at load (pitfall 7).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["BaselineConfig", "baseline_peer"]

PING_PONG, ONE_WAY, STOP = 1, 2, 3
_TAG_CTRL, _TAG_DATA, _TAG_REPLY = 0x7B01, 0x7B02, 0x7B03
# Spins of progress() between a sched_yield() and between clock reads. Both
# are rare enough to cost nothing while the peer has a core of its own; the
# yield hands the CPU over when both processes share one core (a busy 2-core
# host), where pure spinning would wait out whole scheduler time slices.
_YIELD_EVERY = 256
_DEADLINE_CHECK_EVERY = 4096


@dataclass(frozen=True)
class BaselineConfig:
    """What the raw baseline measures.

    Attributes:
        sizes: message sizes in bytes for one-way and round-trip bandwidth.
        latency_iters: timed 8-byte ping-pongs for the latency percentiles.
        latency_warmup: untimed ping-pongs before them.
        target_s: aim for this much timed work per size and mode.
        min_iters / max_iters: bounds on timed iterations per size and mode.
        warmup_iters: untimed iterations per size and mode (first touches of
            large buffers page-fault; UCX registers memory on first use).
        transports: ``None`` for UCX's choice, else names for ``UCX_TLS``
            (the same names and aliases ucxrpc's ``transports=`` takes).
        timeout_s: a single wait (address exchange, one request) gives up
            after this long with ``TimeoutError``.
    """

    # No defaults: the bench's WorkloadConfig owns them and passes every
    # field, so the RPC and raw runs cannot drift apart.
    sizes: tuple[int, ...]
    latency_iters: int
    latency_warmup: int
    target_s: float
    min_iters: int
    max_iters: int
    warmup_iters: int
    transports: tuple[str, ...] | None
    timeout_s: float


def _prepare_environment(transports: tuple[str, ...] | None) -> None:
    """Set ``UCX_*`` for this (child) process; must run before ucxx loads.

    Uses the transport layer's own settings so the baseline runs UCX the way
    ucxrpc does: ``UCX_MM_ERROR_HANDLING=y`` (else shared memory is silently
    off with error-handling endpoints, pitfall 1) and ``transports`` mapped
    onto ``UCX_TLS``.
    """
    if "ucxx" in sys.modules:
        raise RuntimeError("ucxx was imported before the baseline set UCX_* variables; "
                           "run baseline_peer in a fresh (spawned) process")
    from .ucx import ucx_environment

    os.environ.update(ucx_environment(transports))
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows: a warning
    # per process that would only clutter benchmark output.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


class _Pair:
    """One side of the raw pipe: worker, endpoint to the peer, polling waits."""

    def __init__(self, exchange: Callable[[bytes], bytes], timeout_s: float) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._api = ucx_api
        self.Array = Array
        self.timeout_s = timeout_s
        self.context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
        self.worker = ucx_api.UCXWorker(self.context)
        peer = exchange(bytes(self.worker.address.tobytes()))
        self.endpoint = self.worker.create_endpoint_from_worker_address(
            ucx_api.UCXAddress.create_from_buffer(peer), endpoint_error_handling=True)
        self.tag_ctrl = ucx_api.UCXXTag(_TAG_CTRL)
        self.tag_data = ucx_api.UCXXTag(_TAG_DATA)
        self.tag_reply = ucx_api.UCXXTag(_TAG_REPLY)

    def send(self, arr: Any, tag: Any) -> Any:
        return self.endpoint.tag_send(arr, tag)

    def recv(self, arr: Any, tag: Any) -> Any:
        return self.worker.tag_recv(arr, tag)

    def wait(self, *requests: Any) -> None:
        """Poll until every request completes; raise its error, or TimeoutError."""
        progress = self.worker.progress
        spins = 0
        deadline = None
        for req in requests:
            while not req.completed:
                progress()
                spins += 1
                if spins % _YIELD_EVERY == 0:
                    os.sched_yield()
                if spins % _DEADLINE_CHECK_EVERY == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise TimeoutError(f"raw UCX request not done after {self.timeout_s} s")
        for req in requests:
            req.check_error()

    def transports(self) -> list[str] | None:
        """``transport/device`` per endpoint lane as UCX reports it, if it can."""
        try:
            from .ucx import _ucp_ep_query

            return [f"{tl}/{dev}" for tl, dev in _ucp_ep_query(self.endpoint.handle)]
        except Exception as exc:  # informational only; never fail a run for it
            logger.debug("ucp_ep_query failed: %s", exc)
            return None


def _buffer(nbytes: int, fill: int) -> Any:
    """A host buffer with every page already touched (no faults when timed)."""
    import numpy as np

    buf = np.empty(max(nbytes, 8), dtype=np.uint8)
    buf.fill(fill)
    return buf


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    index = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(index, len(sorted_values) - 1)]


class _Driver:
    """Rank 0: announces batches, times each iteration with perf_counter."""

    def __init__(self, pair: _Pair, config: BaselineConfig) -> None:
        import numpy as np

        self.pair = pair
        self.config = config
        largest = max(config.sizes, default=8)
        self.send_buf = _buffer(largest, 1)     # filled once, reused
        self.recv_buf = _buffer(largest, 0)     # echo lands here, reused
        self.ack = _buffer(8, 0)
        self.ctrl = np.zeros(3, dtype=np.int64)
        self.ctrl_arr = pair.Array(self.ctrl)

    def _announce(self, op: int, size: int, count: int) -> None:
        self.ctrl[:] = (op, size, count)
        self.pair.wait(self.pair.send(self.ctrl_arr, self.pair.tag_ctrl))

    def batch(self, op: int, size: int, count: int) -> list[float]:
        """Run ``count`` iterations of ``op``; seconds per iteration."""
        pair, Array = self.pair, self.pair.Array
        send = Array(self.send_buf[:size])
        back = Array(self.recv_buf[:size] if op == PING_PONG else self.ack)
        times = [0.0] * count
        self._announce(op, size, count)
        clock = time.perf_counter
        for i in range(count):
            start = clock()
            reply = pair.recv(back, pair.tag_reply)
            sent = pair.send(send, pair.tag_data)
            pair.wait(sent, reply)
            times[i] = clock() - start
        return times

    def stop(self) -> None:
        reply = self.pair.recv(self.pair.Array(self.ack), self.pair.tag_reply)
        self._announce(STOP, 0, 0)
        self.pair.wait(reply)

    def bandwidth(self, op: int, size: int) -> dict[str, Any]:
        """Warm up, size the batch to ~target_s, time it; GB/s from the median."""
        cfg = self.config
        warm = self.batch(op, size, cfg.warmup_iters)
        estimate = max(warm[-1], 1e-7)
        count = max(cfg.min_iters, min(cfg.max_iters, math.ceil(cfg.target_s / estimate)))
        times = sorted(self.batch(op, size, count))
        moved = size * (2 if op == PING_PONG else 1)
        rates = sorted(moved / t / 1e9 for t in times)
        return {"bytes": size, "iters": count, "gbps": rates[len(rates) // 2],
                "median_s": times[len(times) // 2], "min_s": times[0]}

    def run(self) -> dict[str, Any]:
        cfg = self.config
        self.batch(PING_PONG, 8, cfg.latency_warmup)
        lat = sorted(self.batch(PING_PONG, 8, cfg.latency_iters))
        result: dict[str, Any] = {
            "latency": {"p50_us": _percentile(lat, 50) * 1e6, "p99_us": _percentile(lat, 99) * 1e6,
                        "mean_us": sum(lat) / len(lat) * 1e6, "n": len(lat),
                        "what": "8-byte tag ping-pong"},
            "one_way": [self.bandwidth(ONE_WAY, n) for n in cfg.sizes],
            "round_trip": [self.bandwidth(PING_PONG, n) for n in cfg.sizes],
        }
        return result


def _serve(pair: _Pair, config: BaselineConfig) -> None:
    """Rank 1: follow rank 0's batches until STOP."""
    import numpy as np

    Array = pair.Array
    buf = _buffer(max(config.sizes, default=8), 0)   # every message lands here
    ack = Array(_buffer(8, 0))
    ctrl = np.zeros(3, dtype=np.int64)
    ctrl_arr = Array(ctrl)
    while True:
        pair.wait(pair.recv(ctrl_arr, pair.tag_ctrl))
        op, size, count = (int(x) for x in ctrl)
        if op == STOP:
            pair.wait(pair.send(ack, pair.tag_reply))
            return
        data = Array(buf[:size])
        answer = data if op == PING_PONG else ack
        for _ in range(count):
            pair.wait(pair.recv(data, pair.tag_data))
            pair.wait(pair.send(answer, pair.tag_reply))


def baseline_peer(rank: int, config: BaselineConfig,
                  exchange: Callable[[bytes], bytes],
                  report: Callable[[dict[str, Any]], None]) -> None:
    """Body of one baseline process (call it in a fresh spawned child).

    Args:
        rank: 0 measures, 1 serves.
        config: what to measure (both ranks need the same sizes).
        exchange: sends this worker's address to the peer and returns the
            peer's (bounded by the caller's timeout).
        report: rank 0 hands its measurements (the schema of
            :mod:`ucxrpc.bench.report`) plus ``transports`` and
            ``ucx_version`` to it, once, before leaving.

    Raises:
        TimeoutError: a request did not finish within ``config.timeout_s``.
        RuntimeError: ucxx was already imported in this process, or UCX
            reported an error (the ucxx exception, unconverted: this is a
            measurement tool, not the RPC path).
    """
    _prepare_environment(config.transports)
    pair = _Pair(exchange, config.timeout_s)
    if rank != 0:
        _serve(pair, config)
        return
    driver = _Driver(pair, config)
    result = driver.run()
    driver.stop()
    major, minor, patch = pair._api.get_ucx_version()
    result["transports"] = pair.transports()
    result["ucx_version"] = f"{major}.{minor}.{patch}"
    result["settings"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    report(result)
