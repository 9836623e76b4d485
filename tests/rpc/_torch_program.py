"""A program written for torch's RPC, nothing of ucxrpc in it: what
tests/rpc/test_as_torch.py runs under ``python -m ucxrpc.torch_rpc``.

``python _torch_program.py [group ...]`` (groups: ``spawn``, ``forkserver``,
``process``, ``subprocess``; default all).  The main process says what
``torch.distributed.rpc`` is in it; then for each group, two children
started that way (``torch.multiprocessing.spawn``, a forkserver context,
``multiprocessing.Process`` with the platform's default method) join an
RPC job and each says what it sees, rank 0 after calling rank 1 (and
running a distributed backward through it); ``subprocess`` runs a Python
child that only says what it sees.  Every process prints one JSON line.

The groups run at once, each pair on a port of its own: every child but
the forked ones starts an interpreter that imports torch (seconds of CPU
each), and one after another they left a core idle.  The forked pair
(``process``, the default method on Linux) is started first, before this
process starts anything else.  Children are joined under one deadline and
killed if still alive.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

JOIN_S = 90.0
GROUPS = ("spawn", "forkserver", "process", "subprocess")

# What a child started by 'subprocess' runs: it imports torch's RPC itself.
_SUBPROCESS_CODE = """\
import json, os, sys, torch.distributed.rpc as rpc, torch.distributed.autograd as a
sys.stdout.write(json.dumps({"who": "subprocess", "pid": os.getpid(),
                             "rpc": rpc.init_rpc.__module__,
                             "autograd": a.backward.__module__}) + "\\n")
sys.stdout.flush()
"""


def seen() -> dict[str, object]:
    """What this process sees where it imported torch's RPC."""
    return {"pid": os.getpid(), "rpc": rpc.init_rpc.__module__,
            "autograd": dist_autograd.backward.__module__,
            "same": sys.modules["torch.distributed.rpc"] is rpc}


def say(who: str, **more: object) -> None:
    # One write of the whole line: the groups' children print at once, and
    # print() writes the line and its end apart where stdout is unbuffered.
    sys.stdout.write(json.dumps({"who": who, **seen(), **more}) + "\n")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def worker(rank: int, group: str, port: int) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              rpc_timeout=60, _transports=["uv"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=options)
    more: dict[str, object] = {}
    if rank == 0:
        more["callee"] = rpc.rpc_sync("worker1", seen)
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", double, args=(x,))
            dist_autograd.backward(context_id, [y.sum()])
            more["grad"] = dist_autograd.get_gradients(context_id)[x].tolist()
    rpc.shutdown()
    say(f"{group}/rank{rank}", **more)


def _mp_entry(rank: int, group: str, port: int) -> None:  # torch.multiprocessing.spawn's order
    worker(rank, group, port)


class _Pair:
    """One group's children, started by :meth:`start`, joined by :meth:`join`."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.procs: list = []
        self.context = None  # torch.multiprocessing.spawn's, for "spawn"

    def start(self) -> None:
        port = free_port()
        if self.group == "spawn":
            self.context = torch.multiprocessing.spawn(_mp_entry, args=(self.group, port),
                                                       nprocs=2, join=False)
            self.procs = list(self.context.processes)
            return
        if self.group == "subprocess":
            self.procs = [subprocess.Popen([sys.executable, "-c", _SUBPROCESS_CODE])]
            return
        ctx = (multiprocessing.get_context("forkserver") if self.group == "forkserver"
               else multiprocessing)
        for rank in range(2):
            p = ctx.Process(target=worker, args=(rank, self.group, port))
            p.start()
            self.procs.append(p)

    def join(self, deadline: float) -> None:
        if self.context is not None:  # raises with the child's traceback if one failed
            while not self.context.join(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{self.group}: still running after {JOIN_S} s")
            return
        for p in self.procs:
            if isinstance(p, subprocess.Popen):
                code = p.wait(max(0.0, deadline - time.monotonic()))
            else:
                p.join(max(0.0, deadline - time.monotonic()))
                code = p.exitcode
            if code != 0:
                raise RuntimeError(f"{self.group}: a child ended with {code}")

    def kill(self) -> None:
        for p in self.procs:
            if isinstance(p, subprocess.Popen):
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
            elif p.is_alive():
                p.kill()
                p.join(5)


def main(groups: list[str]) -> None:
    scripted = torch.jit.script(_scripted)  # TorchScript calling rpc.is_available()
    say("main", scripted=scripted(torch.ones(1)).tolist())
    # The forked pair first: a fork before anything else is started here.
    pairs = [_Pair(g) for g in sorted(groups, key=lambda g: g != "process")]
    deadline = time.monotonic() + JOIN_S
    try:
        for pair in pairs:
            pair.start()
        for pair in pairs:
            pair.join(deadline)
    finally:
        for pair in pairs:
            pair.kill()


def _scripted(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.rpc.is_available():
        return x + 1
    return x


if __name__ == "__main__":
    main(sys.argv[1:] or list(GROUPS))
