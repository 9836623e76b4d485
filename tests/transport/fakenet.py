"""A fake network under real transports: two :class:`Transport` objects in
one process, their UCX worker and endpoint replaced by in-memory ones (the
transport takes them as arguments), so a test drives every frame by hand.

Frames (handshake and message tags) are queued per destination and handed
to the receiver's real ``on_frame`` by :meth:`Pair.deliver_one`, or put
where its real ``poll`` takes them by :meth:`Pair.queue_for_poll`; data
buffers are queued too but never delivered, so a receive posted for one
stays in flight until the test ends it.  ``probe`` matches tags as UCX does;
``cancel`` completes a receive as cancelled.

Used by the fuzz tests (tests/fuzz/test_fuzz_engine.py) and the engine's,
the sender's and the receiver's own tests (tests/transport/test_engine.py,
tests/transport/test_send_receive.py, which lands a data buffer by hand).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ucxrpc.errors import BrokenError
from ucxrpc.transport.engine import Transport
from ucxrpc.transport.pipe import Peer as PeerRecord
from ucxrpc.transport.ucx.binding import Probe
from ucxrpc.transport.ucx.ucp import DONE
from ucxrpc.transport.wire import tags
from ucxrpc.transport.wire.frame import Limits

__all__ = ["FakeEndpoint", "FakeWorker", "Net", "Pair", "Peer", "Request", "SECRET", "as_array",
           "fake_net", "pair"]

SECRET = b"job-secret"


def as_array(data: bytes) -> np.ndarray:
    """A received frame as the receiver holds it: a writable byte array."""
    return np.frombuffer(bytearray(data), dtype=np.uint8)


class Request:
    def __init__(self, done: bool = True) -> None:
        self.done = done
        self.cancelled = False

    def error(self) -> BrokenError | None:
        return BrokenError("cancelled") if self.cancelled else None


class Net:
    """Tag messages in flight, by destination address."""

    def __init__(self) -> None:
        self.queues: dict[bytes, list[tuple[int, bytes]]] = {}
        self.addresses = itertools.count()


class FakeWorker:
    net: Net

    def __init__(self, transports: Any, host_timeout: float = 10.0, *,
                 device_memory: bool = False, device_path: str = "ucp") -> None:
        self.address = b"w%d" % next(self.net.addresses)
        self.device_ucp = device_path == "ucp"
        self.net.queues[self.address] = []
        self.cuda_memory = False
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.posted: list[tuple[int, Any]] = []
        self.probes: list[Probe] = []   # frames waiting to be probed
        self.received: list[int] = []   # sizes of the buffers frames went into
        self.cancelled: list[Request] = []

    def progress(self) -> None:
        pass

    def arm(self) -> bool:
        return True

    def spinner(self, tag: int, mask: int, small: int) -> None:
        return None  # no native spin below a fake network: every idle turn is Python's

    def tag(self, value: int) -> int:
        return value

    def probe(self, tag: int, mask: int) -> Probe | None:
        for i, found in enumerate(self.probes):  # UCX's matching rule
            if found.sender_tag & mask == tag & mask:
                return self.probes.pop(i)
        return None

    def taker(self, tag: int, mask: int, small: int) -> Any:
        return functools.partial(self._take, tag, mask, small)

    def _take(self, tag: int, mask: int, small: int) -> list[tuple[int, int, Any, Any]] | None:
        out: list[tuple[int, int, Any, Any]] = []
        while (found := self.probe(tag, mask)) is not None:
            if found.length <= small:
                buf = np.empty(found.length, dtype=np.uint8)
                self.received.append(buf.nbytes)
                if isinstance(found.raw, bytes):
                    # A frame Pair.queue_for_poll put here: received whole at
                    # once, as ucp_take gives one (UCP_DONE).
                    buf[:] = np.frombuffer(found.raw, dtype=np.uint8)
                    out.append((found.sender_tag, found.length, DONE, buf))
                    continue
                out.append((found.sender_tag, found.length, Request(), buf))
            else:
                out.append((found.sender_tag, found.length, None, found))
        return out or None

    def recv_taken(self, buf: np.ndarray, handle: Any) -> Request:
        return self.recv_probed(buf, handle)

    def cancel(self, req: Request) -> int:
        if req.done:
            return 0
        req.done = req.cancelled = True
        self.cancelled.append(req)
        return 1

    def recv_probed(self, buf: np.ndarray, probe: Probe) -> Request:
        self.received.append(buf.nbytes)
        return Request()

    def tag_recv(self, buf: Any, tag: int) -> Request:
        self.posted.append((tag, buf))
        return Request(done=False)

    def close(self) -> None:
        os.close(self.fd)


class FakeEndpoint:
    net: Net

    def __init__(self, worker: FakeWorker, address: bytes, on_error: Any) -> None:
        self.address = address
        self.alive = True
        self.discarded = False

    def tag_send(self, buf: Any, tag: int) -> Request:
        data = buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else np.asarray(buf).tobytes()
        self.net.queues.setdefault(self.address, []).append((int(tag), data))
        return Request()

    send_frame = tag_send

    def transports(self) -> list[tuple[str, str]]:
        return []

    def close(self) -> None:
        self.alive = False

    def discard(self) -> int:
        self.alive = False
        self.discarded = True
        return 0  # no connection of a kernel's to cut


class Peer:
    """One transport and what its callbacks saw."""

    def __init__(self, my_id: int, limits: Limits = Limits()) -> None:
        self.messages: list[tuple[int, bytes]] = []
        self.frame_errors: list[tuple[int, int, BaseException]] = []
        self.broken: list[tuple[int, BaseException]] = []
        self.restored: list[int] = []
        self.tr = Transport(
            my_id=my_id, secret=SECRET, limits=limits,
            on_message=lambda peer, payload, bufs: self.messages.append((peer, bytes(payload))),
            on_frame_error=lambda peer, hint, exc: self.frame_errors.append((peer, hint, exc)),
            on_broken=lambda peer, exc: self.broken.append((peer, exc)),
            on_restored=self.restored.append,
            worker=FakeWorker, endpoint=FakeEndpoint)

    @property
    def address(self) -> bytes:
        return self.tr.address

    def counted(self) -> int:
        return self.tr._rx.refused + self.tr._rx.frame_errors


class Pair:
    """Worker 0 and worker 1, each the other's peer, over the fake network."""

    def __init__(self, net: Net, limits1: Limits = Limits()) -> None:
        self.net = net
        self.w0 = Peer(0)
        self.w1 = Peer(1, limits1)
        self.w0.tr.add_peer(PeerRecord(1, "worker1", self.w1.address))
        self.w1.tr.add_peer(PeerRecord(0, "worker0", self.w0.address))
        self.peers = {self.w0.address: self.w0, self.w1.address: self.w1}

    def deliver_one(self, peer: Peer) -> bool:
        """Hand ``peer`` the oldest frame sent to it (data buffers are dropped)."""
        queue = self.net.queues[peer.address]
        while queue:
            tag, data = queue.pop(0)
            if tag >> tags.KIND_SHIFT in (tags.HANDSHAKE, tags.FRAME):
                peer.tr._rx.on_frame(tag, as_array(data))
                return True
        return False

    def queue_for_poll(self, peer: Peer) -> int:
        """Move the frames sent to ``peer`` where its ``Receiver.poll``
        takes them (its worker's unexpected queue), data buffers dropped;
        how many."""
        queue = self.net.queues[peer.address]
        frames = [(tag, data) for tag, data in queue
                  if tag >> tags.KIND_SHIFT in (tags.HANDSHAKE, tags.FRAME)]
        queue.clear()
        peer.tr._worker.probes.extend(Probe(tag, len(data), data) for tag, data in frames)
        return len(frames)

    def step(self) -> bool:
        busy = False
        for peer in (self.w0, self.w1):
            busy = peer.tr._run_tasks() or busy
            busy = self.deliver_one(peer) or busy
        return busy

    def settle(self) -> None:
        for _ in range(200):
            if not self.step():
                return
        raise AssertionError("the fake network never went quiet")

    def open(self) -> None:
        """Both directions authenticated, through the genuine handshake."""
        self.w0.tr.send(1, b"first", [])
        self.settle()
        self.w1.tr.send(0, b"reply", [])
        self.settle()
        assert self.w1.messages == [(0, b"first")] and self.w0.messages == [(1, b"reply")]
        self.w0.messages.clear()
        self.w1.messages.clear()

    def still_serving(self) -> None:
        """Both peers can still talk to each other."""
        self.w0.tr.send(1, b"ping-from-0", [])
        self.w1.tr.send(0, b"ping-from-1", [])
        self.settle()
        assert (0, b"ping-from-0") in self.w1.messages, self.w1.messages
        assert (1, b"ping-from-1") in self.w0.messages, self.w0.messages
        assert not self.w0.broken and not self.w1.broken, (self.w0.broken, self.w1.broken)


@pytest.fixture
def fake_net(monkeypatch: pytest.MonkeyPatch) -> Iterator[Net]:
    net = Net()
    monkeypatch.setattr(FakeWorker, "net", net, raising=False)
    monkeypatch.setattr(FakeEndpoint, "net", net, raising=False)
    yield net


@pytest.fixture
def pair(fake_net: Net) -> Iterator[Pair]:
    p = Pair(fake_net)
    yield p
    p.w0.tr.close()
    p.w1.tr.close()
