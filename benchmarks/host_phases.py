"""Whether a slow ucxrpc round is the host's: copies between two processes
measured beside ucxrpc's own echo, round by round.

On the project's 2-core VM, figures around 1 MiB come out bimodal: a 1 MiB
``rpc_sync`` echo takes ~285 µs in some seconds and ~1,030 µs in others, in
the same two processes, with no page faults and the same code path (UCX's
eager copies through shared memory).  Each round here first times a plain
hand-off of 1 MiB between the two worker processes through a shared
mapping (numpy copies, nothing of UCX or ucxrpc; one writes, the other copies
out, and they take turns), then ucxrpc's echo for a second.  When the
hand-off is slow in a round, the echo is too (benchmarks/runs/AD.md):
the machine's cross-core copies have slow phases, and ucxrpc (and torch) see
them.

    python benchmarks/host_phases.py --rounds 10 [--dict]

Prints, per round, µs per 1 MiB hand-off and the echo's p50 in µs.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import cast

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: ucxrpc and tests.workers

N = 1 << 20


def _shared(path: str) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    """A flag word (0: the writer's turn, 1: the reader's) and 1 MiB."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, N + 4096)
        m = mmap.mmap(fd, N + 4096)
    finally:
        os.close(fd)
    return (m, np.frombuffer(m, dtype=np.int64, count=1),
            np.frombuffer(m, dtype=np.uint8, count=N, offset=4096))


def read_side(path: str, secs: float) -> int:
    """Copy the shared MiB out each time the writer flags it (on the callee)."""
    _m, flag, shared = _shared(path)
    out = np.empty(N, np.uint8)
    end = time.monotonic() + secs
    n = 0
    while time.monotonic() < end:
        while flag[0] != 1:
            if time.monotonic() > end:
                return n
        out[:] = shared
        flag[0] = 0
        n += 1
    return n


def echo(x: object) -> object:
    return x


def _target(rank: int, world_size: int, init_method: str, rounds: int, use_dict: bool,
            path: str) -> list[tuple[int, int]] | None:
    import torch

    import host_phases
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    out = None
    if rank == 0:
        _m, flag, shared = _shared(path)
        flag[0] = 0
        src = np.ones(N, np.uint8)
        value = ({f"t{i}": torch.full((1024,), float(i)) for i in range(100)} if use_dict
                 else torch.ones(N, dtype=torch.uint8))
        out = []
        for _ in range(rounds):
            reader = rpc.rpc_async("worker1", host_phases.read_side, (path, 1.0))
            time.sleep(0.05)  # the reader is up
            end, n = time.monotonic() + 0.9, 0
            while time.monotonic() < end:
                while flag[0] != 0:
                    if time.monotonic() > end:
                        break
                shared[:] = src
                flag[0] = 1
                n += 1
            reader.wait()
            flag[0] = 0
            times = []
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                start = time.perf_counter()
                rpc.rpc_sync("worker1", host_phases.echo, (value,))
                times.append(time.perf_counter() - start)
            out.append((round(0.9e6 / max(n, 1)), round(statistics.median(times) * 1e6)))
    rpc.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dict", action="store_true",
                        help="echo the bench's dict of 100 x 4 KiB tensors, not 1 MiB")
    args = parser.parse_args()
    from tests.workers import run_workers

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        path = os.path.join(d, "handoff")
        rows = cast(list[tuple[int, int]], run_workers(
            _target, 2, args=(args.rounds, args.dict, path),
            timeout=30 + 3 * args.rounds,
            env={"PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])})[0])
    print("round  1 MiB hand-off (µs)  echo p50 (µs)")
    for i, (handoff, p50) in enumerate(rows):
        print(f"{i:5d}  {handoff:19d}  {p50:13d}")


if __name__ == "__main__":
    main()
