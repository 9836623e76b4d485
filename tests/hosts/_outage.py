"""A worker of the outage test (tests/hosts/test_outage.py), on a simulated host.

``python -m tests.hosts._outage CTL RANK INIT_METHOD [DEVICE]``

worker0 (with the store) on host 0, worker1 on host 1, over TCP, with a
short ``peer_timeout`` (:data:`PEER_TIMEOUT`).  Each calls the other all the
time (a 1 MiB tensor every :data:`CALL_EVERY_S`, its echo checked) and
records every call: when it started and ended, and what it returned or
raised.  Before the outages worker0 also makes state that spans them: an
RRef owned by worker1 and a distributed autograd context whose forward pass
crossed to worker1.  The test cuts and heals the link; the files in ``CTL``:

=================  ====================================================
``ready<R>``       the worker is up and calling (worker)
``big``            worker1: start a 256 MiB (1 GiB) echo by worker0 now, so that
                   the cut finds it in flight (test); ``big-started``
                   (worker1)
``lost<R>``        the worker's first call failed as unreachable (worker)
``quiet``          stop calling (test); ``paused<R>`` (worker, with its
                   transport's debug info: nothing may be left watched)
``resume<R>``      a FIFO (made by the worker before ``paused<R>``):
                   call again once the test writes to it (:func:`tell`).
                   The test measures the worker's CPU meanwhile, so its
                   main thread sleeps in the kernel until then, rather
                   than looking for a file every so often.
``done``           stop; then the spanning state is tried, both shut
                   down and write ``worker<R>.json`` (test, then worker)
``leaving<R>``     the worker is about to shut down; each waits for the
                   other's (worker)
=================  ====================================================

With DEVICE ``cuda`` (a GPU test) the 256 MiB tensor lives on ``cuda:0``
of both workers (device maps both ways, ``tcp,cuda_copy``): the cut finds
worker0 receiving into device memory, and ``paused<R>`` says whether the
memory the transfer took went back (``torch.cuda.memory_allocated()``
against before it); after the heal a device tensor goes both ways again.

Every wait has a deadline; SIGUSR1 dumps every thread's stack to the log.
"""

from __future__ import annotations

import errno
import json
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests.faults import _common as c

#: After the heal, how long what the outage left held may take to go but
#: for one eager message's receive (:func:`_settled`'s ``allowed``): the
#: rest ends with the endpoints discarded, within 0.1 s in every run seen.
#: Bounded far above that, as a receive held for good shows as held.
AFTER_HEAL_S = 10.0
#: Seconds a silent host is given before it is declared unreachable.
PEER_TIMEOUT = 3.0
#: Far above every bound of the test: a call that fails before it failed
#: because its peer was found unreachable, not by its own timeout.
RPC_TIMEOUT = 30.0
CALL_EVERY_S = 0.05
PAYLOAD = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
BIG = torch.ones(64 << 20, dtype=torch.float32)       # 256 MiB
#: On a GPU: a GPU machine's link is faster, and the cut must find the
#: transfer in flight for its memory to be checked.
BIG_CUDA_ELEMENTS = 256 << 20                           # 1 GiB
STEP_TIMEOUT_S = 90.0


def write(path: Path, text: str = "1") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_file(path: Path, timeout: float = STEP_TIMEOUT_S, every: float = 0.02) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(every)
    return path.read_text()


def wait_fifo(path: Path, timeout: float = STEP_TIMEOUT_S) -> None:
    """Wait until :func:`tell` writes to the FIFO ``path``, which must
    exist (no writer yet: poll reports nothing until one writes)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            raise TimeoutError(f"nothing written to {path} within {timeout} s")
    finally:
        os.close(fd)


def tell(path: Path, timeout: float = STEP_TIMEOUT_S) -> None:
    """Write to the FIFO ``path`` once its reader (:func:`wait_fifo`) has it
    open."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # no reader yet
    try:
        os.write(fd, b"1")
    finally:
        os.close(fd)


