"""A peer that stops responding without closing anything (SIGSTOP).

The victim (worker2) stops itself inside a call: its process, sockets and
shared memory stay, it just never answers.  With an RPC timeout far above
``peer_timeout``, calls to it fail by failure detection, naming it, in
about ``peer_timeout``; worker1 is unaffected; both survivors shut down.
The stopped process is killed in cleanup.
"""

from __future__ import annotations

import time

import pytest

from tests.faults import _common as c
from tests.workers import run_with_victim

pytestmark = pytest.mark.timeout(90)


def _survivor(rank, world_size, init_method, full_world):
    import torch

    import ucxrpc as rpc

    c.init(rank, full_world, init_method)
    out = {}
    if rank == 0:
        assert rpc.rpc_sync(c.VICTIM, c.add, args=(1, 2)) == 3
        stopped = rpc.rpc_async(c.VICTIM, c.stop_self)
        time.sleep(0.2)
        start = time.monotonic()
        # Sent to a stopped process: nothing answers, nothing fails at once.
        after = rpc.rpc_async(c.VICTIM, c.echo, args=(torch.ones(1 << 20),))
        out["stopping_call"] = c.failure(start, stopped.wait)
        out["call_to_stopped"] = c.failure(start, after.wait)
        out["later"] = c.failure(time.monotonic(), rpc.rpc_sync, c.VICTIM, c.add, args=(1, 2))
        c.check_third(4 << 20)
    return c.finish(rank, out)


def test_stopped_peer_is_detected():
    res = run_with_victim(c.victim_main, _survivor, c.WORLD, args=(c.WORLD,), timeout=80)
    r0 = res[0]
    print(f"\n  SIGSTOP (peer_timeout={c.PEER_TIMEOUT} s, rpc_timeout={c.RPC_TIMEOUT} s):")
    c.check_failure(r0["stopping_call"], c.VICTIM, "the call that stopped it")
    c.check_failure(r0["call_to_stopped"], c.VICTIM, "a call sent to the stopped peer")
    c.check_failure(r0["later"], c.VICTIM, "later call", bound=1.0)
    for rank, r in enumerate(res):
        c.check_shutdown(r["shutdown_s"], f"worker{rank}")
