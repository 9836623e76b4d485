"""A peer SIGKILLed in the middle of a 256 MiB transfer.

worker0 sends a large tensor to the victim (worker2), or the victim is
sending one back, when the victim is killed, over shared memory and over
TCP.  The call fails within a second with an error naming worker2 (the
victim's kernel closes its lifeline), the pipe to worker1 still carries
small and large calls, and both survivors shut down.

Nothing times the kill against a measured transfer: the kill comes a few
milliseconds after the transfer starts, and a call that succeeds anyway
means the transfer was over before the kill and fails the test with that
explanation.

Over shared memory a sender killed mid-copy can leave the receiver's UCX
receive queue stuck for good (ucxrpc/transport/watch/canary.py): in the download
case worker0 may then be cut off from every local peer.  The test accepts
that outcome only as the clear error that names it, in bounded time, and
only when worker0's own check found the queue stuck.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.faults import _common as c
from tests.workers import run_with_victim
from ucxrpc.transport.watch import canary
from ucxrpc.transport.watch.canary import FIFO_TRANSPORTS

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

NBYTES = 256 << 20
#: The unaffected pipe's large call: a quarter of NBYTES keeps the test short.
THIRD_NBYTES = 64 << 20
#: UCX_TLS for each kind of pipe (None: UCX's choice, shared memory).
PIPES = {"shared-memory": None, "tcp": "tcp"}
KILL_AFTER_S = 0.02


def big_reply_then_die(nbytes, kill_after, stamp_path):
    """Return ``nbytes`` of tensor; SIGKILL this process while it is sent."""
    import torch

    value = torch.full((nbytes // 4,), 7.0)
    threading.Timer(kill_after, c.kill_self, args=(stamp_path,)).start()
    return value


def _survivor(rank, world_size, init_method, full_world, direction, stamp_path):
    import torch

    import ucxrpc as rpc

    c.init(rank, full_world, init_method)
    out = {}
    if rank == 0:
        victim_pid = rpc.rpc_sync(c.VICTIM, c.pid)  # the pipe is open and works
        out["victim_transports"] = rpc.get_pipe_info(c.VICTIM)[0]["transports"]
        if direction == "upload":
            big = torch.full((NBYTES // 4,), 3.0)
            fut = rpc.rpc_async(c.VICTIM, c.echo, args=(big,))
            time.sleep(KILL_AFTER_S)
            os.kill(victim_pid, signal.SIGKILL)
            killed = time.monotonic()
            out["in_flight"] = c.failure(killed, fut.wait)
        else:
            start = time.monotonic()
            out["in_flight"] = c.failure(start, rpc.rpc_sync, c.VICTIM, big_reply_then_die,
                                         args=(NBYTES, KILL_AFTER_S, stamp_path))
            # Timed from the kill, not from the call.
            out["in_flight"]["elapsed"] -= c.read_stamp(stamp_path) - start
        # Once detected, a new call fails at once.
        out["later"] = c.failure(time.monotonic(), rpc.rpc_sync, c.VICTIM, c.add, args=(1, 2))
        # The pipe to worker1 was not touched: small and large calls still
        # work, unless the victim left our receive queue stuck.
        out["third"] = c.failure(time.monotonic(), c.check_third, THIRD_NBYTES)
        info = rpc._get_debug_info()
        out["fifo_checks"], out["fifo_stuck"] = info["fifo_checks"], info["fifo_stuck"]
    return c.finish(rank, out, go_file=stamp_path + ".go")


@pytest.mark.parametrize("pipe", list(PIPES))
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_peer_killed_during_large_transfer(direction, pipe, tmp_path):
    stamp = str(tmp_path / "killed-at")
    env = {"UCX_TLS": PIPES[pipe]} if PIPES[pipe] else None
    res = run_with_victim(c.victim_main, _survivor, c.WORLD, args=(c.WORLD, direction, stamp),
                          timeout=80, env=env)
    print(f"\n  SIGKILL during a 256 MiB {direction} over {res[0]['victim_transports']}:")
    assert res[0]["in_flight"]["type"] is not None, \
        f"the call finished before the kill, so nothing was tested: {res[0]['in_flight']}"
    c.check_failure(res[0]["in_flight"], c.VICTIM, "call in flight")
    c.check_failure(res[0]["later"], c.VICTIM, "later call", bound=1.0)
    # The death of a peer reached through a shared-memory FIFO ran the check.
    if FIFO_TRANSPORTS & set(res[0]["victim_transports"]):
        assert res[0]["fifo_checks"] >= 1, res[0]
    third, stuck = res[0]["third"], res[0]["fifo_stuck"]
    if stuck is None:
        assert third["type"] is None, f"the pipe to worker1 failed: {third}"
    else:
        print(f"  worker0's shared-memory receive queue was left stuck: {stuck}")
        # A call to worker1 begun while the canary still waits learns the
        # queue is stuck only from the canary's verdict.
        c.check_failure(third, c.THIRD, "call to worker1", bound=canary.WAIT_S + c.FAIL_BOUND_S)
        assert "receive queue is stuck since worker2 failed" in third["message"], third
    for rank, r in enumerate(res):
        c.check_shutdown(r["shutdown_s"], f"worker{rank}")
