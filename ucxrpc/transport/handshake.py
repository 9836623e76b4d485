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

Generations (:mod:`.wire.auth`, ``gen``).  A pipe broken while the peer's
process lives on is replaced by the next generation once the peer answers
again (engine.py).  The peer learns of it from our HELLO, whose generation
is higher than its pipe's; only once the PROOF has proved that HELLO does it
act on it: it ends its own pipe (everything in flight on it is failed: what
we had of it is gone) and takes up the new generation.  Its answers to such
a HELLO go out on the new generation's pipe, made for the purpose and kept
aside (``tentative``) until the PROOF comes, so a forged HELLO costs nothing
but an unused endpoint.  A HELLO of a lower generation than the pipe's is
left over from before: dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from ..errors import AuthenticationError, FrameError
from .wire import auth
from .wire.frame import Frame, FrameKind, Limits, encode
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
    return auth.hello(my_id, pipe.auth.out_nonce, pipe.gen)


def challenge(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int,
              avoid: Collection[int] = ()) -> bytes:
    """The CHALLENGE answering a HELLO that arrived on ``pipe``'s tag; its
    nonce names an epoch not in ``avoid`` (the peer's recent ones)."""
    x = pipe.peer_id
    claimed, nx, gen = auth.parse_hello(payload)
    if claimed != x:
        raise AuthenticationError(f"HELLO claims worker {claimed} on worker {x}'s tag")
    ny = auth.new_nonce()
    while auth.epoch_of(ny) in avoid:
        ny = auth.new_nonce()
    pipe.auth.in_nonces[ny] = (nx, gen)
    if len(pipe.auth.in_nonces) > PENDING:
        del pipe.auth.in_nonces[next(iter(pipe.auth.in_nonces))]
    return auth.challenge(secret, x, my_id, nx, ny, gen)


def prove(pipe: Pipe, payload: memoryview, secret: bytes,
          my_id: int) -> tuple[bytes, bytes, int]:
    """Our PROOF for the peer's CHALLENGE, the key our frames carry, and the
    epoch our data tags carry."""
    if pipe.out.state is not OutState.HELLO_SENT:
        raise AuthenticationError(f"unexpected CHALLENGE from {pipe.name}")
    x, y, nx, gen = my_id, pipe.peer_id, pipe.auth.out_nonce, pipe.gen
    ny = auth.check_challenge(secret, payload, x, y, nx, gen)
    return (auth.proof(secret, x, y, nx, ny, gen), auth.session_key(secret, x, y, nx, ny, gen),
            auth.epoch_of(ny))


def accept(pipe: Pipe, payload: memoryview, secret: bytes, my_id: int) -> int:
    """Check the peer's PROOF; its frames are then checked with the key, and
    its data tags carry the epoch our CHALLENGE named.  Returns the
    generation the PROOF proved."""
    if not pipe.auth.in_nonces:
        raise AuthenticationError(f"PROOF without HELLO from a peer claiming to be {pipe.name}")
    x, y = pipe.peer_id, my_id
    for ny, (nx, gen) in reversed(pipe.auth.in_nonces.items()):
        if auth.proof_matches(secret, payload, x, y, nx, ny, gen):
            break
    else:
        raise AuthenticationError(f"a peer claiming to be {pipe.name} failed authentication "
                                  "(wrong job secret or replayed handshake)")
    pipe.auth.in_nonces.clear()
    pipe.auth.in_key = auth.session_key(secret, x, y, nx, ny, gen)
    pipe.auth.in_epoch = auth.epoch_of(ny)
    pipe.inbound.seq = 0
    pipe.cma.read_through = pipe.cma.ack_sent = 0  # they count the peer's frames, which start again
    return gen