def echo(x: Any) -> Any:
    return x


def make_value(v: int) -> int:
    return v


class Caller(threading.Thread):
    """Calls ``peer`` every CALL_EVERY_S while not paused; records each call."""

    def __init__(self, ctl: Path, rank: int, peer: str) -> None:
        super().__init__(name="outage-caller", daemon=True)
        self.ctl, self.rank, self.peer = ctl, rank, peer
        self.records: list[dict[str, Any]] = []
        self.calling = threading.Event()
        self.calling.set()
        self.idle = threading.Event()
        self.stop = threading.Event()
        self.lost = False

    def run(self) -> None:
        import ucxrpc as rpc

        n = 0
        while not self.stop.is_set():
            if not self.calling.is_set():
                self.idle.set()
                self.calling.wait(STEP_TIMEOUT_S)  # no wake-ups: the test measures our CPU
                continue
            self.idle.clear()
            n += 1
            sent = PAYLOAD + n
            start = time.monotonic()
            rec: dict[str, Any] = {"start": start}
            try:
                got = rpc.rpc_sync(self.peer, echo, args=(sent,))
                rec["ok"] = bool(torch.equal(got, sent))
                if not rec["ok"]:
                    rec["error"] = "wrong value"
            except Exception as exc:  # the point: what a caller sees
                rec.update(ok=False, type=type(exc).__name__,
                           classes=[k.__name__ for k in type(exc).__mro__],
                           error=str(exc).split("\n", 1)[0][:400])
                if not self.lost and rec["type"] == "UnreachableError":
                    self.lost = True
                    write(self.ctl / f"lost{self.rank}")
            rec["end"] = time.monotonic()
            self.records.append(rec)
            time.sleep(max(0.0, CALL_EVERY_S - (rec["end"] - start)))


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        return {"value": fn()}
    except Exception as exc:  # the point: what a user sees
        return {"type": type(exc).__name__, "classes": [k.__name__ for k in type(exc).__mro__],
                "error": str(exc)}


def _settled(rpc: Any, cuda: bool, base: int, timeout: float = 10.0,
             allowed: int = 0) -> dict[str, Any]:
    """Once the loop let go of the cut transfer's requests and freed what
    they held (it prunes ended ones every second) but for ``allowed``
    bytes, or at the deadline: what is still held."""
    import gc

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        leaked = 0
        if cuda:
            torch.cuda.synchronize()
            leaked = torch.cuda.memory_allocated() - base
        info = rpc._get_debug_info()
        retired, held = info["retired_requests"], info["retired_bytes"]
        freed = not retired or (allowed and held <= allowed)
        if (freed and not leaked) or time.monotonic() > deadline:
            out = {"retired_requests": retired, "retired_bytes": held}
            return {**out, "cuda_leaked": leaked} if cuda else out
        time.sleep(0.1)


