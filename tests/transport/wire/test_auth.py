"""The handshake's messages and keys (ucxrpc/transport/wire/auth.py): the job
secret accepted, others and replays refused."""

from __future__ import annotations

import pytest

from ucxrpc.errors import AuthenticationError, FrameError
from ucxrpc.transport.wire import auth


def test_handshake_accepts_the_secret_and_refuses_others():
    secret = b"job-secret"
    nx = auth.new_nonce()
    x, y, gen = auth.parse_hello(memoryview(auth.hello(3, nx, 9)))
    assert x == 3 and y == nx and gen == 9
    ny = auth.new_nonce()
    ch = auth.challenge(secret, 3, 5, nx, ny)
    assert auth.check_challenge(secret, memoryview(ch), 3, 5, nx) == ny
    with pytest.raises(AuthenticationError, match="wrong job secret"):
        auth.check_challenge(b"other", memoryview(ch), 3, 5, nx)
    with pytest.raises(FrameError, match="did not send"):
        auth.check_challenge(secret, memoryview(ch), 3, 5, auth.new_nonce())
    pr = auth.proof(secret, 3, 5, nx, ny)
    auth.check_proof(secret, memoryview(pr), 3, 5, nx, ny)
    # a replayed proof does not fit a fresh challenge nonce
    with pytest.raises(AuthenticationError, match="replayed"):
        auth.check_proof(secret, memoryview(pr), 3, 5, nx, auth.new_nonce())
    with pytest.raises(FrameError, match="PROOF of 3 bytes"):
        auth.check_proof(secret, memoryview(b"abc"), 3, 5, nx, ny)
    assert auth.session_key(secret, 3, 5, nx, ny) != auth.session_key(secret, 5, 3, nx, ny)


def test_every_mac_binds_the_generation():
    secret, nx, ny = b"job-secret", auth.new_nonce(), auth.new_nonce()
    ch = auth.challenge(secret, 3, 5, nx, ny, 2)
    assert auth.check_challenge(secret, memoryview(ch), 3, 5, nx, 2) == ny
    with pytest.raises(AuthenticationError):
        auth.check_challenge(secret, memoryview(ch), 3, 5, nx, 1)
    pr = auth.proof(secret, 3, 5, nx, ny, 2)
    assert auth.proof_matches(secret, memoryview(pr), 3, 5, nx, ny, 2)
    assert not auth.proof_matches(secret, memoryview(pr), 3, 5, nx, ny, 3)
    assert auth.session_key(secret, 3, 5, nx, ny, 2) != auth.session_key(secret, 3, 5, nx, ny, 3)
    assert auth.epoch_of(ny) == ny[0]
