"""The transport engine's receive path on hostile input, in process.

Two real :class:`Transport` objects talk through a fake UCX layer (the
engine's ``Worker`` and ``Endpoint`` replaced by in-memory ones), so every
frame a rogue could put on the wire reaches the receiver's real ``on_frame``
and ``_message_frame`` and the handshake's ``on_frame``, and the test can insert
rogue frames at exact points of a genuine handshake: something a live test
can only do by luck of timing.

Properties: no exception escapes the receive path; every refused frame is
counted once (``refused`` or ``frame_errors``); no rogue frame authenticates
a pipe, changes a session key, reaches ``on_message`` or breaks a pipe; the
genuine peer is still served afterwards.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.frames import (FRAME, HANDSHAKE, Shot, as_array, classify, handshake_frame,
                               rogue_corpus, tag_of)
from ucxrpc.errors import FrameError
from ucxrpc.transport.wire import auth, tags

from ucxrpc.transport.engine import Transport
from ucxrpc.transport.pipe import OutState
from ucxrpc.transport.pipe import Peer as PeerRecord
from ucxrpc.transport.wire.frame import Kind, Limits
from ucxrpc.transport.ucx.binding import Probe


SECRET = b"job-secret"
SCALE = float(os.environ.get("UCXRPC_FUZZ_SCALE", "1"))
pytestmark = pytest.mark.timeout(60 * max(1.0, SCALE))


def fuzz(n: int) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------- fake UCX

class _Request:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def error(self) -> None:
        return None


class _Net:
    """Tag messages in flight, by destination address."""

    def __init__(self) -> None:
        self.queues: dict[bytes, list[tuple[int, bytes]]] = {}
        self.addresses = itertools.count()


class _FakeWorker:
    net: _Net

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

    def progress(self) -> None:
        pass

    def arm(self) -> bool:
        return True

    def tag(self, value: int) -> int:
        return value

    def probe(self, tag: int, mask: int) -> Probe | None:
        return self.probes.pop(0) if self.probes else None

    def recv_probed(self, buf: np.ndarray, probe: Probe) -> _Request:
        self.received.append(buf.nbytes)
        return _Request()

    def tag_recv(self, buf: Any, tag: int) -> _Request:
        self.posted.append((tag, buf))
        return _Request(done=False)

    def close(self) -> None:
        os.close(self.fd)


class _FakeEndpoint:
    net: _Net

    def __init__(self, worker: _FakeWorker, address: bytes, on_error: Any) -> None:
        self.address = address

    def tag_send(self, buf: Any, tag: int) -> _Request:
        data = buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else np.asarray(buf).tobytes()
        self.net.queues.setdefault(self.address, []).append((int(tag), data))
        return _Request()

    def transports(self) -> list[tuple[str, str]]:
        return []

    def close(self) -> None:
        pass


class Peer:
    """One transport and what its callbacks saw."""

    def __init__(self, my_id: int, limits: Limits = Limits()) -> None:
        self.messages: list[tuple[int, bytes]] = []
        self.frame_errors: list[tuple[int, int, BaseException]] = []
        self.broken: list[tuple[int, BaseException]] = []
        self.tr = Transport(
            my_id=my_id, secret=SECRET, limits=limits,
            on_message=lambda peer, payload, bufs: self.messages.append((peer, bytes(payload))),
            on_frame_error=lambda peer, hint, exc: self.frame_errors.append((peer, hint, exc)),
            on_broken=lambda peer, exc: self.broken.append((peer, exc)),
            worker=_FakeWorker, endpoint=_FakeEndpoint)

    @property
    def address(self) -> bytes:
        return self.tr.address

    def counted(self) -> int:
        return self.tr._rx.refused + self.tr._rx.frame_errors


class Pair:
    """Worker 0 and worker 1, each the other's peer, over the fake network."""

    def __init__(self, net: _Net, limits1: Limits = Limits()) -> None:
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
            if tag >> tags.KIND_SHIFT in (HANDSHAKE, FRAME):
                peer.tr._rx.on_frame(tag, as_array(data))
                return True
        return False

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
def fake_net(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Net]:
    net = _Net()
    monkeypatch.setattr(_FakeWorker, "net", net, raising=False)
    monkeypatch.setattr(_FakeEndpoint, "net", net, raising=False)
    yield net


