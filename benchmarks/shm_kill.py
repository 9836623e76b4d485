"""How often a sender SIGKILLed mid-transfer leaves the receiver's UCX
shared-memory receive queue stuck, and whether ucxrpc's check sees it.

Each trial: a process streams 64 MiB tag messages to a receiver over UCX
(whatever UCX picks between two local processes: sysv/posix here); the
receiver kills it mid-stream, then a second UCX worker in the receiver sends
it one small message through the same queue (what
``ucxrpc.transport.watch.canary`` does).  A message that does not arrive within 2 s
means the queue is stuck: no local process can reach that worker any more.

    python benchmarks/shm_kill.py --trials 12

Raw UCX only: ucxrpc on top sees the same queue (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import time

import numpy as np

NBYTES = 64 << 20
STREAM_TAG, CANARY_TAG = 5, 9
FULL = (1 << 64) - 1


def _sender(addr_q, pid_q) -> None:
    from ucxrpc.transport.ucx.binding import Endpoint, Worker

    w = Worker(None)
    ep = Endpoint(w, addr_q.get(), lambda exc: None)
    buf = np.ones(NBYTES, dtype=np.uint8)
    tag = w.tag(STREAM_TAG)
    pid_q.put(os.getpid())
    while True:
        req = ep.tag_send(buf, tag)
        while not req.done:
            w.progress()


def trial(ctx, kill_after: float) -> tuple[bool, str]:
    from ucxrpc.transport.ucx.binding import Endpoint, Worker

    w = Worker(None)
    addr_q, pid_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(addr_q, pid_q), daemon=True)
    proc.start()
    try:
        addr_q.put(w.address)
        pid = pid_q.get(timeout=60)
        sink = np.empty(NBYTES, dtype=np.uint8)
        keep = []
        kill_at = time.monotonic() + kill_after
        while time.monotonic() < kill_at:
            probe = w.probe(STREAM_TAG, FULL)
            if probe is not None:
                keep = [r for r in keep if not r.done] + [w.recv_probed(sink, probe)]
            w.progress()
        os.kill(pid, signal.SIGKILL)
        canary = Worker(None)
        ep = Endpoint(canary, w.address, lambda exc: None)
        sent = ep.tag_send(np.ones(1, dtype=np.uint8), canary.tag(CANARY_TAG))
        lanes = ",".join(sorted({t for t, _ in ep.transports()}))
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            w.progress()
            canary.progress()
            probe = w.probe(CANARY_TAG, FULL)
            if probe is not None:
                w.recv_probed(np.empty(1, dtype=np.uint8), probe)
                return False, lanes
        del sent
        return True, lanes
    finally:
        proc.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    stuck = 0
    for i in range(args.trials):
        # Kill times spread over a few transfers, not tuned to any phase.
        got, lanes = trial(ctx, 0.3 + 0.1 * i / max(1, args.trials - 1))
        stuck += got
        print(f"trial {i + 1}: {'STUCK' if got else 'moving'} (lanes {lanes})", flush=True)
    print(f"receive queue left stuck in {stuck} of {args.trials} kills mid-stream")


if __name__ == "__main__":
    main()
