"""Soak: four workers calling each other across every pair for a while, with
every payload checked, and memory, RRefs and autograd contexts back where
they started at the end.

Bounded for CI (``UCXRPC_SOAK_SECONDS``, default 6 s of traffic); a longer
run, e.g. the million calls and tens of GB the reliability table quotes::

    UCXRPC_SOAK_SECONDS=900 python -m pytest tests/soak -s
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.workers import run_workers

SECONDS = float(os.environ.get("UCXRPC_SOAK_SECONDS", "6"))
WORLD = 4
BATCH = 200  # small calls in flight per round
SIZES = [4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]

pytestmark = [pytest.mark.processes, pytest.mark.timeout(int(SECONDS * 3) + 120)]


def crc(t):
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def add(a, b):
    return a + b


def crc_and_echo(t):
    return crc(t), t


def counts():
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return {k: info.get(k, 0) for k in ("num_owner_rrefs", "num_forks", "num_user_rrefs",
                                        "num_pending_users", "num_autograd_contexts",
                                        "outstanding_calls")}


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _round(rpc, autograd, me, peer, k, g, totals):
    futs = [rpc.rpc_async(peer, add, (me * 1_000_000 + k, i)) for i in range(BATCH)]
    for i, v in enumerate(torch.futures.wait_all(futs)):
        assert v == me * 1_000_000 + k + i, (peer, k, i, v)
    totals["calls"] += BATCH
    n = SIZES[k % len(SIZES)]
    t = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
    remote_crc, back = rpc.rpc_sync(peer, crc_and_echo, (t,))
    assert remote_crc == crc(t) and crc(back) == crc(t), (peer, n)
    totals["calls"] += 1
    totals["bytes"] += 2 * n
    if k % 5 == 0:  # RRefs made, shared and dropped
        rref = rpc.remote(peer, torch.full, ((64,), float(k)))
        assert float(rref.to_here()[0]) == float(k)
        totals["calls"] += 2
    if k % 7 == 0:  # an autograd context across the pair
        x = torch.ones(32, requires_grad=True)
        with autograd.context() as ctx:
            y = rpc.rpc_sync(peer, torch.mul, (x, 3.0)).sum()
            autograd.backward(ctx, [y])
            assert torch.equal(autograd.get_gradients(ctx)[x], torch.full((32,), 3.0))
        totals["calls"] += 2


def _soak(rank, world_size, init_method, seconds):
    import gc
    import time

    import ucxrpc as rpc
    from ucxrpc import autograd

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    g = torch.Generator().manual_seed(rank)
    totals = {"calls": 0, "bytes": 0}
    peers = [f"worker{r}" for r in range(world_size) if r != rank]
    start = time.monotonic()
    warm_rss = None
    k = 0
    while time.monotonic() - start < seconds:
        _round(rpc, autograd, rank, peers[k % len(peers)], k, g, totals)
        k += 1
        if warm_rss is None and time.monotonic() - start > seconds / 4:
            gc.collect()
            warm_rss = rss_mib()
    gc.collect()
    end_rss = rss_mib()
    # Everyone stops calling before the counts are read, so they can settle.
    rpc.api._current().store.add("soak/done", 1)
    while int(rpc.api._current().store.add("soak/done", 0)) < world_size:
        time.sleep(0.05)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        gc.collect()
        left = counts()
        if not any(left.values()):
            break
        time.sleep(0.1)
    rpc.shutdown()
    return {"totals": totals, "rounds": k, "warm_rss": warm_rss, "end_rss": end_rss,
            "left": left}


def test_four_workers_soak_without_loss_or_growth():
    res = run_workers(_soak, WORLD, args=(SECONDS,), timeout=SECONDS * 2 + 90)
    calls = sum(r["totals"]["calls"] for r in res)
    gbytes = sum(r["totals"]["bytes"] for r in res) / 1e9
    print(f"\nsoak: {SECONDS:g} s, {WORLD} workers, {calls:,} calls, {gbytes:.1f} GB of "
          f"tensors, RSS MiB (after warm-up -> end): "
          + ", ".join(f"{r['warm_rss']:.0f}->{r['end_rss']:.0f}" for r in res))
    for rank, r in enumerate(res):
        assert r["rounds"] > len(SIZES), (rank, r)  # every size went round at least once
        assert not any(r["left"].values()), (rank, r["left"])
        # Flat: what grows after warm-up is bounded, not proportional to traffic.
        assert r["end_rss"] - r["warm_rss"] < 150, (rank, r["warm_rss"], r["end_rss"])
