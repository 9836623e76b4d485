"""A rogue process fires malformed and replayed frames at a live worker.

A 2-worker job runs over real UCX on loopback; a third process, the rogue,
knows worker1's UCX address (through a store, as a network attacker could
learn it) but not the job secret.  It sends a few hundred seeded-random
malformed frames on the handshake and frame tags (random bytes, damaged
and truncated frames, descriptor fields at extreme values, frames over
worker1's max_frame_bytes, HELLOs claiming worker0, PROOFs without HELLO,
CHALLENGEs nobody asked for, well-formed frames with a wrong MAC), then
replays worker0's genuine HELLO, PROOF and first request, captured as they
went out (what an eavesdropper would record).

Afterwards: every rogue frame was counted exactly once by worker1 (refused
or frame error), every CHALLENGE worker1 sent worker0 for a forged HELLO was
refused there, the replayed request did not run again, nothing was logged
at ERROR level, no pipe broke, both workers still serve each other, and
every process exited cleanly within the deadline.

A peer with a wrong secret is covered by tests/rpc/test_faults.py
(test_peer_with_wrong_secret_is_refused).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta

import pytest
import torch

from tests.workers import free_port, run_workers, spawn_worker, stop_worker

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

#: Seed of the rogue's corpus; UCXRPC_FUZZ_SEED explores others.
SEED = int(os.environ.get("UCXRPC_FUZZ_SEED", "20240611"))
SHOTS = 300
W1_FRAME_LIMIT = 64 << 10
WAIT_S = 30.0  # inner waits expire well before the job's deadline


def _store(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _init(rank: int, world_size: int, init_method: str, **kw) -> None:
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method, **kw))


def _counts() -> tuple[int, int]:
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return info["refused_frames"], info["frame_errors"]


def _wait_for(ready) -> bool:
    """Poll ``ready()`` until true or WAIT_S passed; whether it became true.

    The caller reports what it saw either way, so a shortfall shows up as
    numbers in the parent's assertion rather than as a timeout.
    """
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _Errors(logging.Handler):
    """Every ERROR record from ucxrpc (a swallowed exception in the progress
    loop, a failed message handler) is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")


def _watch_errors() -> _Errors:
    handler = _Errors()
    logging.getLogger("ucxrpc").addHandler(handler)
    return handler


# ------------------------------------------------- functions run remotely

_bumps = 0


def add(a, b):
    return a + b


def echo(x):
    return x


def bump() -> int:
    global _bumps
    _bumps += 1
    return _bumps


def bumps() -> int:
    return _bumps


def wait_for_release(port: int) -> int:
    _store(port).wait(["release"])
    return 7


# ------------------------------------------------------ the replay capture

def _capture_sends() -> list[tuple[int, bytes]]:
    """Record every frame this process sends (tag, bytes): an eavesdropper's view."""
    import numpy as np

    from ucxrpc.transport.ucx.ucp import ucp

    sent: list[tuple[int, bytes]] = []
    bindings = ucp()
    original = bindings.send

    def send(handle, buf, tag):
        # (frames without buffers are bytes: csrc/send.c; the others arrays)
        if isinstance(buf, (bytes, np.ndarray)) and len(sent) < 32:
            sent.append((tag, bytes(buf) if isinstance(buf, bytes) else buf.tobytes()))
        return original(handle, buf, tag)

    # Every host frame leaves through libucp's send, bound per endpoint as
    # it opens (binding.Endpoint): before the first call to worker1 opens it.
    bindings.send = send
    return sent


def _replayable(sent: list[tuple[int, bytes]]) -> dict[str, tuple[int, str]]:
    """Worker0's HELLO and PROOF to worker1 and its first REQUEST frame."""
    from tests.fuzz.frames import FRAME, HANDSHAKE, HINT_MASK, KIND_SHIFT, as_array
    from ucxrpc.serialization import envelope
    from ucxrpc.transport.wire.frame import Limits, decode

    out: dict[str, tuple[int, str]] = {}
    for tag, data in sent:
        kind = tag >> KIND_SHIFT
        if kind == HANDSHAKE:
            name = decode(as_array(data), None, Limits()).kind.name.lower()
            if name in ("hello", "proof"):
                out.setdefault(name, (tag, data.hex()))
        elif kind == FRAME and envelope.parse_hint(tag & HINT_MASK)[0] == envelope.MsgKind.REQUEST:
            out.setdefault("request", (tag, data.hex()))
    assert set(out) == {"hello", "proof", "request"}, f"captured only {sorted(out)}"
    return out


