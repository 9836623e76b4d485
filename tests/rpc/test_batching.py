"""Small messages queued behind a frame still in flight go together, as one
BATCH frame (ucxrpc/transport/wire/batch.py), over real UCX pipes.

The callee is stopped (SIGSTOP, by PID) while the caller fires a burst of
small calls, so its receive queue fills and the caller's sends stay in
flight: everything sent meanwhile waits in the outbox.  Every call still
gets its own right result; a message too large to wait (64 KiB) goes
alone after what waited before it; and a batched message over the
receiver's max_message_bytes is refused on its own, its call failing with
the limit named, while the rest of its batch is served.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults import _common as c
from tests.workers import run_workers, sigstop

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

MiB = 1 << 20


def describe(x):
    import torch

    if isinstance(x, torch.Tensor):
        return (str(x.dtype), x.tolist() if x.numel() < 64 else float(x.double().sum()))
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(describe(v) for v in x)
    return x


def _burst(rank, world_size, init_method):
    import torch

    import ucxrpc as rpc

    # The callee refuses messages over 8 KiB: the 12 KiB one below is
    # batched and refused alone, the 64 KiB one goes alone and is refused.
    c.init(rank, world_size, init_method,
           **({"max_message_bytes": 8 << 10} if rank == 1 else {}))
    out = {}
    if rank == 0:
        pid = rpc.rpc_sync("worker1", os.getpid)
        args = []
        for i in range(1500):
            kind = i % 5
            if kind == 0:
                args.append(i)
            elif kind == 1:
                args.append(torch.full((3,), i, dtype=torch.float32))
            elif kind == 2:
                args.append({"i": i, "t": torch.arange(i % 7, dtype=torch.int64)})
            elif kind == 3:
                args.append(torch.tensor([i % 2 == 0, True]))
            else:
                args.append((f"s{i}", torch.tensor(i, dtype=torch.float16)))
        sigstop(pid)
        try:
            futs = [rpc.rpc_async("worker1", describe, args=(a,)) for a in args[:700]]
            over = rpc.rpc_async("worker1", describe, args=(torch.ones(3 << 10),))  # 12 KiB
            alone = rpc.rpc_async("worker1", describe, args=(torch.ones(16 << 10),))  # 64 KiB
            futs += [rpc.rpc_async("worker1", describe, args=(a,)) for a in args[700:]]
            time.sleep(0.3)
        finally:
            os.kill(pid, signal.SIGCONT)
        out["results"] = [f.wait() for f in futs]
        out["expected"] = [describe(a) for a in args]
        for key, fut in (("over", over), ("alone", alone)):
            try:
                out[key] = f"no error: {fut.wait()}"
            except Exception as exc:
                out[key] = f"{type(exc).__name__}: {exc}"
        out["mine"] = {k: v for k, v in rpc._get_debug_info().items()
                       if k in ("batches", "batched_messages", "messages_sent_alone",
                                "messages_queued_in_one_call", "messages_not_sent_alone",
                                "messages_received_at_once")}
    rpc.shutdown()
    return out


def test_a_burst_behind_a_full_queue_goes_in_batches_and_every_call_completes():
    res = run_workers(_burst, 2, timeout=90)[0]
    assert res["results"] == res["expected"]
    for key in ("over", "alone"):
        assert "exceeds max_message_bytes=8192" in res[key], res[key]
    assert res["mine"]["batches"] > 0, res["mine"]
    assert res["mine"]["batched_messages"] > res["mine"]["batches"], res["mine"]
    # Small messages went alone in one C call while nothing was in flight,
    # and into the outbox from that call while something was.
    assert res["mine"]["messages_sent_alone"] > 0, res["mine"]
    assert res["mine"]["messages_queued_in_one_call"] >= res["mine"]["batched_messages"] // 2, \
        res["mine"]
    # Replies without buffers were handed to the agent by the native
    # receive itself (the describe() results of ints are plain values).
    assert res["mine"]["messages_received_at_once"] > 0, res["mine"]
    print(f"\n  caller: {res['mine']}")
