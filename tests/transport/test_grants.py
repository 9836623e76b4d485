"""Grants (transport/grants.py): memory lent to a peer to write large
buffers into; first without processes, then between two workers over real
pipes (large host buffers written by their sender into memory the receiver
lent it)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.transport._workers import debug_counts, needs_sibling_reads, start_worker
from tests.workers import run_workers
from ucxrpc.errors import BrokenError, FrameError
from ucxrpc.transport import grants
from ucxrpc.transport.hostmem import cma
from ucxrpc.transport.wire.frame import (WRITTEN, BufferDesc, Frame, FrameKind, Limits, decode,
                                         encode)
from ucxrpc.transport.grants import Grants
from ucxrpc.transport.pipe import Pipe

#: The tests' unit: half the smallest grant (8 MiB since Run BF), so that
#: 2 * MIB is the smallest class, MIB below it and 16 * MIB the largest.
MIB = grants.MIN_BYTES // 2
assert 16 * MIB == grants.MAX_BYTES


class _Sent(list):
    """What Grants sent, as (pipe name, kind, payload); fails while ``broken``."""

    broken = False

    def __call__(self, pipe, payload, buffers, kind) -> None:
        if self.broken:
            raise BrokenError(f"pipe to {pipe.name} broken")
        self.append((pipe.name, kind, bytes(payload)))


def _alloc(nbytes: int, phase: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _pipe(*, cma_out: bool = True, cma_in: bool = True) -> Pipe:
    pipe = Pipe(1, "worker1", b"")
    pipe.cma.read_by_peer, pipe.cma.reads = cma_out, cma_in
    return pipe


def _entries(payload: bytes) -> list[tuple[int, int, int]]:
    return [struct.unpack_from("<IQQ", payload, k) for k in range(0, len(payload), 20)]


def _grant_frame(payload: bytes) -> Frame:
    return Frame(FrameKind.GRANT, 1, memoryview(payload), (), np.zeros(0, dtype=np.uint8))


def _written(gid: int, nbytes: int) -> BufferDesc:
    return BufferDesc(nbytes, 0, -1, WRITTEN, gid)


def test_size_classes_are_powers_of_two():
    assert [grants.size_class(n) for n in (2 * MIB, 2 * MIB + 1, 3 * MIB, 16 * MIB)] == \
        [2 * MIB, 4 * MIB, 4 * MIB, 16 * MIB]


def test_a_peer_is_lent_one_grant_per_class_from_huge_pages_to_the_largest():
    sent = _Sent()
    ours, pipe = Grants(alloc=_alloc, send=sent), _pipe()
    ours.lend(pipe, [(3 * MIB, 64), (4 * MIB, 0), (MIB, 0), (grants.MAX_BYTES + 1, 0)])
    # 3 and 4 MiB share a class; 1 MiB is below huge pages, MAX_BYTES + 1 above the largest.
    assert [(name, kind) for name, kind, _ in sent] == [("worker1", FrameKind.GRANT)]
    (gid, nbytes, address), = _entries(sent[0][2])
    assert nbytes == 4 * MIB and address == pipe.grants.lent[gid].data_ptr()
    assert ours.lent_bytes == 4 * MIB and ours.lent == 1
    ours.lend(pipe, [(4 * MIB, 0)])  # still lent, unused: nothing more
    assert len(sent) == 1


def test_nothing_is_lent_to_a_peer_that_never_showed_it_reaches_our_memory():
    sent = _Sent()
    ours, pipe = Grants(alloc=_alloc, send=sent), _pipe(cma_out=False)
    ours.lend(pipe, [(4 * MIB, 0)])
    assert sent == [] and pipe.grants.lent == {} and ours.lent_bytes == 0


def test_a_worker_lends_at_most_total_bytes(monkeypatch):
    monkeypatch.setattr(grants, "TOTAL_BYTES", 6 * MIB)
    sent = _Sent()
    ours = Grants(alloc=_alloc, send=sent)
    first, second = _pipe(), _pipe()
    ours.lend(first, [(4 * MIB, 0)])
    ours.lend(second, [(4 * MIB, 0), (2 * MIB, 0)])
    assert ours.lent_bytes == 6 * MIB
    assert [len(_entries(p)) for _, _, p in sent] == [1, 1]
    assert [t.numel() for t in second.grants.lent.values()] == [2 * MIB]


def test_a_grant_that_cannot_be_had_is_not_lent_and_not_counted():
    def refuse(nbytes, phase):
        raise MemoryError(f"no {nbytes} bytes")

    sent = _Sent()
    ours, pipe = Grants(alloc=refuse, send=sent), _pipe()
    ours.lend(pipe, [(4 * MIB, 0)])
    assert sent == [] and pipe.grants.lent == {} and ours.lent_bytes == 0


def test_a_grant_lent_on_a_broken_pipe_stays_out_of_use():
    sent = _Sent()
    sent.broken = True
    ours, pipe = Grants(alloc=_alloc, send=sent), _pipe()
    ours.lend(pipe, [(4 * MIB, 0)])
    assert ours.lent == 0 and len(pipe.grants.lent) == 1  # not sent, but possibly written: kept
    ours.retire(pipe)
    assert pipe.grants.lent == {} and ours.lent_bytes == 0
    assert ours.stats()["grant_bytes_retired"] == 4 * MIB


def test_a_written_buffer_is_the_lent_memory_once():
    sent = _Sent()
    ours, pipe = Grants(alloc=_alloc, send=sent), _pipe()
    ours.lend(pipe, [(4 * MIB, 0)])
    (gid, _, address), = _entries(sent[0][2])
    got = ours.take(pipe, 0, _written(gid, 3 * MIB + 5))
    assert got.numel() == 3 * MIB + 5 and got.data_ptr() == address
    assert ours.lent_bytes == 0 and ours.used == 1 and ours.used_bytes == 3 * MIB + 5
    with pytest.raises(FrameError, match=f"worker1 says it wrote buffer 2 into grant {gid}, "
                                         "which this worker did not lend it or saw used"):
        ours.take(pipe, 2, _written(gid, MIB))


def test_a_buffer_larger_than_its_grant_is_refused_naming_both_sizes():
    sent = _Sent()
    ours, pipe = Grants(alloc=_alloc, send=sent), _pipe()
    ours.lend(pipe, [(2 * MIB, 0)])
    (gid, _, _), = _entries(sent[0][2])
    with pytest.raises(FrameError, match=f"wrote {2 * MIB + 1} bytes \\(buffer 0\\) into a "
                                         f"{2 * MIB}-byte grant"):
        ours.take(pipe, 0, _written(gid, 2 * MIB + 1))


def test_grants_received_are_kept_by_class_and_picked_once():
    ours, pipe = Grants(alloc=_alloc, send=_Sent()), _pipe()
    payload = struct.pack("<IQQ", 7, 4 * MIB, 0x1000) + struct.pack("<IQQ", 8, 16 * MIB, 0x9000)
    ours.on_frame(pipe, _grant_frame(payload))
    assert pipe.grants.granted == {4 * MIB: [(7, 0x1000)], 16 * MIB: [(8, 0x9000)]}
    assert grants.pick(pipe, 3 * MIB) == (7, 0x1000)
    assert grants.pick(pipe, 3 * MIB) is None
    assert grants.pick(pipe, 9 * MIB) == (8, 0x9000)
    ours.retire(pipe)
    assert pipe.grants.granted == {}


def test_grants_from_a_peer_we_cannot_reach_are_left_unused():
    ours, pipe = Grants(alloc=_alloc, send=_Sent()), _pipe(cma_in=False)
    ours.on_frame(pipe, _grant_frame(struct.pack("<IQQ", 1, 4 * MIB, 0x1000)))
    assert pipe.grants.granted == {}


@pytest.mark.parametrize("payload, match", [
    (b"", "0-byte payload"),
    (b"x" * 21, "21-byte payload"),
    (b"x" * 20 * 33, "660-byte payload"),
    (struct.pack("<IQQ", 1, 3 * MIB, 0x1000), f"lent a {3 * MIB}-byte grant"),
    (struct.pack("<IQQ", 1, MIB, 0x1000), f"lent a {MIB}-byte grant"),
    (struct.pack("<IQQ", 1, 4 * MIB, 0), "at 0x0"),
])
def test_a_malformed_grant_frame_is_refused_naming_what_is_wrong(payload, match):
    ours, pipe = Grants(alloc=_alloc, send=_Sent()), _pipe()
    with pytest.raises(FrameError, match=match):
        ours.on_frame(pipe, _grant_frame(payload))
    assert pipe.grants.granted == {}


def test_written_descriptors_count_toward_the_message_and_name_host_memory_only():
    limits = Limits()
    frame, separate = encode(FrameKind.MESSAGE, 1, b"p", [(5 * MIB, None, -1)], b"k" * 16, limits,
                             ways=[(WRITTEN, 3, 0)])
    assert separate == []
    got = decode(frame, b"k" * 16, limits)
    assert got.buffers[0].flags == WRITTEN and got.buffers[0].arg == 3
    assert got.total >= 5 * MIB
    bad, _ = encode(FrameKind.MESSAGE, 1, b"p", [(5 * MIB, None, 0)], b"k" * 16, limits,
                    ways=[(WRITTEN, 3, 0)])
    with pytest.raises(FrameError, match="written into host memory here, but its descriptor "
                                         "names device 0"):
        decode(bad, b"k" * 16, limits)


def test_lending_for_a_split_write_keeps_the_loop_from_polling_for_a_while(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(grants.time, "monotonic", lambda: now[0])
    ours = Grants(alloc=_alloc, send=_Sent())
    assert not ours.split_write_due()
    # (every grant is written in two halves: none is under SPLIT_BYTES)
    assert grants.MIN_BYTES >= grants.SPLIT_BYTES
    ours.lend(_pipe(), [(grants.SPLIT_BYTES, 0)])
    assert ours.split_write_due()
    now[0] += grants.SPLIT_QUIET_S
    assert not ours.split_write_due()


def test_a_peer_that_lends_more_than_it_should_is_not_kept_beyond_a_few_per_class():
    ours, pipe = Grants(alloc=_alloc, send=_Sent()), _pipe()
    for gid in range(10):
        ours.on_frame(pipe, _grant_frame(struct.pack("<IQQ", gid, 4 * MIB, 0x1000 + gid)))
    assert len(pipe.grants.granted[4 * MIB]) == grants._KEPT_PER_CLASS


def test_grant_bounds():
    # The classes writing pays for: receive buffers on huge pages, and no
    # standing grant larger than what the worker may lend at all.
    assert grants.MIN_BYTES >= cma.MIN_BYTES
    assert grants.MAX_BYTES <= grants.TOTAL_BYTES


# ------------------------------------------------------------ between two workers

def _between_workers(test):
    """Marks a test between two workers: it starts them, and reading by
    address (which makes a receiver lend grants) must work between them."""
    for mark in (pytest.mark.processes, pytest.mark.timeout(120), needs_sibling_reads,
                 pytest.mark.skipif(cma.offer() is None,
                                    reason="process_vm_readv or /proc is not available here")):
        test = mark(test)
    return test


# Above reading by address and the smallest grant, in the 16 MiB class.
_SIZE = (8 << 20) + 3


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
        view = torch.randn(2 << 20, generator=g)[5:]
        for _ in range(2):
            there, back = rpc.rpc_sync("worker1", digest_and_echo, (view,))
            out["echo"].append((there == _digest(view), _digest(back) == _digest(view)))
        out["mine"] = debug_counts(_COUNTS)
        out["theirs"] = rpc.rpc_sync("worker1", debug_counts, (_COUNTS,))
    rpc.shutdown()
    return out


@_between_workers
def test_large_buffers_are_written_into_memory_the_receiver_lent():
    out = run_workers(_echoes, 2, timeout=90)[0]
    assert out["echo"] == [(True, True)] * 7
    for mine, theirs in ((out["mine"], out["theirs"]), (out["theirs"], out["mine"])):
        # Each way and class, the first buffer is read by address; that
        # makes its receiver lend memory of its class, so every later one
        # is written.  (The view's whole 8 MiB storage travels.)
        assert mine["buffers_read_by_peers"] == 2
        assert mine["buffers_written_into_peers"] == theirs["grants_used"] == 4 + 1
        assert theirs["bytes_written_by_peers"] == 4 * _SIZE + (1 << 23)
        # One grant of each class lent and unused now, lent again after each use.
        assert theirs["grants_lent"] == 2 + 5
        assert theirs["grant_bytes_lent"] == (16 << 20) + (8 << 20)
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


@_between_workers
def test_a_buffer_written_into_a_grant_never_lent_fails_its_call_and_the_worker_serves_on():
    out = run_workers(_forged, 2, timeout=90)[0]
    assert out["error"] is not None
    assert "grant 999999, which this worker did not lend it" in out["error"]
    assert out["after"] == 5
    assert out["large_after"] == (True, True)
    assert out["theirs"]["grants_used"] == 0
