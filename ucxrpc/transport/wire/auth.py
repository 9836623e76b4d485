"""Pipe authentication: a challenge-response over the job secret.

Each direction of a pipe (initiator X sending to responder Y) is
authenticated on its own::

    X -> Y  HELLO      x_id, nonce_x, gen
    Y -> X  CHALLENGE  y_id, nonce_x, nonce_y, HMAC(secret, "resp"|x|y|gen|nx|ny)
    X -> Y  PROOF      HMAC(secret, "init"|x|y|gen|nx|ny)

Both sides then MAC every frame of that direction with the first 16 bytes
of ``HMAC(secret, "key"|x|y|gen|nx|ny)`` (the frame MAC's key:
:data:`.frame.KEY_LEN`).  Fresh nonces on both sides make a
replayed handshake useless; the worker id inside the tag is only a claim
until a frame's MAC proves it.  Handshake payloads are fixed-size structs,
never pickles.

``gen`` is the *generation* of X's pipe to Y: 0 for the first, one more
each time X re-established it after an outage.  Bound into every MAC, it is
proved by the PROOF, and only then acted on: a peer whose generation went
up lost everything in flight on the pipe before (handshake.py).  The
responder's nonce also names the direction's *epoch*, which data tags carry
(:func:`epoch_of`, :mod:`.tags`): the responder draws it, so the side that
posts the receives is the one that keeps epochs apart.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from ...errors import AuthenticationError, FrameError
from .frame import KEY_LEN

NONCE_LEN = 32
_HELLO = struct.Struct(f"<I{NONCE_LEN}sI")
#: The highest generation a HELLO can carry.
MAX_GEN = (1 << 32) - 1
_CHALLENGE = struct.Struct(f"<I{NONCE_LEN}s{NONCE_LEN}s32s")
_PROOF = struct.Struct("<32s")


def new_nonce() -> bytes:
    return os.urandom(NONCE_LEN)


def _mac(secret: bytes, label: bytes, x: int, y: int, gen: int, nx: bytes, ny: bytes) -> bytes:
    msg = label + struct.pack("<III", x, y, gen) + nx + ny
    return hmac.new(secret, msg, hashlib.sha256).digest()


def epoch_of(ny: bytes) -> int:
    """The epoch a direction's data tags carry, named by the responder's
    nonce (which the responder draws so that it differs from its recent
    ones with that peer)."""
    return ny[0]


def hello(x: int, nx: bytes, gen: int = 0) -> bytes:
    return _HELLO.pack(x, nx, gen)


def parse_hello(payload: memoryview) -> tuple[int, bytes, int]:
    """(claimed worker id, nonce, generation) of a HELLO.

    Raises:
        FrameError: not a HELLO's size.
    """
    if payload.nbytes != _HELLO.size:
        raise FrameError(f"HELLO of {payload.nbytes} bytes; expected {_HELLO.size}")
    x, nx, gen = _HELLO.unpack(payload)
    return x, nx, gen


def challenge(secret: bytes, x: int, y: int, nx: bytes, ny: bytes, gen: int = 0) -> bytes:
    return _CHALLENGE.pack(y, nx, ny, _mac(secret, b"resp", x, y, gen, nx, ny))


def check_challenge(secret: bytes, payload: memoryview, x: int, y: int,
                    nx: bytes, gen: int = 0) -> bytes:
    """Verify the responder's proof; returns its nonce.

    Raises:
        AuthenticationError: the responder answered our HELLO but does not
            know the job secret.
        FrameError: malformed, or not an answer to our HELLO.
    """
    if payload.nbytes != _CHALLENGE.size:
        raise FrameError(f"CHALLENGE of {payload.nbytes} bytes; expected {_CHALLENGE.size}")
    py, pnx, ny, proof = _CHALLENGE.unpack(payload)
    if py != y or not hmac.compare_digest(pnx, nx):
        # Not an answer to our HELLO (a stray or forged frame): dropped, so
        # that nobody can break a pipe by sending one.
        raise FrameError(f"a CHALLENGE claiming to be from worker {y} answers a HELLO we "
                         "did not send")
    if not hmac.compare_digest(proof, _mac(secret, b"resp", x, y, gen, nx, ny)):
        raise AuthenticationError(f"worker {y} failed authentication (wrong job secret?)")
    return ny


def proof(secret: bytes, x: int, y: int, nx: bytes, ny: bytes, gen: int = 0) -> bytes:
    return _PROOF.pack(_mac(secret, b"init", x, y, gen, nx, ny))


def check_proof(secret: bytes, payload: memoryview, x: int, y: int,
                nx: bytes, ny: bytes, gen: int = 0) -> None:
    """Raises AuthenticationError unless the initiator knows the job secret."""
    if not proof_matches(secret, payload, x, y, nx, ny, gen):
        raise AuthenticationError(f"a peer claiming to be worker {x} failed "
                                  "authentication (wrong job secret or replayed handshake)")


def proof_matches(secret: bytes, payload: memoryview, x: int, y: int,
                  nx: bytes, ny: bytes, gen: int = 0) -> bool:
    """Whether ``payload`` proves the secret for the handshake ``(nx, ny)``
    of generation ``gen``.

    Raises:
        FrameError: not a PROOF's size.
    """
    if payload.nbytes != _PROOF.size:
        raise FrameError(f"PROOF of {payload.nbytes} bytes; expected {_PROOF.size}")
    return hmac.compare_digest(bytes(payload), _mac(secret, b"init", x, y, gen, nx, ny))


def session_key(secret: bytes, x: int, y: int, nx: bytes, ny: bytes, gen: int = 0) -> bytes:
    """The frame MAC's key for direction x -> y: HMAC-SHA256's output cut to
    the 16 bytes SipHash takes (a cut of a pseudorandom output is one)."""
    return _mac(secret, b"key", x, y, gen, nx, ny)[:KEY_LEN]