@pytest.fixture
def pair(fake_net: _Net) -> Iterator[Pair]:
    p = Pair(fake_net)
    yield p
    p.w0.tr.close()
    p.w1.tr.close()


def test_the_fake_network_carries_a_genuine_handshake(pair: Pair) -> None:
    pair.open()
    assert pair.w1.tr._pipes[0].auth.in_key is not None
    assert pair.w0.tr._pipes[1].out.state is OutState.OPEN
    assert pair.w0.counted() == pair.w1.counted() == 0
    pair.still_serving()


# ----------------------------------------------------------- strategies

LIMITS = Limits()

_kinds = st.sampled_from([HANDSHAKE, FRAME])
_senders = st.sampled_from([0, 0, 0, 1, 2, 0xFFFF])


@st.composite
def shots(draw: Any) -> Shot:
    """A frame from a rogue: random, a damaged real one, or a forged handshake."""
    kind, sender = draw(_kinds), draw(_senders)
    hint = draw(st.integers(0, (1 << 46) - 1)) if kind == FRAME else 0
    what = draw(st.integers(0, 4))
    if what == 0:
        data = draw(st.binary(max_size=300))
    elif what == 1:
        data = handshake_frame(Kind.HELLO, draw(st.one_of(
            st.builds(auth.hello, st.sampled_from([0, 1, 2, 2**32 - 1]),
                      st.binary(min_size=32, max_size=32)),
            st.binary(max_size=40))))
    elif what == 2:
        data = handshake_frame(draw(st.sampled_from([Kind.PROOF, Kind.CHALLENGE])),
                               draw(st.binary(max_size=110)))
    else:  # from the seeded corpus: mutated frames of every shape
        seed = draw(st.integers(0, 2**32))
        return rogue_corpus(seed, 1, 0, LIMITS)[0]
    tag = tag_of(kind, sender, hint)
    return Shot(tag, data, classify(tag, data, 0, LIMITS))


# ------------------------------------------------------- rogue frames

def _shoot(pair: Pair, shot: Shot) -> None:
    """Feed worker 1 one rogue frame and check what it may and may not do."""
    w1 = pair.w1
    pipe = w1.tr._pipes[0]
    key, state = pipe.auth.in_key, pipe.out.state
    before = w1.counted()
    sent_before = len(pair.net.queues[pair.w0.address])
    w1.tr._rx.on_frame(shot.tag, as_array(shot.data))  # nothing may escape
    counted = w1.counted() - before
    challenges = len(pair.net.queues[pair.w0.address]) - sent_before
    if shot.outcome == "hello":
        assert (counted, challenges) == (0, 1), shot
    elif shot.outcome == "counted":
        assert (counted, challenges) == (1, 0), shot
    else:  # "ignored": see test_non_handshake_frames_on_the_handshake_tag_are_counted
        assert counted <= 1 and challenges == 0, shot
    assert pipe.auth.in_key == key and pipe.out.state is state, shot
    assert not w1.messages and not w1.frame_errors and not w1.broken, shot


@fuzz(60)
@given(batch=st.lists(shots(), min_size=1, max_size=25), opened=st.booleans())
def test_rogue_frames_are_counted_and_change_nothing(fake_net: _Net, batch: list[Shot],
                                                     opened: bool) -> None:
    """Before or after the genuine handshake, whatever a rogue sends is counted
    and ignored; the genuine pipe then opens (or stays open) and serves."""
    pair = Pair(fake_net)
    try:
        if opened:
            pair.open()
        for shot in batch:
            _shoot(pair, shot)
        # The CHALLENGEs worker 1 sent to worker 0 for forged HELLOs: refused
        # there, without breaking anything.
        hellos = sum(s.outcome == "hello" for s in batch)
        before = pair.w0.counted()
        pair.settle()
        assert pair.w0.counted() - before == hellos
        if not opened:
            pair.open()
        pair.still_serving()
    finally:
        pair.w0.tr.close()
        pair.w1.tr.close()