# ------------------------------------------------------------- the rogue

def _send_all(ep, tr, shots) -> None:
    from tests.fuzz.frames import as_array

    reqs = [ep.tag_send(as_array(s.data), s.tag) for s in shots]
    deadline = time.monotonic() + WAIT_S
    while not all(r.done for r in reqs):
        if time.monotonic() > deadline:
            raise AssertionError(f"{sum(not r.done for r in reqs)} rogue sends never completed")
        tr.wake()
        time.sleep(0.01)


def _rogue_transport(address: bytes):
    from ucxrpc.transport import Peer, Transport

    tr = Transport(my_id=4242, secret=b"not-the-secret", on_message=lambda *a: None,
                   on_frame_error=lambda *a: None, on_broken=lambda *a: None)
    tr.add_peer(Peer(1, "worker1", address))
    tr.start()
    return tr, tr._endpoint(tr._pipes[1])


def rogue(port: int, seed: int) -> None:
    """No secret; worker1's address from the store; worker0's frames replayed."""
    from tests.fuzz.frames import (HANDSHAKE, Shot, classify, handshake_frame, oversize_shots,
                                   rogue_corpus, tag_of)
    from ucxrpc.transport.wire import auth
    from ucxrpc.transport.wire.frame import FrameKind, Limits

    store = _store(port)
    address = bytes.fromhex(store.get("worker1-address").decode())
    replay = json.loads(store.get("replay"))
    limits = Limits(max_frame_bytes=W1_FRAME_LIMIT)
    hello0 = handshake_frame(FrameKind.HELLO, auth.hello(0, auth.new_nonce()))
    proof = handshake_frame(FrameKind.PROOF, os.urandom(32))
    shots = rogue_corpus(seed, SHOTS, 0, limits) + oversize_shots(0, limits, 8, seed) + [
        Shot(tag_of(HANDSHAKE, 0), hello0, "hello"),   # claims to be worker0
        Shot(tag_of(HANDSHAKE, 0), proof, "counted"),  # a PROOF for it, without the secret
        Shot(tag_of(HANDSHAKE, 0), proof, "counted"),  # a PROOF without HELLO
    ]
    # The replay, byte for byte, from another endpoint: the nonces are stale.
    for name in ("hello", "proof", "request", "proof"):
        tag, data = replay[name]
        data = bytes.fromhex(data)
        shots.append(Shot(tag, data, classify(tag, data, 0, limits)))
    tr, ep = _rogue_transport(address)
    try:
        _send_all(ep, tr, shots)
        store.set("rogue-sent", json.dumps({
            "counted": sum(s.outcome == "counted" for s in shots),
            "hellos": sum(s.outcome == "hello" for s in shots), "shots": len(shots)}))
        store.wait(["rogue-may-exit"])
    finally:
        tr.close()


# ------------------------------------------------------------- the job

def _worker0(port: int) -> dict:
    import ucxrpc as rpc

    store = _store(port)
    errors = _watch_errors()
    sent = _capture_sends()
    assert rpc.rpc_sync("worker1", bump) == 1
    replay = _replayable(sent)
    base = _counts()
    store.set("replay", json.dumps(replay))
    expected = json.loads(store.get("rogue-sent"))
    # Each forged HELLO made worker1 send worker0 a CHALLENGE; worker0 refuses them.
    _wait_for(lambda: _counts()[0] - base[0] >= expected["hellos"])
    store.wait(["w1-checked"], timedelta(seconds=2 * WAIT_S))
    assert rpc.rpc_sync("worker1", add, args=(20, 22)) == 42
    t = torch.randn(1 << 18)  # 1 MiB: travels out of band
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(t,)), t)
    small = torch.arange(10.0)  # inline in the frame
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(small,)), small)
    return {"bumps": rpc.rpc_sync("worker1", bumps), "expected": expected,
            "refused": _counts()[0] - base[0], "frame_errors": _counts()[1] - base[1],
            "errors": errors.seen, "broken": rpc._get_debug_info()["broken_peers"]}


