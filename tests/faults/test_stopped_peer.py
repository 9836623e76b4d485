"""A peer that stops responding without closing anything (SIGSTOP).

The victim (worker2) is stopped by worker0: its process, sockets and shared
memory stay; it just does not run.  That is silence, not death: its kernel
keeps answering TCP keepalive on its lifeline, so it is never declared dead,
however long it stays stopped (several times ``peer_timeout`` here).  Calls to
it fail by their own ``rpc_timeout``, as in torch; once it is continued
(SIGCONT), the same pipe carries calls again.  worker1 is unaffected
throughout, and everyone shuts down.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults import _common as c
from tests.workers import run_with_victim, sigstop

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

#: Short, so that the stop outlasts it many times over.
PEER_TIMEOUT = 0.5
CALL_TIMEOUT = 2.0
STOPPED_S = 4.0


def _victim(rank, world_size, init_method):
    import ucxrpc as rpc

    c.init(rank, world_size, init_method, peer_timeout=PEER_TIMEOUT)
    c.wait_for_go(80)
    rpc.shutdown()


def _survivor(rank, world_size, init_method, full_world):
    import torch

    import ucxrpc as rpc

    c.init(rank, full_world, init_method, peer_timeout=PEER_TIMEOUT)
    out = {}
    if rank == 0:
        victim_pid = rpc.rpc_sync(c.VICTIM, c.pid)
        sigstop(victim_pid)  # returns once it is stopped, not when the signal is queued
        start = time.monotonic()
        try:
            pending = rpc.rpc_async(c.VICTIM, c.echo, args=(torch.ones(1 << 20),),
                                    timeout=CALL_TIMEOUT)
            out["while_stopped"] = c.failure(start, pending.wait)
            c.check_third(4 << 20)
            time.sleep(max(0.0, STOPPED_S - (time.monotonic() - start)))
            out["pipe_while_stopped"] = rpc.get_pipe_info(c.VICTIM)[0]["state"]
        finally:
            os.kill(victim_pid, signal.SIGCONT)
        out["after_cont"] = c.failure(time.monotonic(), rpc.rpc_sync, c.VICTIM, c.add,
                                      args=(1, 2))
        out["pipe"] = rpc.get_pipe_info(c.VICTIM)[0]
        out["failures"] = rpc._get_debug_info()["peer_failures"]
        rpc.rpc_sync(c.VICTIM, c.go)
        rpc.rpc_sync(c.THIRD, c.go)
    else:
        c.wait_for_go()
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_stopped_peer_times_out_and_comes_back():
    res = run_with_victim(_victim, _survivor, c.WORLD, args=(c.WORLD,), timeout=80)
    r0 = res[0]
    print(f"\n  SIGSTOP for {STOPPED_S} s (peer_timeout={PEER_TIMEOUT} s, call timeout "
          f"{CALL_TIMEOUT} s): {r0['while_stopped']}; after SIGCONT: {r0['after_cont']}")
    stopped = r0["while_stopped"]
    assert stopped["type"] is not None, f"a call to a stopped peer returned: {stopped}"
    assert "RpcTimeoutError" in stopped["classes"] and "RuntimeError" in stopped["classes"]
    assert "ran for more than set timeout" in stopped["message"], stopped
    assert stopped["elapsed"] >= CALL_TIMEOUT - 0.05, stopped
    assert r0["pipe_while_stopped"] == "open"
    assert r0["after_cont"]["value"] == "3", r0["after_cont"]
    assert (r0["pipe"]["state"], r0["pipe"]["lifeline"]) == ("open", "up"), r0["pipe"]
    assert r0["failures"] == 0, r0
    for rank, r in enumerate(res):
        c.check_shutdown(r["shutdown_s"], f"worker{rank}")
