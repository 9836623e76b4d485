"""Workers of the restart test (tests/hosts/test_restart.py), on simulated hosts.

``python -m tests.hosts._restart CTL ROLE INIT_METHOD``

A dynamic group (``world_size=None``) over TCP: ``worker0`` (role ``first``,
host 0, with the store), then ``worker1`` (role ``peer``, host 1), killed by
the test in the middle of a 64 MiB call from worker0, then a new process
under the same name and rank (role ``again``, host 1), which takes the dead
one's place.  worker0 records what its calls saw before and after; the new
worker1 checks what it receives.  Files in ``CTL``: ``joined-<role>``,
``inflight`` (worker0's large call is on its way), ``failed`` (worker0 saw
it fail), ``checked`` (worker0 is done with the new worker1), then
``<role>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.faults import _common as c
from tests.hosts._outage import wait_file, write

BIG = 16 << 20  # float32 elements: 64 MiB
#: This process, told apart from an earlier one of the same worker (each is
#: PID 1 of its own namespace).
INCARNATION = os.urandom(8).hex()


def incarnation() -> str:
    return INCARNATION


def echo(x: Any) -> Any:
    return x


def slow_echo(x: Any) -> Any:
    time.sleep(5)  # the test kills us meanwhile
    return x


def run(ctl: Path, role: str, init_method: str) -> dict[str, Any]:
    import ucxrpc as rpc

    rank = 0 if role == "first" else 1
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=None,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(
                     init_method=init_method, transports=["tcp"],
                     peer_timeout=c.PEER_TIMEOUT, rpc_timeout=c.RPC_TIMEOUT))
    out: dict[str, Any] = {"incarnation": INCARNATION}
    write(ctl / f"joined-{role}")
    if role == "peer":
        time.sleep(120)  # killed long before this ends
        raise RuntimeError("not killed in time")
    if role == "again":
        wait_file(ctl / "checked")
        out["debug"] = {k: v for k, v in rpc._get_debug_info().items()
                        if k in ("frame_errors", "refused_frames", "watched_requests")}
        out["shutdown_s"] = c.timed_shutdown()  # leaves the group first
        return out
    wait_file(ctl / "joined-peer")
    first = rpc.rpc_sync("worker1", incarnation)
    sent = torch.arange(BIG, dtype=torch.float32)
    fut = rpc.rpc_async("worker1", slow_echo, args=(sent,))
    time.sleep(0.5)  # on its way, or being run
    write(ctl / "inflight")
    out["cut"] = c.failure(0.0, fut.wait)
    write(ctl / "failed")
    wait_file(ctl / "joined-again")
    calls = []
    for i in range(5):
        t = torch.full((BIG // 4,), float(i)) if i % 2 else torch.arange(i * 1000.0)
        calls.append(bool(torch.equal(rpc.rpc_sync("worker1", echo, args=(t,)), t)))
    out.update(first_incarnation=first, again_incarnation=rpc.rpc_sync("worker1", incarnation),
               calls=calls,
               pipes=[{k: p[k] for k in ("peer", "generation", "state", "transports")}
                      for p in rpc.get_pipe_info()])
    write(ctl / "checked")
    out["shutdown_s"] = c.timed_shutdown()
    return out


def main(argv: list[str]) -> int:
    ctl, role, init_method = Path(argv[1]), argv[2], argv[3]
    return c.report(ctl / f"{role}.json", lambda: run(ctl, role, init_method))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
