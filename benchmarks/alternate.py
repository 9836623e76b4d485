#!/usr/bin/env python
"""ucxrpc's calls and raw ucxx's transfers of the same bytes across two
simulated hosts, alternating call by call in one pair of processes: a
ratio that the VM's phases cannot skew.  ``--test`` picks the bench's
test: one-way (``rpc_sync(consume, t)`` against send-and-acknowledge),
round trip (``rpc_sync(echo, t)`` against the bytes sent back) or
bidirectional (the peer asked to send ``t`` back while we send ours, as
the bench's; raw ucxx sends both ways at once).

On the project's VM, raw ucxx's own 16 MiB transfers run 3.4-4.0 ms for
seconds, then 8-15 ms for seconds (benchmarks/runs/AS.md), as long as one
series of ``ucxrpc bench``: one invocation's ratio ÷ raw ucxx then says
which series met which phase.  Here both ranks run ucxrpc and, beside its
agent, a raw ucxx worker of their own (``transport/ucx/baseline.py``'s
``Pair``, as the bench's raw baseline); rank 0 times one raw transfer, then
one ucxrpc call, and so on, so every phase meets both.  The
callee's side of a raw transfer runs in an RPC handler (``rpc_async``
issued before the timed part), since only then does a thread of that
process poll the raw worker.

Prints the p10, p50 and p90 of each and the ratios of their bandwidths
(ucxrpc ÷ raw ucxx: 1 is raw ucxx's speed).  Root, as ``ucxrpc bench
--hosts netns``.  Nothing here asserts a time: it is a measurement.

    sudo python benchmarks/alternate.py [--size 16M] [--calls 200]
        [--test one_way|round_trip|bidirectional]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: ucxrpc

WARMUP = 10
TESTS = ("one_way", "round_trip", "bidirectional")
#: Before each timed call: the callee's handler has posted its raw receive
#: and polls, or its pool has settled after the previous call.
SETTLE_S = 0.0005

_PAIR: Any = None
_BUFFERS: Any = None
_BUFFERS_OUT: Any = None


def consume(t: Any) -> None:
    return None


def echo(t: Any) -> Any:
    return t


#: The bidirectional test's tensor on the callee, kept across calls as the
#: bench's ``bidir_send`` keeps it.
_BACK: Any = None


def send_back(size: int) -> None:
    """On the callee: send ``size`` bytes to the caller while it sends to us
    (the bench's bidirectional test)."""
    import torch

    import ucxrpc as rpc

    global _BACK
    if _BACK is None or _BACK.numel() != size:
        _BACK = torch.ones(size, dtype=torch.uint8)
    rpc.rpc_sync("worker0", consume, (_BACK,))


def raw_setup(peer: bytes, size: int) -> bytes:
    """On the callee: its raw worker, connected to the caller's (``peer``);
    returns its address."""
    import numpy as np
    import torch

    from ucxrpc.transport.ucx.baseline import Pair

    global _PAIR, _BUFFERS, _BUFFERS_OUT
    box: dict[str, bytes] = {}

    def exchange(mine: bytes) -> bytes:
        box["mine"] = mine
        return peer

    _PAIR = Pair(exchange, 60.0)
    _BUFFERS = (np.ones(size, dtype=np.uint8), np.zeros(8, dtype=np.uint8))
    # Sent first: torch's memory, as the tensors of the calls (bench/raw.py
    # says why: numpy's host arrays get huge pages, which send faster).
    _BUFFERS_OUT = torch.ones(size, dtype=torch.uint8).numpy()
    return box["mine"]


def raw_serve_once(test: str = "one_way") -> None:
    """On the callee: receive one raw transfer and answer it as ``test``
    says, as the bench's raw baseline does (``bench/raw.py``): an 8-byte
    acknowledgement, the bytes back, or bytes of its own sent meanwhile."""
    data, ack = _BUFFERS
    if test == "bidirectional":
        _PAIR.wait(_PAIR.recv(_PAIR.Array(data), _PAIR.tag_data),
                   _PAIR.send(_PAIR.Array(_BUFFERS_OUT), _PAIR.tag_data))
        return
    _PAIR.wait(_PAIR.recv(_PAIR.Array(data), _PAIR.tag_data))
    back = data if test == "round_trip" else ack
    _PAIR.wait(_PAIR.send(_PAIR.Array(back), _PAIR.tag_reply))


def _caller(size: int, calls: int, test: str) -> dict[str, Any]:
    import numpy as np
    import torch

    import ucxrpc as rpc
    from ucxrpc.transport.ucx.baseline import Pair

    # The callee makes its worker when it gets ours, and answers with its.
    pair = Pair(lambda mine: rpc.rpc_sync("worker1", raw_setup, (mine, size)), 60.0)
    # Sent: torch's memory, as the calls' tensor below (see raw_setup).
    data = torch.ones(size, dtype=torch.uint8).numpy()
    back = np.zeros(8 if test == "one_way" else size, dtype=np.uint8)
    back_tag = pair.tag_data if test == "bidirectional" else pair.tag_reply
    tensor = torch.ones(size, dtype=torch.uint8)

    def raw() -> float:
        served = rpc.rpc_async("worker1", raw_serve_once, (test,))
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        reply = pair.recv(pair.Array(back), back_tag)
        pair.wait(pair.send(pair.Array(data), pair.tag_data), reply)
        took = time.perf_counter() - start
        served.wait()
        return took

    def ours() -> float:
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        if test == "bidirectional":  # as the bench's: the peer asked first
            incoming = rpc.rpc_async("worker1", send_back, (size,))
            rpc.rpc_sync("worker1", consume, (tensor,))
            incoming.wait()
        else:
            rpc.rpc_sync("worker1", echo if test == "round_trip" else consume, (tensor,))
        return time.perf_counter() - start

    for _ in range(WARMUP):
        raw(), ours()
    raws, ourss = [], []
    for _ in range(calls):
        raws.append(raw())
        ourss.append(ours())
    return {"size": size, "calls": calls, "test": test, "raw_s": raws, "ucxrpc_s": ourss}


def _rank(size: int, calls: int, test: str, out_path: str) -> None:
    import ucxrpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    try:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(_caller(size, calls, test), f)
    finally:
        rpc.shutdown()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="16M", help="bytes a call (default 16M)")
    ap.add_argument("--calls", type=int, default=200, help="of each, alternating")
    ap.add_argument("--test", choices=TESTS, default="one_way",
                    help="the bench's test to time (default one_way)")
    ap.add_argument("--json", help="write every call's time here")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = _size(args.size)
    if args.rank:
        _rank(size, args.calls, args.test, args.out)
        return
    import tempfile

    from _twohosts import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "calls.json")
        run_ranks("ucxl", [sys.executable, os.path.abspath(__file__), "--rank", "--size",
                           str(size), "--calls", str(args.calls), "--test", args.test,
                           "--out", out_path])
        with open(out_path) as f:
            result = json.load(f)
    raw, ours = result["raw_s"], result["ucxrpc_s"]
    print(f"{args.size} {args.test.replace('_', '-')}, {args.calls} calls of each, "
          "alternating (ms):")
    for q in (0.1, 0.5, 0.9):
        r, o = _quantile(raw, q), _quantile(ours, q)
        print(f"  p{int(q * 100):<2}  raw ucxx {r * 1e3:6.2f}   ucxrpc {o * 1e3:6.2f}   "
              f"ucxrpc ÷ raw ucxx (bandwidth) {r / o:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