def _worker1(port: int) -> dict:
    import ucxrpc as rpc
    from ucxrpc import api

    store = _store(port)
    errors = _watch_errors()
    base = _counts()
    store.set("worker1-address", api._agent.transport.address.hex())
    expected = json.loads(store.get("rogue-sent"))

    def counted() -> int:
        refused, frame_errors = _counts()
        return refused - base[0] + frame_errors - base[1]

    _wait_for(lambda: counted() >= expected["counted"])
    assert rpc.rpc_sync("worker0", add, args=(1, 2)) == 3
    got = counted()
    store.set("w1-checked", "1")
    store.set("rogue-may-exit", "1")
    return {"counted": got, "expected": expected, "errors": errors.seen,
            "broken": rpc._get_debug_info()["broken_peers"]}


def _attacked(rank: int, world_size: int, init_method: str, port: int) -> dict:
    import ucxrpc as rpc

    limit = W1_FRAME_LIMIT if rank == 1 else 1 << 30
    _init(rank, world_size, init_method, max_frame_bytes=limit, rpc_timeout=WAIT_S)
    try:
        return _worker0(port) if rank == 0 else _worker1(port)
    finally:
        rpc.shutdown()


def _with_rogue(target, rogue_target, *, timeout: float) -> tuple[list, int | None]:
    """Run the 2-worker job with a rogue beside it; the results and the
    rogue's exit code."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    proc = spawn_worker(rogue_target, port, SEED)
    try:
        results = run_workers(target, 2, args=(port,), timeout=timeout)
        proc.join(WAIT_S)
        return results, proc.exitcode
    finally:
        stop_worker(proc)
        del store


def test_rogue_frames_and_a_replayed_handshake_are_refused_and_the_job_goes_on():
    (w0, w1), rogue_exit = _with_rogue(_attacked, rogue, timeout=90)
    assert rogue_exit == 0, "the rogue failed (its traceback is on stderr)"
    expected = w1["expected"]
    assert expected["shots"] >= SHOTS
    # Every rogue frame counted, once: none slipped through, none counted twice.
    assert w1["counted"] == expected["counted"], f"seed {SEED}: {w1}"
    assert w0["refused"] == expected["hellos"] and w0["frame_errors"] == 0, w0
    # The replayed request did not run a second time.
    assert w0["bumps"] == 1, w0
    assert w0["errors"] == [] and w1["errors"] == [], (w0["errors"], w1["errors"])
    assert w0["broken"] == [] and w1["broken"] == []


# ------------------------------------ oversize frames with a forged hint

def _forged_hints_job(rank: int, world_size: int, init_method: str, port: int) -> dict:
    import ucxrpc as rpc
    from ucxrpc import api

    limit = W1_FRAME_LIMIT if rank == 1 else 1 << 30
    _init(rank, world_size, init_method, max_frame_bytes=limit, rpc_timeout=WAIT_S)
    try:
        store = _store(port)
        if rank == 1:
            store.set("worker1-address", api._agent.transport.address.hex())
        base = _counts()[1]  # the rogue sends once both calls are out
        fut = rpc.rpc_async(f"worker{1 - rank}", wait_for_release, args=(port,))
        store.set(f"call-out-{rank}", "1")
        if rank == 1:
            n = int(store.get("rogue-sent"))
            _wait_for(lambda: _counts()[1] - base >= n)
            store.set("release", "1")
        try:
            return {"ok": fut.wait() == 7}
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        rpc.shutdown()


def forged_hints_rogue(port: int, seed: int) -> None:
    """Frames over worker1's max_frame_bytes, claiming worker0, whose tags
    carry hints naming calls in flight (message ids are small counters)."""
    from tests.fuzz.frames import FRAME, Shot, tag_of
    from ucxrpc.serialization import envelope

    store = _store(port)
    address = bytes.fromhex(store.get("worker1-address").decode())
    store.wait(["call-out-0", "call-out-1"])
    data = os.urandom(W1_FRAME_LIMIT + 1)
    shots = [Shot(tag_of(FRAME, 0, envelope.hint(kind, msg_id)), data, "counted")
             for msg_id in range(1, 17)
             for kind in (envelope.MsgKind.RESPONSE, envelope.MsgKind.REQUEST)]
    tr, ep = _rogue_transport(address)
    try:
        store.set("rogue-sent", str(len(shots)))  # counted from here on by worker1
        _send_all(ep, tr, shots)
        store.wait(["release"])
    finally:
        tr.close()


def test_oversize_frames_with_forged_hints_fail_no_call():
    results, rogue_exit = _with_rogue(_forged_hints_job, forged_hints_rogue, timeout=90)
    assert rogue_exit == 0
    assert results == [{"ok": True}, {"ok": True}], results
