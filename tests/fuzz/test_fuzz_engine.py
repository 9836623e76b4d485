"""The transport engine's receive path on hostile input, in process.

Two real :class:`Transport` objects talk through a fake UCX layer (the
engine's ``Worker`` and ``Endpoint`` replaced by in-memory ones), so every
frame a rogue could put on the wire reaches the receiver's real ``on_frame``,
the native ``Inlet`` behind it and the handshake's ``on_frame``, and the test
can insert rogue frames at exact points of a genuine handshake: something a
live test can only do by luck of timing.

Properties: no exception escapes the receive path; every refused frame is
counted once (``refused`` or ``frame_errors``); no rogue frame authenticates
a pipe, changes a session key, reaches ``on_message`` or breaks a pipe; the
genuine peer is still served afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.frames import (FRAME, HANDSHAKE, Shot, as_array, classify, handshake_frame,
                               rogue_corpus, tag_of)
from tests.transport.fakenet import Net, Pair, fake_net, pair  # noqa: F401  (fixtures)
from ucxrpc.errors import FrameError
from ucxrpc.transport.pipe import OutState
from ucxrpc.transport.wire import auth
from ucxrpc.transport.wire.frame import FrameKind, Limits
from ucxrpc.transport.ucx.binding import Probe

SCALE = float(os.environ.get("UCXRPC_FUZZ_SCALE", "1"))
pytestmark = pytest.mark.timeout(60 * max(1.0, SCALE))


def fuzz(n: int) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


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
        data = handshake_frame(FrameKind.HELLO, draw(st.one_of(
            st.builds(auth.hello, st.sampled_from([0, 1, 2, 2**32 - 1]),
                      st.binary(min_size=32, max_size=32)),
            st.binary(max_size=40))))
    elif what == 2:
        data = handshake_frame(draw(st.sampled_from([FrameKind.PROOF, FrameKind.CHALLENGE])),
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
def test_rogue_frames_are_counted_and_change_nothing(fake_net: Net, batch: list[Shot],
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


@pytest.mark.parametrize("kind", [FrameKind.MESSAGE, FrameKind.BATCH, FrameKind.CMA_OK],
                         ids=lambda k: k.name)
def test_non_handshake_frames_on_the_handshake_tag_are_counted(pair: Pair, kind: FrameKind) -> None:
    pair.open()
    before = pair.w1.counted()
    pair.w1.tr._rx.on_frame(tag_of(HANDSHAKE, 0), as_array(handshake_frame(kind, b"x")))
    assert pair.w1.counted() - before == 1


# -------------------------------------------- a handshake in progress

def _forged_hello(claimed: int = 0) -> Shot:
    return Shot(tag_of(HANDSHAKE, claimed), handshake_frame(
        FrameKind.HELLO, auth.hello(claimed, auth.new_nonce())), "hello")


def _forged_proof() -> Shot:
    return Shot(tag_of(HANDSHAKE, 0), handshake_frame(FrameKind.PROOF, os.urandom(32)), "counted")


def _forged_challenge() -> Shot:
    payload = os.urandom(4 + 2 * auth.NONCE_LEN + 32)
    payload = (1).to_bytes(4, "little") + payload[4:]  # claims to answer as worker 1
    return Shot(tag_of(HANDSHAKE, 1), handshake_frame(FrameKind.CHALLENGE, payload), "counted")


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
def pairs(fake_net: Net) -> Iterator[dict[bool, Pair]]:
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


def test_messages_over_max_message_bytes_are_answered_not_received(fake_net: Net) -> None:
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
