"""The ucxrpc agent fixture for torch's RPC test suites.

What ``TensorPipeRpcAgentTestFixture`` is to torch's TensorPipe agent: the
mixin :func:`rpc_utils.generate_tests` combines with every suite.  Each test
gets fresh options (torch's suites mutate them) with the ``init_method`` the
test chose (a ``file://`` rendezvous in the test's temporary file, or
``tcp://`` under ``RPC_INIT_WITH_TCP=1``), and ucxrpc's defaults otherwise.

Process start: upstream spawns every rank (``spawn``), and each one imports
torch, torch's test modules and ucxrpc again, about 4 s of CPU per rank.  The
fixture starts ranks from a *forkserver* that has imported
``tests.compat.suites`` once instead (:data:`START_METHOD`; ``"spawn"`` gives
upstream's behaviour).  Importing ucxrpc starts nothing (no thread, no UCX
context), so a fork of that server is as fresh as a spawned process, minus
the imports: a test takes 2-5 s instead of about 20 s on two cores.

Every rank's PID is recorded (:func:`started_pids`) so the runner can kill
whatever a test left behind, by PID, even when torch's own teardown (SIGTERM
only) did not end it.
"""

from __future__ import annotations

import os
import signal
import time

import torch.multiprocessing
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

import ucxrpc
from tests.compat import FORKSERVER_PRELOAD, START_METHODS

__all__ = ["START_METHODS", "UcxRpcAgentTestFixture", "kill_started", "set_start_method",
           "started_pids"]

# The method ranks are started with; set_start_method changes it.
START_METHOD = "forkserver"

_started: list[int] = []


def set_start_method(method: str) -> None:
    """Start ranks with ``method`` (one of :data:`START_METHODS`) from now on."""
    global START_METHOD
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {START_METHODS}, got {method!r}")
    START_METHOD = method


def started_pids() -> list[int]:
    """PIDs of every rank started in this process since the last :func:`kill_started`."""
    return list(_started)


def kill_started(grace: float = 2.0) -> list[int]:
    """SIGKILL every recorded rank still alive after ``grace`` seconds; forget them all.

    Returns the PIDs that had to be killed.  Safe to call at any time; ranks
    that already exited (zombies included) are skipped.
    """
    deadline = time.monotonic() + grace
    alive = [pid for pid in _started if _alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _alive(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _started.clear()
    # Reaps the spawn-method children; forkserver children are reaped by the
    # server.
    torch.multiprocessing.active_children()
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] not in ("Z", "X")


class UcxRpcAgentTestFixture(RpcAgentTestFixture):
    """Runs torch's agent-agnostic RPC suites on ucxrpc."""

    @property
    def rpc_backend(self) -> ucxrpc.BackendType:
        return ucxrpc.BackendType.UCX

    @property
    def rpc_backend_options(self) -> ucxrpc.UcxRpcBackendOptions:
        return ucxrpc.UcxRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        # As torch's TensorPipe fixture: a peer that went away may surface as
        # any of several errors, depending on where the call was.
        return "(.*)"

    def get_timeout_error_regex(self) -> str:
        return "RPC ran for more than"

    def _spawn_processes(self) -> None:  # MultiProcessTestCase's hook
        ctx = torch.multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._start_processes(ctx.Process)
        _started.extend(p.pid for p in self.processes if p.pid is not None)
