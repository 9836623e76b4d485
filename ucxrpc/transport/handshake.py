"""The handshake: what each frame changes on a pipe, what goes back, and
the pipe opening once our direction is proved.

:mod:`.wire.auth` defines the messages and their MACs; this module keeps the
per-pipe protocol state on :class:`.pipe.Pipe`:

* our direction: :func:`hello` starts it (HELLO_SENT), :func:`prove`
  answers the peer's CHALLENGE and returns the session key that opens it;
* the peer's direction: :func:`challenge` answers a HELLO (remembering a
  few nonces, so a forged HELLO cannot spoil a genuine one in progress),
  :func:`accept` checks the PROOF and authenticates the pipe.

Every check that fails raises :class:`AuthenticationError` naming the peer.
These steps are pure; :class:`Handshake` sends what they return, and opens
a pipe (its backlog then goes) when our direction is proved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import AuthenticationError, FrameError
from .wire import auth
from .wire.frame import Frame, Kind, Limits, encode
from .pipe import OutState, Pipe
from .send import Sender
from .wire.tags import HANDSHAKE, kind_base
from .ucx.binding import Endpoint, Request

__all__ = ["Handshake", "accept", "challenge", "hello", "prove"]

logger = logging.getLogger(__name__)

#: Handshakes answered and not yet proved, per pipe.
PENDING = 8


def hello(pipe: Pipe, my_id: int) -> bytes:
    """Our HELLO's payload, with a fresh nonce kept for the CHALLENGE."""
    pipe.auth.out_nonce = auth.new_nonce()
    return auth.hello(my_id, pipe.auth.out_nonce)


def challenge(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> bytes:
    """The CHALLENGE answering a HELLO that arrived on ``pipe``'s tag."""
    x = pipe.peer_id
    claimed, nx = auth.parse_hello(payload)
    if claimed != x:
        raise AuthenticationError(f"HELLO claims worker {claimed} on worker {x}'s tag")
    ny = auth.new_nonce()
    pipe.auth.in_nonces[ny] = nx
    if len(pipe.auth.in_nonces) > PENDING:
        del pipe.auth.in_nonces[next(iter(pipe.auth.in_nonces))]
    return auth.challenge(secret, x, my_id, nx, ny)


def prove(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> tuple[bytes, bytes]:
    """Our PROOF for the peer's CHALLENGE, and the key our frames carry."""
    if pipe.out.state is not OutState.HELLO_SENT:
        raise AuthenticationError(f"unexpected CHALLENGE from {pipe.name}")
    x, y, nx = my_id, pipe.peer_id, pipe.auth.out_nonce
    ny = auth.check_challenge(secret, payload, x, y, nx)
    return auth.proof(secret, x, y, nx, ny), auth.session_key(secret, x, y, nx, ny)


def accept(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> None:
    """Check the peer's PROOF; its frames are then checked with the key."""
    if not pipe.auth.in_nonces:
        raise AuthenticationError(f"PROOF without HELLO from a peer claiming to be {pipe.name}")
    x, y = pipe.peer_id, my_id
    for ny, nx in reversed(pipe.auth.in_nonces.items()):
        if auth.proof_matches(secret, payload, x, y, nx, ny):
            break
    else:
        raise AuthenticationError(f"a peer claiming to be {pipe.name} failed authentication "
                                  "(wrong job secret or replayed handshake)")
    pipe.auth.in_nonces.clear()
    pipe.auth.in_key = auth.session_key(secret, x, y, nx, ny)
    pipe.inbound.seq = 0
    pipe.cma.read_through = pipe.cma.ack_sent = 0  # they count the peer's frames, which start again


class Handshake:
    """Runs the handshake on one transport's pipes.

    Args:
        my_id, secret, limits: this worker's.
        sender: sends a pipe's backlog once the pipe opens.
        endpoint: the pipe's endpoint, made on first use.
        watch: where a handshake frame's send goes for the loop to watch.
        fail: ``(pipe, error)`` breaks a pipe.
        accepted: ``(pipe)`` once the peer's direction authenticated.
    """

    def __init__(self, *, my_id: int, secret: bytes, limits: Limits, sender: Sender,
                 endpoint: Callable[[Pipe], Endpoint], watch: list[tuple[Request, object]],
                 fail: Callable[[Pipe, BaseException], None],
                 accepted: Callable[[Pipe], None]) -> None:
        self._my_id = my_id
        self._secret = secret
        self._limits = limits
        self._sender = sender
        self._endpoint = endpoint
        self._watch = watch
        self._fail = fail
        self._accepted = accepted
        self._tag = kind_base(HANDSHAKE, my_id)

    def start(self, pipe: Pipe) -> None:
        """Send our HELLO (the pipe is HELLO_SENT already)."""
        self._send(pipe, Kind.HELLO, hello(pipe, self._my_id))

    def on_frame(self, pipe: Pipe, frame: Frame) -> None:
        """A handshake frame from ``pipe``'s peer.

        Raises:
            AuthenticationError: it proves nothing (the receiver counts it).
            FrameError: it is no handshake frame.
        """
        try:
            self._step(pipe, frame)
        except AuthenticationError as exc:
            # Our HELLO was answered by something that cannot prove the
            # secret: nothing we queued for this peer can ever go.
            if pipe.out.state is OutState.HELLO_SENT:
                self._fail(pipe, exc)
            raise

    def _step(self, pipe: Pipe, frame: Frame) -> None:
        if frame.kind is Kind.HELLO:
            self._send(pipe, Kind.CHALLENGE, challenge(pipe, frame.payload, self._secret,
                                                       self._my_id))
        elif frame.kind is Kind.CHALLENGE:
            proof, key = prove(pipe, frame.payload, self._secret, self._my_id)
            self._send(pipe, Kind.PROOF, proof)  # before the backlog
            self._open(pipe, key)
        elif frame.kind is Kind.PROOF:
            accept(pipe, frame.payload, self._secret, self._my_id)
            logger.debug("pipe from %s authenticated", pipe.name)
            self._accepted(pipe)
        else:
            raise FrameError(f"a {frame.kind.name} frame on the handshake tag")

    def _send(self, pipe: Pipe, kind: Kind, payload: bytes) -> None:
        frame, _ = encode(kind, 0, payload, [], b"", self._limits)
        req = self._endpoint(pipe).tag_send(frame, self._tag)
        self._watch.append((req, pipe))

    def _open(self, pipe: Pipe, key: bytes) -> None:
        """Our direction is authenticated: send what waited for it."""
        with pipe.lock:
            if pipe.closed:  # broken meanwhile: what waited was failed with it
                return
            pipe.auth.out_key = key
            pipe.move_to(OutState.OPEN)
            backlog, pipe.out.backlog = pipe.out.backlog, []
            for payload, buffers, kind, hint, devices in backlog:
                try:
                    self._sender.send(pipe, payload, buffers, kind, hint, devices)
                except FrameError as exc:
                    logger.error("message to %s not sent: %s", pipe.name, exc)
        logger.debug("pipe to %s open", pipe.name)
