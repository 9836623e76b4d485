"""The transport engine's pipes (ucxrpc/transport/engine.py) on the fake
network (tests/transport/fakenet.py): breaking, ending and re-establishing
a pipe, step by step, with both sides' real handshake and receive code.

Every move of a pipe's outgoing side (pipe.py, ``_OUT_MOVES``) is tried
against the table; then the generations: a pipe broken as unreachable is
replaced by its next generation once its peer answers again, the peer
follows, messages flow both ways again, and nothing of the old pipe (its
receives, its epoch, a stale handshake) reaches the new one.
"""

from __future__ import annotations

import pytest
import torch

from tests.transport.fakenet import Net, Pair, Peer, fake_net, pair  # noqa: F401  (fixtures)
from ucxrpc.errors import BrokenError, UnreachableError
from ucxrpc.transport import handshake
from ucxrpc.transport.pipe import _OUT_MOVES, BadMove, OutState, Pipe
from ucxrpc.transport.wire import tags
from ucxrpc.transport.wire.frame import FrameKind, encode

pytestmark = pytest.mark.timeout(60)

#: Large enough to travel as its own tag message (not inline in the frame).
SEPARATE = 1 << 20


# ------------------------------------------------------------ the table

@pytest.mark.parametrize("start", list(OutState))
@pytest.mark.parametrize("to", list(OutState))
def test_every_move_of_a_pipe_is_the_tables(start: OutState, to: OutState) -> None:
    pipe = Pipe(1, "worker1", b"a")
    pipe.out.state = start
    if to in _OUT_MOVES[start]:
        pipe.move_to(to)
        assert pipe.out.state is to
    else:
        with pytest.raises(BadMove, match=f"{start.value} -> {to.value}"):
            pipe.move_to(to)
        assert pipe.out.state is start


def test_broken_and_closed_are_final_and_new_closes_unused() -> None:
    assert not _OUT_MOVES[OutState.BROKEN] and not _OUT_MOVES[OutState.CLOSED]
    assert OutState.CLOSED in _OUT_MOVES[OutState.NEW]


# --------------------------------------------------------------- helpers

def _pipe(peer: Peer, other: int) -> Pipe:
    return peer.tr._pipes[other]


def _lose(peer: Peer, other: int) -> Pipe:
    """What a lost lifeline does: the pipe breaks as unreachable."""
    pipe = _pipe(peer, other)
    peer.tr._break(pipe, UnreachableError("its host answered no TCP keepalive for 10 s"))
    return pipe


def _back(peer: Peer, pipe: Pipe) -> None:
    """What the lifeline does once the same process answers again."""
    peer.tr._came_back(pipe)


def _send_large(pair: Pair, frm: Peer, to: int) -> None:
    """A message with one separate buffer: its frame arrives, its data never
    does (the fake network delivers no data), so a receive stays posted."""
    frm.tr.send(to, b"large", [torch.zeros(SEPARATE, dtype=torch.uint8)])
    pair.settle()


# ------------------------------------------------------------ generations

def test_a_lost_pipe_fails_now_and_comes_back_as_its_next_generation(pair: Pair) -> None:
    pair.open()
    old0, old1 = _pipe(pair.w0, 1), _pipe(pair.w1, 0)
    _lose(pair.w0, 1)
    assert old0.out.state is OutState.BROKEN and old0.recoverable
    (peer, err), = pair.w0.broken
    assert peer == 1 and isinstance(err, UnreachableError) and "worker1" in str(err)
    with pytest.raises(UnreachableError, match="worker1 is broken"):
        pair.w0.tr.send(1, b"during", [])
    _back(pair.w0, old0)
    pair.settle()
    new0, new1 = _pipe(pair.w0, 1), _pipe(pair.w1, 0)
    assert (new0.gen, new1.gen) == (1, 1) and new0 is not old0 and new1 is not old1
    assert new0.out.state is new1.out.state is OutState.OPEN
    assert new0.auth.in_key is not None and new1.auth.in_key is not None
    # worker1 had not noticed: it learnt from the HELLO that what it had in
    # flight is lost, named so, and took the new generation up at once.
    (peer, err), = pair.w1.broken
    assert peer == 0 and isinstance(err, UnreachableError)
    assert "worker0 re-established its pipe" in str(err), err
    assert old1.out.state is OutState.BROKEN
    assert pair.w0.restored == [1] and pair.w1.restored == [0]
    pair.w0.broken.clear()
    pair.w1.broken.clear()
    pair.still_serving()
    assert pair.w0.tr.renewed == pair.w1.tr.renewed == 1


