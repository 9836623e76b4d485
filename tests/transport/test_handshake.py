"""The handshake's per-pipe steps (ucxrpc/transport/handshake.py), between
two in-memory pipes: worker 1 opens its direction to worker 2.

The wire and UCX are not involved here (tests/rpc/test_faults.py and the
fuzz tests drive the same steps over real pipes); this checks the state
each step leaves on the pipe and every refusal.
"""

from __future__ import annotations

import pytest

from ucxrpc.errors import AuthenticationError
from ucxrpc.transport import handshake
from ucxrpc.transport.pipe import OutState, Pipe

SECRET = b"s" * 32


def _pipes() -> tuple[Pipe, Pipe]:
    """Worker 1's pipe to worker 2, and worker 2's pipe from worker 1."""
    out = Pipe(2, "worker2", b"addr2")
    inc = Pipe(1, "worker1", b"addr1")
    out.move_to(OutState.HELLO_SENT)  # as the engine does when it sends HELLO
    return out, inc


def _open(out: Pipe, inc: Pipe, secret_1: bytes = SECRET, secret_2: bytes = SECRET) -> bytes:
    chal = handshake.challenge(inc, memoryview(handshake.hello(out, 1)), secret_2, 2)
    proof, key, epoch = handshake.prove(out, memoryview(chal), secret_1, 1)
    assert handshake.accept(inc, memoryview(proof), secret_2, 2) == out.gen
    assert epoch == inc.auth.in_epoch  # both ends tag the direction's data alike
    return key


def test_a_full_handshake_gives_both_ends_one_key():
    out, inc = _pipes()
    inc.inbound.seq = 7  # left from an earlier incarnation: restarts
    key = _open(out, inc)
    assert key == inc.auth.in_key and len(key) == 16  # the frame MAC's key (frame.KEY_LEN)
    assert inc.auth.in_nonces == {} and inc.inbound.seq == 0
    # Fresh nonces: a second handshake gives another key.
    out2, inc2 = _pipes()
    assert _open(out2, inc2) != key


def test_a_wrong_secret_is_refused_on_both_sides():
    # Either side's secret differing: the initiator finds the responder's
    # CHALLENGE unproved.
    for secrets in ((SECRET, b"other" * 8), (b"other" * 8, SECRET)):
        out, inc = _pipes()
        with pytest.raises(AuthenticationError, match="worker 2 failed authentication"):
            _open(out, inc, *secrets)
        assert out.auth.out_key == b"" and inc.auth.in_key is None
    # A PROOF that proves nothing (made without the secret).
    out, inc = _pipes()
    handshake.challenge(inc, memoryview(handshake.hello(out, 1)), SECRET, 2)
    with pytest.raises(AuthenticationError, match="worker1 failed authentication"):
        handshake.accept(inc, memoryview(b"p" * 32), SECRET, 2)
    assert inc.auth.in_key is None


def test_refusals_name_what_was_wrong():
    out, inc = _pipes()
    with pytest.raises(AuthenticationError, match="HELLO claims worker 3 on worker 1's tag"):
        handshake.challenge(inc, memoryview(handshake.hello(out, 3)), SECRET, 2)
    with pytest.raises(AuthenticationError, match="PROOF without HELLO"):
        handshake.accept(inc, memoryview(b"p" * 32), SECRET, 2)
    out.move_to(OutState.OPEN)
    with pytest.raises(AuthenticationError, match="unexpected CHALLENGE from worker2"):
        handshake.prove(out, memoryview(b"c" * 100), SECRET, 1)


def test_forged_hellos_do_not_spoil_a_genuine_handshake_and_proofs_do_not_replay():
    out, inc = _pipes()
    chal = handshake.challenge(inc, memoryview(handshake.hello(out, 1)), SECRET, 2)
    forger = Pipe(2, "worker2", b"addr2")
    for _ in range(handshake.PENDING - 1):  # a forger's HELLOs under worker 1's id
        handshake.challenge(inc, memoryview(handshake.hello(forger, 1)), SECRET, 2)
    proof, key, _ = handshake.prove(out, memoryview(chal), SECRET, 1)
    handshake.accept(inc, memoryview(proof), SECRET, 2)
    assert inc.auth.in_key == key
    with pytest.raises(AuthenticationError, match="PROOF without HELLO"):
        handshake.accept(inc, memoryview(proof), SECRET, 2)  # replayed


def test_the_generation_is_proved_and_bound_into_the_key():
    out, inc = _pipes()
    out.gen = 3
    chal = handshake.challenge(inc, memoryview(handshake.hello(out, 1)), SECRET, 2)
    proof, key, _ = handshake.prove(out, memoryview(chal), SECRET, 1)
    assert handshake.accept(inc, memoryview(proof), SECRET, 2) == 3
    assert inc.auth.in_key == key
    # The same nonces under another generation give another key: a HELLO's
    # generation cannot be changed on the way without failing every MAC.
    out2, inc2 = _pipes()
    hello = bytearray(handshake.hello(out2, 1))
    hello[-4:] = (7).to_bytes(4, "little")  # forged generation
    chal = handshake.challenge(inc2, memoryview(bytes(hello)), SECRET, 2)
    with pytest.raises(AuthenticationError, match="worker 2 failed authentication"):
        handshake.prove(out2, memoryview(chal), SECRET, 1)  # out2 said generation 0


def test_the_responder_names_an_epoch_unlike_the_recent_ones():
    avoid = set(range(256)) - {42}
    for _ in range(5):
        out, inc = _pipes()
        chal = handshake.challenge(inc, memoryview(handshake.hello(out, 1)), SECRET, 2, avoid)
        proof, _, epoch = handshake.prove(out, memoryview(chal), SECRET, 1)
        handshake.accept(inc, memoryview(proof), SECRET, 2)
        assert epoch == inc.auth.in_epoch == 42
