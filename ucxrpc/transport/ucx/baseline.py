"""Raw UCX through ucxx's core API, for the benchmark's raw baseline: the
ceiling ucxrpc's RPC is measured against (``ucxrpc.bench.raw`` decides what
is sent; this module is the UCX side, since only ``transport/`` imports ucxx).

One UCX context and worker per process, an endpoint made from the peer's
worker address (with peer-failure error handling on, as ucxrpc's are), tag
send/receive, and the caller polling ``worker.progress()`` — the fastest
progress strategy on a small host (docs/ucx-notes.md, pitfall 2) — yielding the CPU
every few hundred empty spins.  ucxx is imported only inside :class:`Pair`,
after :func:`prepare_environment`, because UCX reads ``UCX_*`` once at load
(pitfall 7).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["Pair", "prepare_environment"]

_TAG_CTRL, _TAG_DATA, _TAG_REPLY = 0x7B01, 0x7B02, 0x7B03
# Spins of progress() between a sched_yield() and between clock reads. Both
# are rare enough to cost nothing while the peer has a core of its own; the
# yield hands the CPU over when both processes share one core (a busy 2-core
# host), where pure spinning would wait out whole scheduler time slices.
_YIELD_EVERY = 256
_DEADLINE_CHECK_EVERY = 4096


def prepare_environment(transports: tuple[str, ...] | None) -> None:
    """Set ``UCX_*`` for this (child) process; must run before ucxx loads.

    Uses the transport layer's own settings so the baseline runs UCX the way
    ucxrpc does: ``UCX_MM_ERROR_HANDLING=y`` (else shared memory is silently
    off with error-handling endpoints, pitfall 1) and ``transports`` mapped
    onto ``UCX_TLS``; where a GPU is usable, UCX's own eager/rendezvous
    switch, as a worker there has it (``cudactx.wanted_device``), whatever
    memory this run sends.
    """
    if "ucxx" in sys.modules:
        raise RuntimeError("ucxx was imported before the baseline set UCX_* variables; "
                           "run the raw peer in a fresh (spawned) process")
    from ..cuda.context import uses_device_memory
    from .environment import environment_problem, ucx_environment

    if (problem := environment_problem()) is not None:  # as a worker would refuse it
        raise ValueError(problem)
    os.environ.update(ucx_environment(transports, device_memory=uses_device_memory(transports)))
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows: a warning
    # per process that would only clutter benchmark output.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


class Pair:
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
            from .ucp import ucp

            return [f"{tl}/{dev}" for tl, dev in ucp().transports(int(self.endpoint.handle))]
        except Exception as exc:  # informational only; never fail a run for it
            logger.debug("ucp_ep_query failed: %s", exc)
            return None