def test_the_seeded_corpus_against_an_open_pipe(pair: Pair) -> None:
    """The live rogue's corpus, replayed in process (same seed as the live test)."""
    pair.open()
    corpus = rogue_corpus(20240611, 300, 0, LIMITS)
    for shot in corpus:
        _shoot(pair, shot)
    pair.settle()
    pair.still_serving()


@pytest.mark.parametrize("kind", [Kind.MESSAGE, Kind.PING, Kind.PONG], ids=lambda k: k.name)
def test_non_handshake_frames_on_the_handshake_tag_are_counted(pair: Pair, kind: Kind) -> None:
    pair.open()
    before = pair.w1.counted()
    pair.w1.tr._rx.on_frame(tag_of(HANDSHAKE, 0), as_array(handshake_frame(kind, b"x")))
    assert pair.w1.counted() - before == 1


# -------------------------------------------- a handshake in progress

def _forged_hello(claimed: int = 0) -> Shot:
    return Shot(tag_of(HANDSHAKE, claimed), handshake_frame(
        Kind.HELLO, auth.hello(claimed, auth.new_nonce())), "hello")


def _forged_proof() -> Shot:
    return Shot(tag_of(HANDSHAKE, 0), handshake_frame(Kind.PROOF, os.urandom(32)), "counted")


def _forged_challenge() -> Shot:
    payload = os.urandom(4 + 2 * auth.NONCE_LEN + 32)
    payload = (1).to_bytes(4, "little") + payload[4:]  # claims to answer as worker 1
    return Shot(tag_of(HANDSHAKE, 1), handshake_frame(Kind.CHALLENGE, payload), "counted")


def _handshake_with_rogue(pair: Pair, at: int, shot: Shot, to_w0: bool) -> None:
    """Run worker 0's handshake to worker 1 frame by frame, with ``shot``
    delivered (to worker 1, or to worker 0) after ``at`` genuine frames."""
    pair.w0.tr.send(1, b"first", [])
    pair.w0.tr._run_tasks()  # worker 0 sends HELLO
    genuine = 0
    target = pair.w0 if to_w0 else pair.w1
    for _ in range(50):
        if genuine == at:
            target.tr._rx.on_frame(shot.tag, as_array(shot.data))
            genuine += 1  # inject once
            continue
        moved = False
        for peer in (pair.w1, pair.w0):
            peer.tr._run_tasks()
            if pair.deliver_one(peer):
                moved = True
                genuine += 1
                break
        if not moved and genuine > at:
            break
    pair.settle()


# (genuine frames delivered before the rogue's, the rogue's frame): genuine
# frames are worker 0's HELLO, worker 1's CHALLENGE, worker 0's PROOF, then
# worker 0's first message.
_ROGUE_POINTS = [
    pytest.param(0, "hello"),  # reflected CHALLENGE breaks worker 0
    pytest.param(0, "proof"),                        # PROOF without HELLO: refused, harmless
    pytest.param(0, "challenge"),
    pytest.param(1, "hello"),
    pytest.param(1, "proof"),
    pytest.param(1, "challenge"),
    pytest.param(2, "hello"),
    pytest.param(2, "proof"),
    pytest.param(2, "challenge"),                    # worker 0 is open: refused, harmless
    pytest.param(3, "hello"),
    pytest.param(3, "proof"),
    pytest.param(3, "challenge"),
]