def run(ctl: Path, rank: int, init_method: str, device: str = "cpu") -> dict[str, Any]:
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    peer = f"worker{1 - rank}"
    cuda = device == "cuda"
    extra: dict[str, Any] = {}
    if cuda:
        extra = {"device_maps": {peer: {0: 0}}, "devices": [0]}
    c.init(rank, 2, init_method, transports=["tcp", "cuda_copy"] if cuda else ["tcp"],
           peer_timeout=PEER_TIMEOUT, rpc_timeout=RPC_TIMEOUT, **extra)
    big_value = BIG
    if cuda and rank == 1:
        big_value = torch.ones(BIG_CUDA_ELEMENTS, dtype=torch.float32, device="cuda")
    base = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    out: dict[str, Any] = {"pipes": rpc.get_pipe_info()}
    assert torch.equal(rpc.rpc_sync(peer, echo, args=(PAYLOAD,)), PAYLOAD)
    with dist_autograd.context() as ctx:
        rref = x = loss = None
        if rank == 0:
            rref = rpc.remote(peer, make_value, args=(41,))
            assert rref.to_here() == 41
            x = torch.ones(4, requires_grad=True)
            loss = rpc.rpc_sync(peer, torch.mul, args=(x, 3.0)).sum()
        caller = Caller(ctl, rank, peer)
        caller.start()
        write(ctl / f"ready{rank}")
        if rank == 1:
            wait_file(ctl / "big")
            big = rpc.rpc_async(peer, echo, args=(big_value,))
            write(ctl / "big-started")
        wait_file(ctl / "quiet")
        caller.calling.clear()
        caller.idle.wait(10)
        time.sleep(0.5)  # the loop's last requests complete or are let go
        info = rpc._get_debug_info()
        out["quiet"] = {"watched_requests": info["watched_requests"],
                        "poll_decision": info["progress"]["poll_decision"],
                        "broken_peers": info["broken_peers"]}
        # A receive UCX matched to a call's first fragments as the link went
        # cannot be cancelled: it ends when the old connection does, after
        # the heal (test_outage.py).
        out["quiet"].update(_settled(rpc, cuda, base, allowed=PAYLOAD.nbytes))
        os.mkfifo(ctl / f"resume{rank}")
        write(ctl / f"paused{rank}", json.dumps(out["quiet"]))
        wait_fifo(ctl / f"resume{rank}")
        caller.calling.set()
        wait_file(ctl / "done")
        caller.stop.set()
        caller.calling.set()
        caller.join(10)
        out["calls"] = caller.records
        if cuda:  # the link back: device memory moves both ways again
            ones = torch.ones(1 << 18, device="cuda")
            out["device_echo"] = _attempt(
                lambda: torch.equal(rpc.rpc_sync(peer, echo, args=(ones,)), ones))
        if rank == 1:
            out["big"] = _attempt(lambda: torch.equal(big.wait(), big_value))
        else:
            # State that spanned the outage: it goes on, or fails naming it.
            out["rref"] = _attempt(rref.to_here)
            out["rref_new"] = _attempt(
                lambda: rpc.remote(peer, make_value, args=(42,)).to_here())
            out["backward"] = _attempt(
                lambda: bool(dist_autograd.backward(ctx, [loss]) or
                             torch.equal(dist_autograd.get_gradients(ctx)[x],
                                         torch.full((4,), 3.0))))
    if rank == 0:
        def fresh_backward() -> bool:
            with dist_autograd.context() as ctx2:
                y = torch.ones(4, requires_grad=True)
                dist_autograd.backward(ctx2, [rpc.rpc_sync(peer, torch.mul, args=(y, 2.0)).sum()])
                return bool(torch.equal(dist_autograd.get_gradients(ctx2)[y],
                                        torch.full((4,), 2.0)))
        out["backward_new"] = _attempt(fresh_backward)
    settling = time.monotonic()
    out["after_heal"] = _settled(rpc, False, 0, timeout=AFTER_HEAL_S, allowed=PAYLOAD.nbytes)
    out["after_heal"]["settled_s"] = round(time.monotonic() - settling, 2)
    out["debug"] = {k: v for k, v in rpc._get_debug_info().items()
                    if k in ("lifelines_lost", "lifelines_back", "lifeline_cuts", "peer_failures",
                             "watched_requests", "retired_requests", "pipes_renewed", "connections_cut",
                             "frame_errors", "refused_frames")}
    # Both start their shutdown together, so that its time is the shutdown's
    # own: one that got there first would wait in the shutdown barrier for
    # the other's last steps (its _settled), the likely cause of a
    # "shutdown" of 10.2 s in 2 of 44 runs (Run AU).
    write(ctl / f"leaving{rank}")
    wait_file(ctl / f"leaving{1 - rank}")
    out["shutdown_s"] = c.timed_shutdown()
    return out


def main(argv: list[str]) -> int:
    ctl, rank, init_method = Path(argv[1]), int(argv[2]), argv[3]
    device = argv[4] if len(argv) > 4 else "cpu"
    return c.report(ctl / f"worker{rank}.json", lambda: run(ctl, rank, init_method, device))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
