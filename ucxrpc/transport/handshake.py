"""The handshake's steps on one pipe: what each frame changes, what goes back.

:mod:`.auth` defines the messages and their MACs; this module keeps the
per-pipe protocol state on :class:`.pipe.Pipe`:

* our direction: :func:`hello` starts it (HELLO_SENT), :func:`prove`
  answers the peer's CHALLENGE and returns the session key that opens it;
* the peer's direction: :func:`challenge` answers a HELLO (remembering a
  few nonces, so a forged HELLO cannot spoil a genuine one in progress),
  :func:`accept` checks the PROOF and authenticates the pipe.

Every check that fails raises :class:`AuthenticationError` naming the peer;
nothing here sends or receives (the engine does).
"""

from __future__ import annotations

from ..errors import AuthenticationError
from . import auth
from .pipe import OutState, Pipe

__all__ = ["accept", "challenge", "hello", "prove"]

#: Handshakes answered and not yet proved, per pipe.
PENDING = 8


def hello(pipe: Pipe, my_id: int) -> bytes:
    """Our HELLO's payload, with a fresh nonce kept for the CHALLENGE."""
    pipe.out_nonce = auth.new_nonce()
    return auth.hello(my_id, pipe.out_nonce)


def challenge(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> bytes:
    """The CHALLENGE answering a HELLO that arrived on ``pipe``'s tag."""
    x = pipe.peer_id
    claimed, nx = auth.parse_hello(payload)
    if claimed != x:
        raise AuthenticationError(f"HELLO claims worker {claimed} on worker {x}'s tag")
    ny = auth.new_nonce()
    pipe.in_nonces[ny] = nx
    if len(pipe.in_nonces) > PENDING:
        del pipe.in_nonces[next(iter(pipe.in_nonces))]
    return auth.challenge(secret, x, my_id, nx, ny)


def prove(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> tuple[bytes, bytes]:
    """Our PROOF for the peer's CHALLENGE, and the key our frames carry."""
    if pipe.out_state is not OutState.HELLO_SENT:
        raise AuthenticationError(f"unexpected CHALLENGE from {pipe.name}")
    x, y, nx = my_id, pipe.peer_id, pipe.out_nonce
    ny = auth.check_challenge(secret, payload, x, y, nx)
    return auth.proof(secret, x, y, nx, ny), auth.session_key(secret, x, y, nx, ny)


def accept(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> None:
    """Check the peer's PROOF; its frames are then checked with the key."""
    if not pipe.in_nonces:
        raise AuthenticationError(f"PROOF without HELLO from a peer claiming to be {pipe.name}")
    x, y = pipe.peer_id, my_id
    for ny, nx in reversed(pipe.in_nonces.items()):
        if auth.proof_matches(secret, payload, x, y, nx, ny):
            break
    else:
        raise AuthenticationError(f"a peer claiming to be {pipe.name} failed authentication "
                                  "(wrong job secret or replayed handshake)")
    pipe.in_nonces.clear()
    pipe.in_key = auth.session_key(secret, x, y, nx, ny)
    pipe.in_seq = 0
