"""Reading large host buffers by address (transport/hostmem/cma.py): the system
call against a real second process, what a pipe agrees to, and messages
whose buffers travel so between two workers over real pipes.  The REMOTE
descriptor is the frame's (tests/transport/wire/test_frame.py); the buffers
a peer reads come from the pool (tests/transport/hostmem/test_pool.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.transport._workers import (debug_counts, needs_sibling_reads, siblings_may_read,
                                     start_worker)
from tests.workers import run_workers
from ucxrpc.transport.hostmem import cma
from ucxrpc.transport import grants

pytestmark = pytest.mark.timeout(120)

if cma.offer() is None:
    pytest.skip("process_vm_readv or /proc is not available here", allow_module_level=True)

# A process holding known bytes and its own offer; it prints both and waits.
_HOLDER = """
import ctypes, sys
from ucxrpc.transport.hostmem import cma
data = ctypes.create_string_buffer(bytes(range(256)) * 36865, 256 * 36865)
print(ctypes.addressof(data), cma.offer(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder():
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address, offer = proc.stdout.readline().split()
        yield proc, int(address), offer
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.processes
def test_read_copies_another_process_memory_and_names_failures(holder):
    proc, address, offer = holder
    size = 256 * 36865  # over SPLIT_BYTES: half of it copied on the helper thread
    assert size > cma.SPLIT_BYTES
    out = ctypes.create_string_buffer(size)
    cma.read(proc.pid, ctypes.addressof(out), address, size)
    assert out.raw == bytes(range(256)) * 36865
    small = ctypes.create_string_buffer(4096)
    cma.read(proc.pid, ctypes.addressof(small), address + 256, 4096)  # in one call
    assert small.raw == bytes(range(256)) * 16
    peer = cma.parse(offer)
    assert peer is not None and cma.probe(proc.pid, peer) is None
    # A token that reads back different, an address not mapped there.
    assert cma.probe(proc.pid, peer._replace(token=bytes(16))) == "its token read back wrong"
    for n in (16, size):  # one call, and a split one
        with pytest.raises(OSError, match=f"process_vm_readv from PID {proc.pid}"):
            cma.read(proc.pid, ctypes.addressof(out), 8, n)
    proc.kill()
    proc.wait(10)
    assert cma.probe(proc.pid, peer) is not None  # gone: no such process


def test_offers_from_elsewhere_and_transport_lists():
    mine = cma.offer()
    assert mine is not None and cma.parse(mine) is not None
    domain, address, token = mine.rsplit("@", 2)
    # Another kernel, PID namespace or user: its PID names nothing here.
    assert cma.parse(f"other-boot/pid:[1]/0@{address}@{token}") is None
    assert cma.parse(f"{domain}@{address}@abcd") is None  # a short token
    assert cma.parse("not an offer") is None and cma.parse(None) is None
    assert cma.allowed("all") and cma.allowed("sm,tcp") and cma.allowed("cma")
    assert cma.allowed("^ib") and not cma.allowed("^cma") and not cma.allowed("^sm,ib")
    assert not cma.allowed("tcp") and not cma.allowed("tcp,cuda_copy")


def _exchange(rank, world_size, init_method, transports):
    rpc = start_worker(rank, world_size, init_method, transports=transports)
    out = {}
    if rank == 0:
        g = torch.Generator().manual_seed(3)
        payloads = {
            # by address both ways, with small buffers beside it
            "large": [torch.randint(0, 255, ((9 << 20) + 3,), dtype=torch.uint8, generator=g),
                      torch.arange(10), "text"],
            # a view at an odd place in its storage, and a float tensor
            "view": torch.randn(3 << 20, generator=g)[7:],
            # one by address, one through UCX
            "several": {"a": torch.ones(1 << 20, dtype=torch.float64),
                        "b": torch.zeros(cma.BUSY_MIN_BYTES // 2, dtype=torch.int8)},
        }
        for name, obj in payloads.items():
            remote_digest, back = rpc.rpc_sync("worker1", digest_and_echo, (obj,))
            out[name] = (remote_digest == _digest(obj), _digest(back) == _digest(obj))
        out["pipe"] = rpc.get_pipe_info("worker1")[0]["by_address"]
        out["mine"] = debug_counts()
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts)
    rpc.shutdown()
    return out


@pytest.mark.processes
@pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["default", "tcp-only"])
def test_large_buffers_go_by_address_within_a_host(transports):
    out = run_workers(_exchange, 2, args=(transports,), timeout=90)[0]
    for name in ("large", "view", "several"):
        assert out[name] == (True, True), name
    if transports is None and siblings_may_read():
        assert out["pipe"] == {"in": True, "out": True}
        # Three buffers of cma.MIN_BYTES or more each way (the view's whole
        # storage): the first read by address, which made the receiver lend
        # memory of its size class (16 MiB), which the second (12 MiB) was
        # then written into; the third, of another class, read again.
        for mine, theirs in ((out["mine"], out["theirs"]), (out["theirs"], out["mine"])):
            assert mine["buffers_read_by_peers"] == 2
            assert mine["buffers_written_into_peers"] == theirs["grants_used"] == 1
        assert out["mine"]["bytes_read_by_address"] == out["theirs"]["bytes_read_by_address"] > 0
        # Every read was acknowledged by the time the next call came back.
        assert out["mine"]["buffers_held_for_peers"] == 0
        assert out["theirs"]["buffers_held_for_peers"] == 0
    else:  # TCP asked for, or the kernel refused: every byte goes through UCX
        assert out["pipe"] == {"in": False, "out": False}
        assert out["mine"] == out["theirs"] == {"bytes_read_by_address": 0,
                                                "buffers_read_by_peers": 0,
                                                "buffers_held_for_peers": 0,
                                                "buffers_written_into_peers": 0,
                                                "grants_used": 0}


def _echo_above_busy_min(rank, world_size, init_method, modes):
    # Each rank's progress mode: a blocking loop never polls, so its frames
    # say so, and buffers to or from it go by address from BUSY_MIN_BYTES.
    rpc = start_worker(rank, world_size, init_method, progress=modes[rank])
    out = {}
    if rank == 0:
        g = torch.Generator().manual_seed(5)
        one = torch.randint(0, 255, (cma.BUSY_MIN_BYTES + 5,), dtype=torch.uint8, generator=g)
        out["echo"] = [_digest(rpc.rpc_sync("worker1", digest_and_echo, (one,))[1]) == _digest(one)
                       for _ in range(3)]
        # Our read of the last reply: no frame of ours follows it, so the
        # loop sends its acknowledgement once it finds nothing else to do.
        deadline = time.monotonic() + 10
        while rpc._get_debug_info()["acknowledgements_held"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out["held_here"] = rpc._get_debug_info()["acknowledgements_held"]
        out["state"] = rpc._get_debug_info()["peers_busy"]
        out["mine"] = debug_counts()
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts)
    rpc.shutdown()
    return out


@pytest.mark.processes
@needs_sibling_reads
def test_where_the_loop_blocks_smaller_buffers_go_by_address_acknowledged_lazily():
    out = run_workers(_echo_above_busy_min, 2, args=(("blocking", "blocking"),), timeout=90)[0]
    assert out["echo"] == [True, True, True]
    # Three requests and three replies by address: BUSY_MIN_BYTES + 5 is
    # below MIN_BYTES.
    assert cma.MIN_BYTES > cma.BUSY_MIN_BYTES + 5
    assert out["mine"]["buffers_read_by_peers"] == 3
    assert out["theirs"]["buffers_read_by_peers"] == 3
    # Every read acknowledged: the peer's of our requests with its replies,
    # ours of its last reply by our idle loop.
    assert out["held_here"] == 0
    assert out["mine"]["buffers_held_for_peers"] == 0
    assert out["theirs"]["buffers_held_for_peers"] == 0


@pytest.mark.processes
@needs_sibling_reads
def test_a_peer_that_may_not_poll_is_sent_smaller_buffers_by_address():
    """A receiver that does not poll takes a large eager message as a run of
    wake-ups: its frames say so (frame.py's ``state``), and a sender whose
    own loop polls (worker0: never contended itself) sends it buffers by
    address from BUSY_MIN_BYTES too."""
    out = run_workers(_echo_above_busy_min, 2, args=(("polling", "blocking"),), timeout=90)[0]
    assert out["echo"] == [True, True, True]
    assert cma.MIN_BYTES > cma.BUSY_MIN_BYTES + 8
    assert out["mine"]["buffers_read_by_peers"] == 3
    assert out["state"] == 1


# Set on worker1 by _let_go: a call there that holds the buffer it was sent
# (read by address at once) until the caller says so.
_release = threading.Event()


def _hold_until_released(t):
    _release.wait(30)
    return t.numel()


def _let_go():
    _release.set()


def _sent_alone():
    import ucxrpc as rpc

    return rpc._get_debug_info()["acknowledgements_sent_alone"]


def _acknowledged_alone(rank, world_size, init_method):
    rpc = start_worker(rank, world_size, init_method, rpc_timeout=60)
    out = {}
    if rank == 0:
        before = rpc.rpc_sync("worker1", _sent_alone)
        # Larger than any grant (grants.py): the peer then sends no GRANT
        # frame, which would carry the word as every frame does.
        big = torch.ones(grants.MAX_BYTES + 7, dtype=torch.uint8)
        fut = rpc.rpc_async("worker1", _hold_until_released, (big,))
        deadline = time.monotonic() + 30
        while debug_counts()["buffers_held_for_peers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out["held"] = debug_counts()["buffers_held_for_peers"]
        out["running"] = not fut.done()
        out["alone"] = rpc.rpc_sync("worker1", _sent_alone) - before
        rpc.rpc_sync("worker1", _let_go)
        out["result"] = fut.wait()
        out["mine"] = debug_counts()
    rpc.shutdown()
    return out


@pytest.mark.processes
@needs_sibling_reads
def test_a_read_whose_reply_is_late_is_acknowledged_alone():
    """The word that a buffer was read rides on the next frame back (the
    reply, mostly); a call still running after ACK_DELAY_S has it sent
    alone, so the sender lets the buffer go while the call runs on."""
    out = run_workers(_acknowledged_alone, 2, timeout=90)[0]
    assert out["mine"]["buffers_read_by_peers"] == 1
    assert out["held"] == 0 and out["running"]
    assert out["alone"] == 1
    assert out["result"] == grants.MAX_BYTES + 7
