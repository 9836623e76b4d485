"""Peer death, authentication, malformed and oversize frames — real processes."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.faults import _common as c
from tests.workers import run_with_victim, run_workers, spawn_worker, stop_worker

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _init(rank, world_size, init_method, **kw):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method, **kw))


def add(a, b):
    return a + b


def echo(x):
    return x


def slow_echo(x, seconds):
    time.sleep(seconds)
    return x


def big_bytes(n):
    return b"y" * n


# ------------------------------------------------------------ peer killed

#: UCX_TLS for each kind of pipe the kill is tried on (None: UCX's choice,
#: shared memory between two local processes).
PIPES = {"shared-memory": None, "tcp": "tcp"}


def _survivor(rank, world_size, init_method, full_world, stamp_path):
    import ucxrpc as rpc

    c.init(rank, full_world, init_method)
    out = {}
    if rank == 0:
        assert rpc.rpc_sync("worker2", add, args=(1, 2)) == 3
        out["transports"] = rpc.get_pipe_info("worker2")[0]["transports"]
        dying = rpc.rpc_async("worker2", c.kill_self_after, args=(0.5, stamp_path))
        big = rpc.rpc_async("worker2", slow_echo, args=(torch.ones(16 << 20), 5.0))
        out["dying"] = c.failure(0.0, dying.wait)
        out["big"] = c.failure(0.0, big.wait)
        killed = c.read_stamp(stamp_path)
        for rec in (out["dying"], out["big"]):
            rec["elapsed"] -= killed  # timed from the kill
        # later calls to the dead peer fail at once, naming it
        out["later"] = c.failure(time.monotonic(), rpc.rpc_sync, "worker2", add, args=(1, 2))
        # the other pipe keeps working
        assert rpc.rpc_sync("worker1", add, args=(2, 2)) == 4
    rpc.shutdown()
    return out


@pytest.mark.parametrize("pipe", list(PIPES))
def test_peer_killed_mid_call_fails_within_a_second(pipe, tmp_path):
    env = {"UCX_TLS": PIPES[pipe]} if PIPES[pipe] else None
    res = run_with_victim(c.victim_main, _survivor, 3, args=(3, str(tmp_path / "killed")),
                          timeout=100, env=env)
    r0 = res[0]
    print(f"\n  SIGKILL with two calls pending, over {r0['transports']}:")
    c.check_failure(r0["dying"], "worker2", "the call that killed it")
    c.check_failure(r0["big"], "worker2", "a call sleeping on it")
    c.check_failure(r0["later"], "worker2", "later call")
    # Whichever tells first: the lifeline's kernel (always, and alone over
    # shared memory) or UCX's own TCP endpoint error, which looks at the
    # lifeline before it says anything: a dead peer is said to have failed.
    # (Should UCX tell even before the lifeline's end has come, the peer is
    # unreachable for the few milliseconds until it does.)
    assert r0["big"]["type"] in ("BrokenError", "UnreachableError"), r0["big"]
    if pipe == "tcp":
        assert r0["transports"] == ["tcp"], r0


# ---------------------------------------------------------- authentication

def _wrong_secret(rank, world_size, init_method):
    import ucxrpc as rpc

    os.environ["UCXRPC_AUTH_TOKEN"] = "secret-A" if rank == 0 else "secret-B"
    _init(rank, world_size, init_method, rpc_timeout=20)
    if rank == 0:
        with pytest.raises(rpc.AuthenticationError, match="failed authentication"):
            rpc.rpc_sync("worker1", add, args=(1, 2))
    time.sleep(0.5)
    rpc.shutdown(graceful=False)


def test_peer_with_wrong_secret_is_refused():
    run_workers(_wrong_secret, 2, timeout=60)


def _rogue(address_hex, claimed_id, store_port):
    """A process that knows worker1's UCX address but not the job secret."""
    import numpy as np

    from ucxrpc.transport import Peer, Transport
    from ucxrpc.transport.wire.tags import FRAME, HANDSHAKE, ID_SHIFT, KIND_SHIFT
    from ucxrpc.transport.wire.frame import FrameKind, encode, Limits

    tr = Transport(my_id=claimed_id, secret=b"not-the-secret", on_message=lambda *a: None,
                   on_frame_error=lambda *a: None, on_broken=lambda *a: None)
    tr.add_peer(Peer(1, "worker1", bytes.fromhex(address_hex)))
    tr.start()
    ep = tr._endpoint(tr._pipes[1])
    garbage = [
        np.frombuffer(os.urandom(200), dtype=np.uint8).copy(),        # random bytes
        np.frombuffer(b"UX\x01\x00" + b"\x00" * 8, dtype=np.uint8).copy(),  # truncated
    ]
    frame, _ = encode(FrameKind.MESSAGE, 1, b"\x80\x05N.", [], b"wrong-key-16byte", Limits())
    garbage.append(frame)  # well formed but unauthenticated
    reqs = []
    for g in garbage:
        reqs.append(ep.tag_send(g, (FRAME << KIND_SHIFT) | (claimed_id << ID_SHIFT)))
    for g in garbage[:2]:
        reqs.append(ep.tag_send(g, (HANDSHAKE << KIND_SHIFT) | (claimed_id << ID_SHIFT)))
    # A full handshake attempt with the wrong secret.
    tr.send(1, b"\x01" * 32, [])
    time.sleep(2.0)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    store.set("rogue-done", "1")
    time.sleep(30)