class Handshake:
    """Runs the handshake on one transport's pipes.

    Args:
        my_id, secret, limits: this worker's.
        sender: sends a pipe's backlog once the pipe opens.
        endpoint: the pipe's endpoint, made on first use.
        watch: where a handshake frame's send goes for the loop to watch.
        fail: ``(pipe, error)`` breaks a pipe.
        accepted: ``(pipe)`` once the peer's direction authenticated.
        opened: ``(pipe)`` once our direction is (after its backlog went).
        successor: ``(pipe, gen)`` → a pipe of generation ``gen`` to
            ``pipe``'s peer, made but not installed.
        install: ``(old, new)`` puts ``new`` in ``old``'s place (on the
            loop): ``old`` ends, and ``new`` starts its own HELLO.
        epochs: ``(peer id)`` → the epochs its data came with lately, which
            a new CHALLENGE must not name again.
    """

    def __init__(self, *, my_id: int, secret: bytes, limits: Limits, sender: Sender,
                 endpoint: Callable[[Pipe], Endpoint], watch: list[tuple[Request, object]],
                 fail: Callable[[Pipe, BaseException], None],
                 accepted: Callable[[Pipe], None],
                 opened: Callable[[Pipe], None] = lambda pipe: None,
                 successor: Callable[[Pipe, int], Pipe] | None = None,
                 install: Callable[[Pipe, Pipe], None] | None = None,
                 epochs: Callable[[int], Collection[int]] = lambda peer: ()) -> None:
        self._my_id = my_id
        self._secret = secret
        self._limits = limits
        self._sender = sender
        self._endpoint = endpoint
        self._watch = watch
        self._fail = fail
        self._accepted = accepted
        self._opened = opened
        self._successor = successor
        self._install = install
        self._epochs = epochs
        self._tag = kind_base(HANDSHAKE, my_id)
        #: By peer id: the next generation's pipe that answered a HELLO,
        #: installed only once a PROOF proves it (the loop's).
        self.tentative: dict[int, Pipe] = {}

    def start(self, pipe: Pipe) -> None:
        """Send our HELLO (the pipe is HELLO_SENT already)."""
        self._send(pipe, FrameKind.HELLO, hello(pipe, self._my_id))

    def take_tentative(self, peer_id: int, above: int) -> Pipe | None:
        """The pipe made to answer ``peer_id``'s HELLO of a generation above
        ``above``, handed over (the transport installs it as its own next
        generation, so the handshake it answered goes on), or None."""
        pipe = self.tentative.get(peer_id)
        if pipe is None or pipe.gen <= above:
            return None
        del self.tentative[peer_id]
        return pipe

    def forget(self, peer_id: int) -> None:
        """``peer_id`` joined again elsewhere, or the transport closes."""
        self.tentative.pop(peer_id, None)

    def on_frame(self, pipe: Pipe, frame: Frame) -> None:
        """A handshake frame from ``pipe``'s peer (``pipe``: the current one).

        Raises:
            AuthenticationError: it proves nothing (the receiver counts it).
            FrameError: it is no handshake frame, or a stale one.
        """
        try:
            self._step(pipe, frame)
        except AuthenticationError as exc:
            # Our HELLO was answered by something that cannot prove the
            # secret: nothing we queued for this peer can ever go.  (A PROOF
            # that proves nothing says nothing of our direction.)
            if frame.kind is FrameKind.CHALLENGE and pipe.out.state is OutState.HELLO_SENT:
                self._fail(pipe, exc)
            raise

    def _step(self, pipe: Pipe, frame: Frame) -> None:
        if frame.kind is FrameKind.HELLO:
            _, _, gen = auth.parse_hello(frame.payload)
            target = self._responder(pipe, gen)
            self._send(target, FrameKind.CHALLENGE,
                       challenge(target, frame.payload, self._secret, self._my_id,
                                 self._epochs(pipe.peer_id)))
        elif frame.kind is FrameKind.CHALLENGE:
            proof, key, epoch = prove(pipe, frame.payload, self._secret, self._my_id)
            self._send(pipe, FrameKind.PROOF, proof)  # before the backlog
            self._open(pipe, key, epoch)
        elif frame.kind is FrameKind.PROOF:
            self._proof(pipe, frame)
        else:
            raise FrameError(f"a {frame.kind.name} frame on the handshake tag")

    def _responder(self, pipe: Pipe, gen: int) -> Pipe:
        """The pipe to answer a HELLO of generation ``gen`` on: the current
        one, or the next generation's (a higher ``gen``, or ours broken
        while the peer lives: its answers could not go out on it).

        Raises:
            FrameError: the HELLO is stale, or the pipe is over for good.
        """
        if gen < pipe.gen:
            raise FrameError(f"a HELLO of generation {gen} from {pipe.name}, whose pipe is of "
                             f"generation {pipe.gen}: left over from before")
        broken = pipe.out.state is OutState.BROKEN
        if gen == pipe.gen and not pipe.closed:
            return pipe
        if pipe.out.state is OutState.CLOSED or (broken and not pipe.recoverable) \
                or self._successor is None:
            raise FrameError(f"a HELLO from {pipe.name}, whose pipe is {pipe.out.state.value}: "
                             f"not answered ({pipe.error})")
        # Ours broke while the peer lives: the next generation is ours too,
        # so that the peer learns we lost what was in flight.
        want = max(gen, pipe.gen + 1) if broken else gen
        nxt = self.tentative.get(pipe.peer_id)
        if nxt is None or nxt.gen != want:
            nxt = self.tentative[pipe.peer_id] = self._successor(pipe, want)
        return nxt

    def _proof(self, pipe: Pipe, frame: Frame) -> None:
        nxt = self.tentative.get(pipe.peer_id)
        if nxt is not None and nxt.auth.in_nonces:
            try:
                accept(nxt, frame.payload, self._secret, self._my_id)
            except AuthenticationError:
                pass  # not for the next generation: maybe for the current one
            else:
                del self.tentative[pipe.peer_id]
                logger.info("%s re-established its pipe (generation %d): taking it up",
                            pipe.name, nxt.gen)
                assert self._install is not None  # a successor exists only with it
                self._install(pipe, nxt)
                self._accepted(nxt)
                return
        accept(pipe, frame.payload, self._secret, self._my_id)
        logger.debug("pipe from %s authenticated", pipe.name)
        self._accepted(pipe)

    def _send(self, pipe: Pipe, kind: FrameKind, payload: bytes) -> None:
        # Unsealed: no key exists yet, and the receiver checks a handshake
        # by its contents (auth.py), never by a MAC.
        frame, _ = encode(kind, 0, payload, [], b"", self._limits, seal=False)
        req = self._endpoint(pipe).tag_send(frame, self._tag)
        self._watch.append((req, pipe))

    def _open(self, pipe: Pipe, key: bytes, epoch: int) -> None:
        """Our direction is authenticated: send what waited for it."""
        with pipe.lock:
            if pipe.closed:  # broken meanwhile: what waited was failed with it
                return
            pipe.auth.out_key = key
            pipe.auth.out_epoch = epoch
            pipe.move_to(OutState.OPEN)
            backlog, pipe.out.backlog = pipe.out.backlog, []
            for payload, buffers, kind, hint, devices in backlog:
                try:
                    self._sender.send(pipe, payload, buffers, kind, hint, devices)
                except FrameError as exc:
                    logger.error("message to %s not sent: %s", pipe.name, exc)
        logger.debug("pipe to %s open", pipe.name)
        self._opened(pipe)
