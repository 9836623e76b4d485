"""Bundled small tensors over real pipes between real processes: a message
of every dtype and shape, views, empty tensors and large ones, echoed and
checked on both sides; once plainly and once with the host-as-device debug
switch, where the bundle buffers take the staged path CUDA buffers take
when a pipe cannot carry device memory."""

from __future__ import annotations

import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.transport._workers import (debug_counts, needs_sibling_reads, siblings_may_read,
                                     start_worker)
from tests.workers import run_workers
from ucxrpc.transport.hostmem import cma

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]


def _message():
    g = torch.Generator().manual_seed(3)
    msg = {}
    for i, dtype in enumerate(DTYPES):
        raw = torch.randint(0, 100, (4 + i, 3), generator=g)
        msg[f"m{i}"] = (raw % 2 == 0) if dtype is torch.bool else raw.to(dtype)
        msg[f"s{i}"] = msg[f"m{i}"][1].clone()           # 1-D
        msg[f"z{i}"] = msg[f"m{i}"][0, 0].clone()        # 0-D
    base = torch.randn(20_000, generator=g)
    msg.update(slice=base[10:500], empty=torch.empty(0, 2), large=torch.randn(300_000, generator=g),
               many=[torch.full((1024,), float(i)) for i in range(100)], text="text")
    return msg


def _echo(rank, world_size, init_method):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        msg = _message()
        remote, back = rpc.rpc_sync("worker1", digest_and_echo, (msg,))
        out = {"sent": remote == _digest(msg), "back": _digest(back) == _digest(msg),
               "again": _digest(rpc.rpc_sync("worker1", digest_and_echo, (back,))[1])
               == _digest(msg)}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("env", [None, {"UCXRPC_DEBUG_HOST_AS_DEVICE": "1"}],
                         ids=["plain", "host-as-device"])
def test_bundled_message_arrives_intact_both_ways(env):
    res = run_workers(_echo, 2, timeout=90, env=env)
    assert res[0] == {"sent": True, "back": True, "again": True}, res[0]


# A bundle of one dtype over the transport's inline threshold is sent from
# the tensors where they are, as one UCX message of their parts
# (transport/wire/gather.py); anywhere it must be one block of memory it is
# joined first.  Each way must deliver the same bytes.
_COUNTS = ("buffers_sent_as_parts", "buffers_read_by_peers")


def _one_dtype(g, n, numel):
    return {f"t{i}": torch.randn(numel if i % 3 else (4, numel // 4), generator=g)
            for i in range(n)}


def _gathered(rank, world_size, init_method, how):
    if how == "by-address":  # from the size of the small bundle, so joined first
        cma.MIN_BYTES = cma.BUSY_MIN_BYTES = 64 << 10
    rpc = start_worker(rank, world_size, init_method,
                       transports=["tcp"] if how == "tcp" else None)
    out = {}
    if rank == 0:
        g = torch.Generator().manual_seed(5)
        # 400 KiB, and 3 MiB: over TCP a rendezvous, by address otherwise
        for msg in (_one_dtype(g, 100, 1024), _one_dtype(g, 48, 16384)):
            remote, back = rpc.rpc_sync("worker1", digest_and_echo, (msg,))
            _, mine = rpc.rpc_sync("worker0", digest_and_echo, (msg,))  # to oneself
            out.setdefault("intact", []).append(
                (remote == _digest(msg), _digest(back) == _digest(msg),
                 _digest(mine) == _digest(msg), back["t0"].shape == msg["t0"].shape))
        out["mine"] = debug_counts(_COUNTS)
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts, (_COUNTS,))
    rpc.shutdown()
    return out


_READS = [needs_sibling_reads, pytest.mark.skipif(
    cma.offer() is None, reason="process_vm_readv or /proc is not available here")]


@pytest.mark.parametrize("how", ["default", "tcp", "host-as-device",
                                 pytest.param("by-address", marks=_READS)])
def test_a_large_bundle_of_one_dtype_arrives_intact_however_it_goes(how):
    # The default case's loops poll throughout: both bundles are at least
    # cma.MIN_BYTES, and go by address where the kernel lets siblings read
    # each other (a loop that found its core contended would send smaller
    # ones so too, and which way they went would depend on the load).
    env = ({"UCXRPC_DEBUG_HOST_AS_DEVICE": "1"} if how == "host-as-device"
           else {"UCXRPC_PROGRESS": "polling"} if how == "default" else None)
    res = run_workers(_gathered, 2, timeout=90, env=env, args=(how,))[0]
    assert res["intact"] == [(True, True, True, True)] * 2, res
    parts = res["mine"]["buffers_sent_as_parts"] + res["theirs"]["buffers_sent_as_parts"]
    read = res["mine"]["buffers_read_by_peers"] + res["theirs"]["buffers_read_by_peers"]
    # A reply echoing the tensors as they came goes as its received
    # bundle's range (bundle._span), not in parts.
    if how == "tcp":
        assert parts == 2 and read == 0  # each call, both sizes
    elif how == "default":
        assert cma.MIN_BYTES <= 400 << 10
        if siblings_may_read():
            assert parts == 0 and read >= 2  # joined, both read by address
        else:
            assert parts == 2 and read == 0
    else:
        assert parts == 0
        assert (read >= 2) == (how == "by-address")


def _first_message(rank, world_size, init_method):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        # Several at once as the first messages to the peer: they wait in the
        # pipe's backlog until its handshake is done, parts and all.
        msgs = [_one_dtype(torch.Generator().manual_seed(i), 100, 1024) for i in range(4)]
        futs = [rpc.rpc_async("worker1", digest_and_echo, (m,)) for m in msgs]
        out["intact"] = [(remote == _digest(m), _digest(back) == _digest(m))
                         for m, (remote, back) in zip(msgs, (f.wait() for f in futs))]
    rpc.shutdown()
    return out


def test_large_bundles_sent_before_the_pipe_is_open_arrive_intact():
    assert run_workers(_first_message, 2, timeout=90)[0]["intact"] == [(True, True)] * 4


def _beside_a_chunked_buffer(rank, world_size, init_method):
    rpc = start_worker(rank, world_size, init_method, transports=["tcp"])
    out = {}
    if rank == 0:
        g = torch.Generator().manual_seed(7)
        # Over TCP nothing is read by address, and a host buffer over
        # staging.HOST_CHUNK_OVER (32 MiB) takes the message through
        # staging.plan, the bundle beside it included.
        msg = {"bundle": _one_dtype(g, 100, 1024), "big": torch.randn(9 << 20, generator=g)}
        remote, back = rpc.rpc_sync("worker1", digest_and_echo, (msg,))
        out["intact"] = (remote == _digest(msg), _digest(back) == _digest(msg))
        out["mine"] = debug_counts(("buffers_sent_as_parts",))
    rpc.shutdown()
    return out


def test_a_large_bundle_beside_a_buffer_sent_in_chunks_arrives_intact():
    res = run_workers(_beside_a_chunked_buffer, 2, timeout=90)[0]
    assert res["intact"] == (True, True), res
    assert res["mine"]["buffers_sent_as_parts"] == 0  # joined: plan takes tensors only