def _attacked(rank, world_size, init_method, store_port):
    import ucxrpc as rpc
    from ucxrpc import api

    _init(rank, world_size, init_method)
    import torch.distributed as dist

    if rank == 1:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
        store.set("worker1-address", api._agent.transport.address.hex())
        store.wait(["rogue-done"])
        refused = rpc._get_debug_info()
        store.set("refused", str(refused["refused_frames"] + refused["frame_errors"]))
    else:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
        store.wait(["refused"])
        # worker1 still serves its authenticated peer
        assert rpc.rpc_sync("worker1", add, args=(20, 22)) == 42
    n = int(store.get("refused"))
    rpc.shutdown()
    return n


def _rogue_launcher(store_port):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    store.wait(["worker1-address"])
    _rogue(store.get("worker1-address").decode(), 0, store_port)


def test_unauthenticated_and_malformed_frames_are_refused_and_agent_keeps_serving():
    from tests.workers import free_port

    port = free_port()
    rogue = spawn_worker(_rogue_launcher, port)
    try:
        res = run_workers(_attacked, 2, args=(port,), timeout=90)
    finally:
        stop_worker(rogue)
    assert res[1] >= 5, res  # every garbage frame was counted as refused/dropped


# ------------------------------------------------- malformed / oversize

def _bad_messages(rank, world_size, init_method):
    import ucxrpc as rpc
    from ucxrpc import api
    from ucxrpc.serialization import envelope

    from tests.faults._common import go, wait_for_go

    limit = (1 << 20) if rank == 1 else (64 << 20)
    frame_limit = (64 << 10) if rank == 1 else (1 << 30)
    _init(rank, world_size, init_method, max_message_bytes=limit, max_frame_bytes=frame_limit)
    if rank == 0:
        # worker1 goes first, so our reply to it is the first message on our
        # pipe to it: it waits for the handshake, and must still fail at once.
        wait_for_go()
        # the receiver's limit is smaller than ours: it rejects with an error
        with pytest.raises(RuntimeError, match="exceeds max_message_bytes=1048576"):
            rpc.rpc_sync("worker1", echo, args=(torch.ones(1 << 20),))
        # a frame (here: a 200 KB pickle) over the receiver's frame limit
        with pytest.raises(RuntimeError, match="exceeds max_frame_bytes=65536 of the receiver"):
            rpc.rpc_sync("worker1", echo, args=(b"x" * 200_000,))
        # our own limit is enforced before anything is sent
        with pytest.raises(RuntimeError, match="exceeds max_message_bytes"):
            rpc.rpc_sync("worker1", echo, args=(torch.ones(32 << 20),))
        # an authenticated message whose body is not a valid pickle
        agent = api._agent
        fut = torch.futures.Future()
        agent.calls.add(10**9, fut, 1)
        agent.transport.send(1, envelope.encode(envelope.MsgKind.REQUEST, 10**9, b"\x80\x05garbage"), [])
        with pytest.raises(RuntimeError, match="cannot decode a request"):
            fut.wait()
        # nothing was lost: the pipe still carries calls and data
        assert rpc.rpc_sync("worker1", add, args=(1, 2)) == 3
        t = torch.arange(1000.0)
        assert torch.equal(rpc.rpc_sync("worker1", echo, args=(t,)), t)
    else:
        # a reply over our own frame limit fails the call it answers, at once
        with pytest.raises(RuntimeError, match="exceeds max_frame_bytes=65536 of the receiver"):
            rpc.rpc_sync("worker0", big_bytes, args=(200_000,), timeout=30)
        assert rpc.rpc_sync("worker0", add, args=(2, 3)) == 5
        rpc.rpc_sync("worker0", go)
    rpc.shutdown()


def test_malformed_and_oversize_messages_get_clear_errors():
    run_workers(_bad_messages, 2, timeout=90)