def test_both_sides_lost_and_back_at_once_meet_in_one_generation(pair: Pair) -> None:
    pair.open()
    old0, old1 = _lose(pair.w0, 1), _lose(pair.w1, 0)
    _back(pair.w0, old0)
    _back(pair.w1, old1)
    pair.settle()
    assert _pipe(pair.w0, 1).gen == _pipe(pair.w1, 0).gen == 1
    assert len(pair.w0.broken) == len(pair.w1.broken) == 1  # the loss only: no second break
    pair.w0.broken.clear()
    pair.w1.broken.clear()
    pair.still_serving()


def test_a_hello_to_a_pipe_broken_while_the_peer_lives_is_answered_on_the_next(
        pair: Pair) -> None:
    """worker1 lost its pipe; worker0 did not notice, and says HELLO on a
    pipe of its own that it never used: worker1 answers on its next
    generation, and worker0 then learns of worker1's loss."""
    pair.w1.tr.send(0, b"first", [])
    pair.settle()  # worker1 -> worker0 open; worker0's own pipe unused
    _lose(pair.w1, 0)
    pair.w0.tr.send(1, b"hello-after", [])
    pair.settle()
    assert (0, b"hello-after") in pair.w1.messages
    assert _pipe(pair.w1, 0).gen == 1 and pair.w1.restored == [0]
    pair.w0.broken.clear()
    pair.w1.broken.clear()
    pair.still_serving()


def test_a_verdict_of_death_overrides_unreachable_and_nothing_is_renewed(pair: Pair) -> None:
    pair.open()
    old = _lose(pair.w0, 1)
    pair.w0.tr._break(old, BrokenError("its process is gone"), final=True)
    assert [type(e) for _, e in pair.w0.broken] == [UnreachableError, BrokenError]
    assert not old.recoverable
    _back(pair.w0, old)  # a late word from the lifeline changes nothing
    pair.settle()
    assert _pipe(pair.w0, 1) is old and pair.w0.restored == []


def test_a_stale_hello_is_dropped_and_counted(pair: Pair) -> None:
    pair.open()
    _back(pair.w0, _lose(pair.w0, 1))
    pair.settle()
    counted = pair.w1.counted()
    stale = Pipe(1, "worker1", b"x")  # generation 0, as before the outage
    frame, _ = encode(FrameKind.HELLO, 0, handshake.hello(stale, 0), [], b"", pair.w1.tr.limits,
                      seal=False)
    pair.w1.tr._rx.on_frame(tags.kind_base(tags.HANDSHAKE, 0), frame)
    assert pair.w1.counted() == counted + 1
    assert _pipe(pair.w1, 0).gen == 1
    pair.w0.broken.clear()
    pair.w1.broken.clear()
    pair.still_serving()


def test_a_forged_hello_of_a_higher_generation_replaces_nothing(pair: Pair) -> None:
    pair.open()
    forger = Pipe(1, "worker1", b"x", gen=5)
    frame, _ = encode(FrameKind.HELLO, 0, handshake.hello(forger, 0), [], b"", pair.w1.tr.limits,
                      seal=False)
    pair.w1.tr._rx.on_frame(tags.kind_base(tags.HANDSHAKE, 0), frame)
    pair.settle()
    assert 0 in pair.w1.tr._handshake.tentative  # answered, kept aside
    assert _pipe(pair.w1, 0).gen == 0 and not pair.w1.broken
    pair.still_serving()


# --------------------------------------------- what an ended pipe leaves

def test_an_ended_pipe_leaves_no_receive_posted_and_delivers_nothing(pair: Pair) -> None:
    pair.open()
    _send_large(pair, pair.w1, 0)
    w0 = pair.w0.tr
    w0._poll_requests()
    posted = [req for req, owner in w0._watch if owner is not None and not req.done]
    assert len(posted) == 1  # the data's receive, waiting
    ep = _pipe(pair.w0, 1).ep
    _lose(pair.w0, 1)
    assert not ep.discarded
    w0._run_tasks()   # the abandon runs on the loop
    assert w0._worker.cancelled == posted
    # and the endpoint goes, by force: UCX then fails what no cancel reaches
    assert ep.discarded
    w0._poll_requests()
    assert not w0._watch, w0._watch
    assert (1, b"large") not in pair.w0.messages and not pair.w0.frame_errors
    assert w0.stats()["watched_requests"] == 0


