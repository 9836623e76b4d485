"""One worker of the partition tests, run inside a network namespace.

``ip netns exec NS python -m tests.faults._netns_worker CTL RANK INIT_METHOD MODE``

A process started by multiprocessing cannot enter another network
namespace, so the test starts this module with ``ip netns exec``.  It talks
to the test through files in the directory ``CTL``: the workers write
``ready<RANK>``, ``detected<RANK>`` (its call across the partition failed)
and finally ``result<RANK>.json`` (what it saw, as plain data); the test
writes ``down`` (the monotonic time the link went down) and ``up`` once the
link is back.  worker0 hosts the rendezvous store.  Modes:

``heal``     static job; worker0 shuts down during the partition, worker1
             once the link is back (its store gone with worker0).
``cut-off``  static job; worker1 shuts down during the partition too, cut
             off from the store, with ``shutdown(timeout=...)``.
``rejoin``   dynamic group (``world_size=None``); once the link is back
             worker1 leaves (``shutdown()``) and joins again under the same
             name and rank, and the two call each other; then both leave,
             worker0 last.

Every wait has a deadline, so a worker the test forgets still ends; SIGUSR1
dumps every thread's stack to the log.  Transports are restricted to TCP
(shared memory cannot cross namespaces); the test sets ``UCX_NET_DEVICES``
to the veth interface.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.faults import _common as c

#: No step of the test takes longer than this.
STEP_TIMEOUT_S = 40.0
#: The ``timeout`` worker1 passes to ``shutdown`` in mode ``cut-off``.
CUT_OFF_SHUTDOWN_TIMEOUT_S = 2.0
MODES = ("heal", "cut-off", "rejoin")


def _wait_for(path: Path, timeout: float = STEP_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    return path.read_text()


def write(path: Path, text: str) -> None:
    """Write ``path`` at once (a reader never sees it half written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _exchange(peer: str, rank: int) -> None:
    """Calls both ways work: a small one and 16 MiB."""
    import torch

    import ucxrpc as rpc

    assert rpc.rpc_sync(peer, c.add, args=(rank, 1)) == rank + 1
    t = torch.arange(4 << 20, dtype=torch.float32)
    assert torch.equal(rpc.rpc_sync(peer, c.echo, args=(t,)), t)


def _partition(ctl: Path, rank: int, peer: str, out: dict) -> None:
    """Wait for the link to go down; a call across it must fail."""
    import ucxrpc as rpc

    down = float(_wait_for(ctl / "down"))
    out["call"] = c.failure(down, rpc.rpc_sync, peer, c.add, args=(1, 2))
    out["later"] = c.failure(time.monotonic(), rpc.rpc_sync, peer, c.add, args=(1, 2))
    write(ctl / f"detected{rank}", "1")


def run(ctl: Path, rank: int, init_method: str, mode: str) -> dict:
    import ucxrpc as rpc

    peer = f"worker{1 - rank}"
    c.init(rank, 2, init_method, transports=["tcp"])
    out: dict = {}
    _exchange(peer, rank)
    out["pipes"] = [p["lanes"] for p in rpc.get_pipe_info()]
    write(ctl / f"ready{rank}", "1")
    _partition(ctl, rank, peer, out)
    if rank == 1:
        if mode == "cut-off":
            t0 = time.monotonic()
            rpc.shutdown(timeout=CUT_OFF_SHUTDOWN_TIMEOUT_S)
            out["shutdown_s"] = time.monotonic() - t0
            return out
        _wait_for(ctl / "up")
    out["shutdown_s"] = c.timed_shutdown()
    return out


def _join(rank: int, init_method: str) -> None:
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=None,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(
                     init_method=init_method, transports=["tcp"],
                     peer_timeout=c.PEER_TIMEOUT, rpc_timeout=c.RPC_TIMEOUT))


def run_rejoin(ctl: Path, rank: int, init_method: str) -> dict:
    import ucxrpc as rpc

    peer = f"worker{1 - rank}"
    out: dict = {}
    if rank == 1:
        _wait_for(ctl / "joined0")  # rank 0 hosts the store: it joins first
    _join(rank, init_method)
    write(ctl / f"joined{rank}", "1")
    _wait_for(ctl / f"joined{1 - rank}")
    _exchange(peer, rank)
    write(ctl / f"ready{rank}", "1")
    _partition(ctl, rank, peer, out)
    _wait_for(ctl / "up")
    if rank == 1:
        t0 = time.monotonic()
        rpc.shutdown()  # leaves the group: possible again now the store answers
        out["leave_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        _join(1, init_method)  # the same name and rank, a new address
        out["rejoin_s"] = time.monotonic() - t0
        _exchange(peer, rank)
        write(ctl / "rejoined1", "1")
        _wait_for(ctl / "checked0")
    else:
        _wait_for(ctl / "rejoined1")
        _exchange(peer, rank)
        write(ctl / "checked0", "1")
        _wait_for(ctl / "left1")  # the store's host leaves last
    out["shutdown_s"] = c.timed_shutdown()
    if rank == 1:
        write(ctl / "left1", "1")
    return out


def main(argv: list[str]) -> int:
    ctl, rank, init_method, mode = Path(argv[1]), int(argv[2]), argv[3], argv[4]
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")
    return c.report(ctl / f"result{rank}.json",
                    lambda: run_rejoin(ctl, rank, init_method) if mode == "rejoin"
                    else run(ctl, rank, init_method, mode))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
