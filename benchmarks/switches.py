#!/usr/bin/env python
"""What a large call across two hosts costs each thread: per call, the
wall time, the CPU (user and system) and the context switches of every
thread of both processes, for ucxrpc's ``rpc_sync(consume, t)`` and for raw
ucxx's send of the same bytes and an 8-byte acknowledgement.

Two simulated hosts as ``ucxrpc bench --hosts netns`` makes them (root;
network namespaces joined by a veth pair, so both go over TCP).  Raw ucxx
and ucxrpc run one after the other, alternating, ``--pairs`` times; each
run times ``--calls`` calls after ten warm-up calls.  Each thread's counts
come from ``/proc/self/task`` (Python threads all show as ``python``: a
thread's share says which it is, the one with the CPU drives the data).

A thread that wakes while both cores move data preempts one of the
threads moving it: the involuntary switches of the driving threads count
those wake-ups.  This is how Run AS found the progress thread's periodic
wake-ups while parked (benchmarks/runs/AS.md).  Nothing here asserts a time:
it is a measurement.

    sudo python benchmarks/switches.py [--size 16M] [--calls 200] [--pairs 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: ucxrpc

WARMUP = 10


def threads() -> dict[str, tuple[str, int, int, int, int]]:
    """Per thread of this process: name, voluntary and involuntary context
    switches, user and system clock ticks."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            status = dict(line.split(":\t", 1) for line in
                          open(f"/proc/self/task/{tid}/status").read().splitlines()
                          if ":\t" in line)
            stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        out[tid] = (comm, int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"]), int(stat[11]), int(stat[12]))
    return out


def per_call(before: dict, after: dict, calls: int) -> list[dict[str, Any]]:
    """Each thread's counts per call, the busiest first (threads idle over
    the run left out)."""
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    rows = []
    for tid, (name, vol, invol, user, system) in after.items():
        _, vol0, invol0, user0, system0 = before.get(tid, (name, 0, 0, 0, 0))
        row = {"thread": name, "voluntary": (vol - vol0) / calls,
               "involuntary": (invol - invol0) / calls,
               "user_ms": (user - user0) * tick_ms / calls,
               "system_ms": (system - system0) * tick_ms / calls}
        if any(row[k] for k in ("voluntary", "involuntary", "user_ms", "system_ms")):
            rows.append(row)
    return sorted(rows, key=lambda r: -(r["user_ms"] + r["system_ms"]))


def consume(t: Any) -> None:
    return None


def _ucxrpc_rank(rank: int, size: int, calls: int) -> dict[str, Any] | None:
    import torch

    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out = None
    if rank == 0:
        x = torch.ones(size, dtype=torch.uint8)
        for _ in range(WARMUP):
            rpc.rpc_sync("worker1", consume, (x,))
        theirs0, mine0 = rpc.rpc_sync("worker1", threads), threads()
        start = time.perf_counter()
        for _ in range(calls):
            rpc.rpc_sync("worker1", consume, (x,))
        wall = (time.perf_counter() - start) / calls
        mine1, theirs1 = threads(), rpc.rpc_sync("worker1", threads)
        out = {"impl": "ucxrpc", "ms_per_call": wall * 1e3,
               "caller": per_call(mine0, mine1, calls), "callee": per_call(theirs0, theirs1, calls)}
    rpc.shutdown()
    return out


def _raw_rank(rank: int, size: int, calls: int) -> dict[str, Any] | None:
    import numpy as np
    from torch.distributed import TCPStore

    from ucxrpc.transport.ucx.baseline import Pair, prepare_environment

    prepare_environment(None)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0,
                     timeout=datetime.timedelta(seconds=60))

    def exchange(mine: bytes) -> bytes:
        store.set(f"address{rank}", mine)
        return store.get(f"address{1 - rank}")

    pair = Pair(exchange, 60.0)
    buf = np.ones(size, dtype=np.uint8)
    ack = np.zeros(8, dtype=np.uint8)
    before: dict = {}
    if rank == 1:
        for i in range(WARMUP + calls):
            if i == WARMUP:
                before = threads()
            pair.wait(pair.recv(pair.Array(buf), pair.tag_data))
            pair.wait(pair.send(pair.Array(ack), pair.tag_reply))
        store.set("callee", json.dumps(per_call(before, threads(), calls)))
        store.get("done")  # the caller has read it
        return None
    start = 0.0
    for i in range(WARMUP + calls):
        if i == WARMUP:
            before, start = threads(), time.perf_counter()
        reply = pair.recv(pair.Array(ack), pair.tag_reply)
        pair.wait(pair.send(pair.Array(buf), pair.tag_data), reply)
    wall = (time.perf_counter() - start) / calls
    out = {"impl": "raw ucxx", "ms_per_call": wall * 1e3,
           "caller": per_call(before, threads(), calls),
           "callee": json.loads(store.get("callee"))}
    store.set("done", "1")
    return out


def _rank(impl: str, size: int, calls: int, out_path: str) -> None:
    rank = int(os.environ["RANK"])
    run = _ucxrpc_rank if impl == "ucxrpc" else _raw_rank
    result = run(rank, size, calls)
    if result is not None:
        with open(out_path, "w") as f:
            json.dump(result, f)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _one(impl: str, size: int, calls: int, tmp: str) -> dict[str, Any]:
    from _twohosts import run_ranks

    out_path = os.path.join(tmp, f"{impl.replace(' ', '_')}.json")
    run_ranks("ucxw", [sys.executable, os.path.abspath(__file__), "--rank-of", impl,
                       "--size", str(size), "--calls", str(calls), "--out", out_path],
              timeout_s=300)
    with open(out_path) as f:
        return json.load(f)


def _show(result: dict[str, Any]) -> None:
    print(f"{result['impl']}: {result['ms_per_call']:.2f} ms a call")
    for side in ("caller", "callee"):
        for row in result[side]:
            print(f"  {side} {row['thread']:<16} switches {row['voluntary']:5.2f} vol "
                  f"{row['involuntary']:5.2f} invol   CPU {row['user_ms']:5.2f} user "
                  f"{row['system_ms']:5.2f} sys ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="16M", help="bytes a call (default 16M)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=2, help="raw ucxx, ucxrpc runs (alternating)")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = _size(args.size)
    if args.rank_of:
        _rank(args.rank_of, size, args.calls, args.out)
        return
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.pairs):
            for impl in ("raw ucxx", "ucxrpc"):
                results.append(_one(impl, size, args.calls, tmp))
                _show(results[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