def test_requests_ucx_ends_later_are_let_go_on_an_idle_turn(pair: Pair) -> None:
    """What an ended pipe still had in UCX (a send, a receive matched to a
    rendezvous: no cancel reaches them) is kept, with its buffer, until
    UCX ends it; an idle turn asks every PRUNE_EVERY_S, not every turn."""
    from tests.transport.fakenet import Request
    from ucxrpc.transport import engine

    pair.open()
    w0 = pair.w0.tr
    _lose(pair.w0, 1)
    w0._run_tasks()
    held = Request(done=False)
    w0._retired.append((held, torch.empty(8)))
    w0._next_prune = float("inf")      # not yet due
    assert not w0._turn() and w0.stats()["retired_requests"] == 1
    held.done = True                   # UCX ended it
    assert not w0._turn() and w0.stats()["retired_requests"] == 1  # not due: kept
    w0._next_prune = 0.0               # due
    assert not w0._turn() and w0.stats()["retired_requests"] == 0
    assert w0._next_prune > 0 and engine.PRUNE_EVERY_S == 1.0


def test_each_generation_tags_its_data_with_an_epoch_of_its_own(pair: Pair) -> None:
    pair.open()
    old = _pipe(pair.w0, 1)
    _back(pair.w0, _lose(pair.w0, 1))
    pair.settle()
    new = _pipe(pair.w0, 1)
    assert new.auth.in_epoch != old.auth.in_epoch
    assert new.auth.in_epoch == _pipe(pair.w1, 0).auth.out_epoch
    pair.w0.broken.clear()
    pair.w1.broken.clear()
    _send_large(pair, pair.w1, 0)
    (tag, _), = [(t, b) for t, b in pair.w0.tr._worker.posted if b.numel() == SEPARATE]
    assert (tag >> tags.EPOCH_SHIFT) & (tags.EPOCHS - 1) == new.auth.in_epoch


def test_unmatched_data_of_an_ended_pipe_is_drained(pair: Pair) -> None:
    """Data of the old pipe already waiting in UCX's unexpected queue goes,
    and only that: a buffer of the next generation stays."""
    from ucxrpc.transport.ucx.binding import Probe

    pair.open()
    old = _pipe(pair.w0, 1)
    worker = pair.w0.tr._worker
    stale = tags.data_tag(1, old.auth.in_epoch, 5, 0)
    other = tags.data_tag(1, (old.auth.in_epoch + 1) % tags.EPOCHS, 5, 0)
    worker.probes += [Probe(stale, 100, None), Probe(other, 100, None)]
    _lose(pair.w0, 1)
    pair.w0.tr._run_tasks()
    assert [p.sender_tag for p in worker.probes] == [other]


def test_a_peer_whose_tcp_fragments_differ_is_refused_naming_the_setting(pair: Pair) -> None:
    """UCX's TCP transport sizes fragments by the sender's UCX_TCP_RX_SEG_SIZE,
    and a receiver with a smaller one overruns its buffer: such a peer is
    never sent to (docs/ucx-notes.md, pitfall 20)."""
    from ucxrpc.errors import BrokenError
    from ucxrpc.transport.pipe import Peer as PeerRecord

    mine = pair.w0.tr.tcp_segment
    assert mine is not None
    pair.w0.tr.add_peer(PeerRecord(2, "worker2", b"elsewhere", tcp_segment=mine * 8))
    with pytest.raises(BrokenError, match=rf"UCX_TCP_RX_SEG_SIZE is {mine} bytes here and "
                                          rf"{mine * 8} on worker2"):
        pair.w0.tr.send(2, b"x", [])
    pair.w0.tr.add_peer(PeerRecord(3, "worker3", b"other", tcp_segment=mine))
    assert _pipe(pair.w0, 3).out.state is OutState.NEW  # the same size: an ordinary pipe