@pytest.mark.parametrize("at, name", _ROGUE_POINTS)
def test_a_rogue_cannot_spoil_a_genuine_handshake(pair: Pair, at: int, name: str) -> None:
    """Worker 0 opens its pipe to worker 1 while a rogue (no secret) sends one
    forged handshake frame at a chosen point: the pipe must still open."""
    shot = {"hello": _forged_hello, "proof": _forged_proof, "challenge": _forged_challenge}[name]()
    _handshake_with_rogue(pair, at, shot, to_w0=name == "challenge")
    assert not pair.w0.broken, f"worker 0's pipe broke: {pair.w0.broken}"
    assert pair.w1.tr._pipes[0].auth.in_key is not None, "worker 0's genuine handshake was refused"
    assert pair.w1.messages == [(0, b"first")]
    pair.still_serving()


# ----------------------------------------------------------- oversize

@pytest.fixture
def pairs(fake_net: _Net) -> Iterator[dict[bool, Pair]]:
    """A pair whose pipes are open and one whose pipes never opened."""
    out = {True: Pair(fake_net), False: Pair(fake_net)}
    out[True].open()
    yield out
    for p in out.values():
        p.w0.tr.close()
        p.w1.tr.close()


@fuzz(150)
@given(kind=_kinds, sender=_senders, hint=st.integers(0, (1 << 46) - 1),
       opened=st.booleans(), extra=st.integers(1, 1 << 40))
def test_oversize_frames_are_counted(pairs: dict[bool, Pair], kind: int, sender: int, hint: int,
                                     opened: bool, extra: int) -> None:
    """A frame over max_frame_bytes is dropped unread and counted, and its
    tag's hint is never acted on: a tag is only a claim (see test_fuzz_live's
    forged-hint test)."""
    w1 = pairs[opened].w1
    before, reported = w1.tr._rx.frame_errors, len(w1.frame_errors)
    tag = tag_of(kind, sender, hint)
    size = LIMITS.max_frame_bytes + extra
    why = w1.tr._rx.unwanted(tag, size)
    assert why == f"exceeds max_frame_bytes={LIMITS.max_frame_bytes}"
    w1.tr._rx.dropped(tag, size, why)
    assert w1.tr._rx.frame_errors == before + 1
    assert len(w1.frame_errors) == reported
    assert not w1.broken and not w1.messages


@pytest.mark.parametrize("tag", [tag_of(HANDSHAKE, 0), tag_of(HANDSHAKE, 9), tag_of(FRAME, 9),
                                 tag_of(FRAME, 0)],
                         ids=["handshake-peer", "handshake-unknown", "frame-unknown",
                              "frame-unauthenticated"])
def test_frames_nobody_can_accept_are_not_received_at_their_claimed_size(pair: Pair,
                                                                         tag: int) -> None:
    """A handshake frame is a few dozen bytes; a frame from an unknown or not
    yet authenticated sender is refused anyway: neither deserves 512 MiB."""
    w1 = pair.w1
    w1.tr._worker.probes.append(Probe(tag, 512 << 20, None))
    before = w1.counted()
    w1.tr._rx.poll()
    assert w1.counted() == before + 1
    assert w1.tr._worker.received[-1] <= 64 << 10, w1.tr._worker.received


def test_messages_over_max_message_bytes_are_answered_not_received(fake_net: _Net) -> None:
    pair = Pair(fake_net, limits1=Limits(max_message_bytes=1 << 20))
    try:
        pair.open()
        pair.w0.tr.send(1, b"big", [torch.zeros(2 << 20, dtype=torch.uint8)], hint=77)
        pair.settle()
        assert pair.w1.tr._rx.frame_errors == 1 and not pair.w1.messages
        [(peer, hint, exc)] = pair.w1.frame_errors
        assert (peer, hint) == (0, 77) and isinstance(exc, FrameError)
        assert "exceeds max_message_bytes=1048576" in str(exc)
        # The rejected buffer is received into a 1-byte sink, not allocated.
        assert all(buf.nbytes <= 1 for _, buf in pair.w1.tr._worker.posted)
        pair.still_serving()
    finally:
        pair.w0.tr.close()
        pair.w1.tr.close()
