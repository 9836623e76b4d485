"""Large host buffers written by their sender into memory the receiver lent
it (transport/grants.py), between two workers over real pipes."""

from __future__ import annotations

import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.transport._workers import debug_counts, needs_sibling_reads, start_worker
from tests.workers import run_workers
from ucxrpc.transport.hostmem import cma
from ucxrpc.transport import grants

pytestmark = [pytest.mark.timeout(120), needs_sibling_reads]

if cma.offer() is None:
    pytest.skip("process_vm_readv or /proc is not available here", allow_module_level=True)

# Above reading by address and the smallest grant, in the 8 MiB class.
_SIZE = (4 << 20) + 3


_COUNTS = ("buffers_read_by_peers", "buffers_written_into_peers", "grants_lent",
           "grants_used", "bytes_written_by_peers", "grant_bytes_lent",
           "buffers_held_for_peers")


def _echoes(rank, world_size, init_method):
    rpc = start_worker(rank, world_size, init_method)
    out = {}
    if rank == 0:
        g = torch.Generator().manual_seed(11)
        sent = [torch.randint(0, 255, (_SIZE,), dtype=torch.uint8, generator=g)
                for _ in range(5)]
        # Every call's own bytes both ways, each written into memory that
        # held the one before (the pool gives a used grant's memory back).
        out["echo"] = []
        for t in sent:
            there, back = rpc.rpc_sync("worker1", digest_and_echo, (t,))
            out["echo"].append((there == _digest(t), _digest(back) == _digest(t)))
            del back
        # A smaller class, with a view at an odd place in its storage.
        view = torch.randn(1 << 20, generator=g)[5:]
        for _ in range(2):
            there, back = rpc.rpc_sync("worker1", digest_and_echo, (view,))
            out["echo"].append((there == _digest(view), _digest(back) == _digest(view)))
        out["mine"] = debug_counts(_COUNTS)
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts, (_COUNTS,))
    rpc.shutdown()
    return out


def test_large_buffers_are_written_into_memory_the_receiver_lent():
    out = run_workers(_echoes, 2, timeout=90)[0]
    assert out["echo"] == [(True, True)] * 7
    for mine, theirs in ((out["mine"], out["theirs"]), (out["theirs"], out["mine"])):
        # Each way and class, the first buffer is read by address; that
        # makes its receiver lend memory of its class, so every later one
        # is written.  (The view's whole 4 MiB storage travels.)
        assert mine["buffers_read_by_peers"] == 2
        assert mine["buffers_written_into_peers"] == theirs["grants_used"] == 4 + 1
        assert theirs["bytes_written_by_peers"] == 4 * _SIZE + (1 << 22)
        # One grant of each class lent and unused now, lent again after each use.
        assert theirs["grants_lent"] == 2 + 5
        assert theirs["grant_bytes_lent"] == (8 << 20) + (4 << 20)
        assert mine["buffers_held_for_peers"] == 0  # a written buffer is not held


def _forged(rank, world_size, init_method):
    from ucxrpc import api

    rpc = start_worker(rank, world_size, init_method)
    out = {}
    if rank == 0:
        t = torch.arange(_SIZE, dtype=torch.uint8)
        rpc.rpc_sync("worker1", digest_and_echo, (t,))  # read; the peer lends a grant
        pipe = api._agent.transport._pipes[1]
        with pipe.lock:  # as a sender with a bug would: a grant the peer never lent
            pipe.grants.granted = {c: [(999_999, address) for _, address in free]
                            for c, free in pipe.grants.granted.items()}
        try:
            rpc.rpc_sync("worker1", digest_and_echo, (t,))
            out["error"] = None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        # The worker serves on: small calls, and large buffers (read by
        # address again: its unused grant of that class still stands).
        out["after"] = rpc.rpc_sync("worker1", torch.add, (2, 3))
        there, back = rpc.rpc_sync("worker1", digest_and_echo, (t,))
        out["large_after"] = (there == _digest(t), _digest(back) == _digest(t))
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts, (_COUNTS,))
    rpc.shutdown()
    return out


def test_a_buffer_written_into_a_grant_never_lent_fails_its_call_and_the_worker_serves_on():
    out = run_workers(_forged, 2, timeout=90)[0]
    assert out["error"] is not None
    assert "grant 999999, which this worker did not lend it" in out["error"]
    assert out["after"] == 5
    assert out["large_after"] == (True, True)
    assert out["theirs"]["grants_used"] == 0


def test_grant_bounds():
    # The classes writing pays for: receive buffers on huge pages, and no
    # standing grant larger than what the worker may lend at all.
    assert grants.MIN_BYTES >= cma.MIN_BYTES
    assert grants.MAX_BYTES <= grants.TOTAL_BYTES
