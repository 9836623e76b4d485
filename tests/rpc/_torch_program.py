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
Children are joined with a timeout and killed if still alive.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

JOIN_S = 90.0
GROUPS = ("spawn", "forkserver", "process", "subprocess")

# What a child started by 'subprocess' runs: it imports torch's RPC itself.
_SUBPROCESS_CODE = """\
import json, os, torch.distributed.rpc as rpc, torch.distributed.autograd as a
print(json.dumps({"who": "subprocess", "pid": os.getpid(), "rpc": rpc.init_rpc.__module__,
                  "autograd": a.backward.__module__}), flush=True)
"""


def seen() -> dict[str, object]:
    """What this process sees where it imported torch's RPC."""
    return {"pid": os.getpid(), "rpc": rpc.init_rpc.__module__,
            "autograd": dist_autograd.backward.__module__,
            "same": sys.modules["torch.distributed.rpc"] is rpc}


def say(who: str, **more: object) -> None:
    print(json.dumps({"who": who, **seen(), **more}), flush=True)


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


def run_pair(group: str) -> None:
    port = free_port()
    if group == "spawn":
        torch.multiprocessing.spawn(_mp_entry, args=(group, port), nprocs=2, join=True)
        return
    ctx = (multiprocessing.get_context("forkserver") if group == "forkserver"
           else multiprocessing)
    procs = [ctx.Process(target=worker, args=(rank, group, port)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_S)
            if p.exitcode != 0:
                raise RuntimeError(f"{group}: {p.name} ended with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def main(groups: list[str]) -> None:
    scripted = torch.jit.script(_scripted)  # TorchScript calling rpc.is_available()
    say("main", scripted=scripted(torch.ones(1)).tolist())
    for group in groups:
        if group == "subprocess":
            subprocess.run([sys.executable, "-c", _SUBPROCESS_CODE], check=True,
                           timeout=JOIN_S)
        else:
            run_pair(group)


def _scripted(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.rpc.is_available():
        return x + 1
    return x


if __name__ == "__main__":
    main(sys.argv[1:] or list(GROUPS))
