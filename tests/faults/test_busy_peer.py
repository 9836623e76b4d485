"""A peer busy with a large transfer is alive, however long the transfer takes.

Failure detection declares a peer dead after ``peer_timeout`` seconds of
silence.  A peer that is sending or receiving hundreds of megabytes is not
silent: its bytes are arriving.  This is the false positive the fault tests
must not trip over, checked on its own with a timeout short enough that a
256 MiB transfer always outlasts it.
"""

from __future__ import annotations

import time

import pytest

from tests.faults import _common as c
from tests.workers import run_workers

pytestmark = pytest.mark.timeout(60)

NBYTES = 256 << 20
SHORT_PEER_TIMEOUT = 0.5


def _pair(rank, world_size, init_method):
    import torch

    import ucxrpc as rpc

    c.init(rank, world_size, init_method, peer_timeout=SHORT_PEER_TIMEOUT)
    out = {}
    if rank == 0:
        big = torch.full((NBYTES // 4,), 5.0)
        out["echo_s"] = []
        for _ in range(3):
            t0 = time.monotonic()
            back = rpc.rpc_sync("worker1", c.echo, args=(big,))
            out["echo_s"].append(round(time.monotonic() - t0, 3))
            assert torch.equal(back, big)
            del back
        out["pipes"] = rpc.get_pipe_info()
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_large_transfer_outlasting_peer_timeout_is_not_a_dead_peer():
    res = run_workers(_pair, 2, timeout=50)
    print(f"\n  256 MiB echoes with peer_timeout={SHORT_PEER_TIMEOUT} s: {res[0]['echo_s']} s "
          f"over {[p['transports'] for p in res[0]['pipes']]}")
