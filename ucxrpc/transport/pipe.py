"""A pipe: both directions to one peer, and a message being received.

A pipe's fields are grouped into records, each owned by the module that
changes it, and each used either under ``Pipe.lock`` (anything a sending
thread reaches) or by the thread turning the progress loop only (the
progress thread, or a caller driving it; never two at once):

==================  =============================  =====================================
record              owner                          guarded by
==================  =============================  =====================================
``pipe.out``        send.py (and engine.py)        ``lock``; ``state`` moves through
                                                   :meth:`Pipe.move_to` only
``pipe.auth``       handshake.py                   ``lock`` for ``out_key``; the loop
                                                   for the incoming side
``pipe.inbound``    receive.py                     the loop
``pipe.cma``        by_address.py (hostmem/cma)    ``lock`` for what senders read;
                                                   the loop writes
``pipe.grants``     grants.py                      ``lock``
==================  =============================  =====================================

The outgoing side is a small state machine (:class:`OutState`): NEW until
first used, HELLO_SENT while our handshake is answered, OPEN once the peer
proved it holds the job secret, BROKEN when the peer or network failed (the
error is kept and raised for every later send), CLOSED when we closed it
(or a new incarnation of the peer replaced this pipe).  :data:`_OUT_MOVES`
lists the moves.  The incoming side is authenticated once ``auth.in_key``
is set.

A pipe object is one *generation* of the relationship with one process of
the peer (``gen``, carried in the handshake: wire/auth.py).  BROKEN is
final for the object; where the peer's process lives on (its host went
silent, or UCX failed while its lifeline held: ``recoverable``), the
transport replaces the object by the next generation once the peer answers
again, and nothing of the old one (keys, sequence numbers, data tags'
epoch, requests in flight) carries over (engine.py, handshake.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .._states import StateEnum
from .hostmem import cma
from .wire.frame import Frame, FrameKind
from .wire.gather import Buffer
from .ucx.binding import Endpoint, Request

__all__ = ["Auth", "BadMove", "ByAddressState", "CudaPath", "Inbound", "Incoming", "Lending", "Out",
           "OutState", "Peer", "Piece", "Pipe", "Shared", "cuda_path"]


class CudaPath(StateEnum):
    """How a pipe moves CUDA tensors, as ``pipe_info`` reports it."""

    #: UCX copies device to device itself: a ``cuda_ipc`` lane (CUDA IPC,
    #: NVLink) between processes of one host.
    GPU_DIRECT = "gpu-direct"
    #: Both sides' UCX takes device memory, but the endpoint has no
    #: ``cuda_ipc`` lane: UCX moves it through its own bounce buffers
    #: (cuda_copy pipelines over sm or tcp; or GPUDirect RDMA, where an RDMA
    #: NIC registers device memory, which the lanes cannot show).  Memory
    #: that CUDA IPC cannot export goes through buffers that it can
    #: (bounce.py), as UCX would otherwise fall back, slowly, on that lane.
    UCX_STAGED = "ucx-staged"
    #: ucxrpc stages device memory through pinned host chunks itself: one
    #: side's UCX has no CUDA support, one side's torch allocator makes
    #: memory CUDA IPC cannot share and CuPy, which bounce.py needs for
    #: memory that can be, is missing there, or the host-as-device debug
    #: switch.
    STAGED = "staged"


def cuda_path(direct: bool, transports: set[str]) -> CudaPath:
    """The path of a pipe whose sides' UCX both take device memory
    (``direct``), from the transports its endpoint really uses: what UCX
    loaded says nothing of what it chose for this peer."""
    if not direct:
        return CudaPath.STAGED
    return CudaPath.GPU_DIRECT if "cuda_ipc" in transports else CudaPath.UCX_STAGED


@dataclass(frozen=True, slots=True)
class Peer:
    """What a peer published about itself, as a pipe to it needs it: its
    id and name, its UCX worker address, whether its UCX takes device
    memory (``cuda_direct``), its ``max_frame_bytes`` (checked before
    sending: a frame over it would be dropped unread, with nobody to tell),
    its lifeline address (without one, only UCX errors tell of its death),
    its process and by-address offer (``pid``, ``cma_offer``: with
    them, a peer on this host may exchange large buffers by address), and
    the size of its UCX TCP fragments (``tcp_segment``: UCX's TCP
    transport corrupts memory between processes whose sizes differ)."""

    id: int
    name: str
    address: bytes
    cuda_direct: bool = False
    max_frame_bytes: int | None = None
    lifeline: str | None = None
    pid: int | None = None
    cma_offer: str | None = None
    tcp_segment: int | None = None


class OutState(StateEnum):
    NEW = "new"
    HELLO_SENT = "hello-sent"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


#: The moves of a pipe's outgoing side (:meth:`Pipe.move_to`).  A NEW pipe
#: may close unused (a peer joining again at a new address replaces it).
_OUT_MOVES: dict[OutState, frozenset[OutState]] = {
    OutState.NEW: frozenset({OutState.HELLO_SENT, OutState.BROKEN, OutState.CLOSED}),
    OutState.HELLO_SENT: frozenset({OutState.OPEN, OutState.BROKEN, OutState.CLOSED}),
    OutState.OPEN: frozenset({OutState.BROKEN, OutState.CLOSED}),
    OutState.BROKEN: frozenset(),
    OutState.CLOSED: frozenset(),
}


class BadMove(AssertionError):
    """A pipe was moved to a state its table does not allow from where it
    is: a bug in ucxrpc, never the peer's doing."""


@dataclass(slots=True)
class Out:
    """Our direction (send.py's and engine.py's; under ``Pipe.lock``)."""

    state: OutState = OutState.NEW
    seq: int = 0                    # the last frame's sequence number
    #: Messages that waited for the handshake.
    backlog: list[tuple[bytes | memoryview, Sequence[Buffer], FrameKind, int,
                        list[int] | None]] = field(default_factory=list)
    #: Small messages waiting for the frame in flight (batch.py), and that
    #: frame's send request until the loop saw it complete.
    outbox: list[np.ndarray | bytes] = field(default_factory=list)  # encoded, unsealed
    outbox_bytes: int = 0  # batch.BASE + batch.cost() of each, once not empty
    last_frame: Request | None = None
    peer_max_frame: int = 1 << 62  # the receiver's max_frame_bytes, if known
    sent: int = 0


@dataclass(slots=True)
class Auth:
    """The handshake's keys (handshake.py's)."""

    out_key: bytes = b""   # our direction's MAC key, once the peer proved itself
    out_nonce: bytes = b""
    #: The epoch our data tags carry (wire/tags.py), named by the peer's
    #: CHALLENGE; and the epoch the peer's carry, named by ours.
    out_epoch: int = 0
    in_epoch: int = -1  # -1: no PROOF accepted yet
    #: Handshakes answered and not yet proved, ny -> (nx, generation):
    #: several, so that a forged HELLO or PROOF cannot spoil a genuine one
    #: in progress.
    in_nonces: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    in_key: bytes | None = None  # the peer's direction's key, once we proved ourselves


@dataclass(slots=True)
class Inbound:
    """The peer's direction, as the loop receives it (receive.py's)."""

    seq: int = 0              # the last frame taken, for replays
    received: int = 0         # messages delivered
    #: Whether the peer's loop could not poll when it sent its last frame
    #: (frame.py: ``busy``): large buffers go to it by address sooner.
    peer_busy: bool = False
    #: The pipe ended and what it was receiving was let go
    #: (:meth:`.receive.Receiver.abandon`): nothing of it is delivered.
    abandoned: bool = False


@dataclass(slots=True)
class ByAddressState:
    """Reading by address (hostmem/cma.py; by_address.py's): the peer's
    process and published offer (``offer`` None: not on this host, or this
    side does not read by address); whether we read its REMOTE buffers (we
    probed it and sent CMA_OK: ``reads``), whether it reads ours (it sent
    CMA_OK: ``read_by_peer``); our buffers it has not yet acknowledged, by
    the sequence number of their frame, in order (``held``), and the last of
    those frames it reads in two halves (``split_seq``, cma.SPLIT_BYTES)."""

    pid: int = 0
    offer: cma.Offer | None = None
    reads: bool = False
    read_by_peer: bool = False
    held: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    split_seq: int = 0
    #: The peer's frames whose REMOTE buffers we are done with, up to this
    #: sequence number (set after the reads, on the loop), and how far the
    #: last frame we sent acknowledged them (frame.py: ``ack``).
    read_through: int = 0
    ack_sent: int = 0
    #: How far the peer acknowledged ours (the highest ``ack`` it sent).
    acked: int = 0


@dataclass(slots=True)
class Lending:
    """Grants (grants.py's): our memory lent to the peer, by grant id, and
    the peer's lent to us, (id, address) by size class."""

    lent: dict[int, torch.Tensor] = field(default_factory=dict)
    granted: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


class Pipe:
    """Both directions to one peer: our endpoint out, their frames in."""

    def __init__(self, peer_id: int, name: str, address: bytes,
                 lifeline: str | None = None, *, gen: int = 0,
                 record: Peer | None = None) -> None:
        self.peer_id = peer_id
        self.name = name
        self.address = address
        self.lifeline = lifeline  # the peer's lifeline address, if it published one
        self.watched = False      # its lifeline is (being) connected
        #: What the peer published (the next generation is made from it).
        self.record = record
        #: Which generation of the pipe to this process of the peer this is.
        self.gen = gen
        #: BROKEN while the peer's process lives on (UnreachableError): the
        #: next generation replaces it once the peer answers.
        self.recoverable = False
        #: A later generation whose first handshake completed: its peer was
        #: said to be reachable again (once).
        self.restored = False
        self.ep: Endpoint | None = None
        self.direct = False  # device memory goes to UCX as is (else: staged)
        self.fifo: bool | None = None  # whether it reaches us through a shared-memory FIFO
        self.lock = threading.Lock()
        self.out = Out()
        self.auth = Auth()
        self.inbound = Inbound()
        self.cma = ByAddressState()
        self.grants = Lending()
        self.error: BaseException | None = None

    def move_to(self, state: OutState) -> None:
        """Move the outgoing side to ``state`` (under ``lock``).

        Raises:
            BadMove: the move is not in :data:`_OUT_MOVES`.
        """
        if state not in _OUT_MOVES[self.out.state]:
            raise BadMove(f"pipe to {self.name}: {self.out.state.value} -> {state.value} is "
                          "not a move of its outgoing side")
        self.out.state = state

    @property
    def closed(self) -> bool:
        """Whether our direction is over (broken or closed)."""
        return self.out.state is OutState.BROKEN or self.out.state is OutState.CLOSED


@dataclass(slots=True)
class Shared:
    """The containers the transport's parts share, each changed in place by
    whoever this table names (so every part holds the same objects):

    ==============  ============================================  =================
    container       who changes it                                 on which thread
    ==============  ============================================  =================
    ``pipes``       the transport (adds, replaces); others read    any, under the GIL
    ``watch``       the receiver, the handshake (append); the      the loop's
                    loop (takes what completed)
    ``inflight``    the sender (appends what it left in flight)    any, under a pipe's
                    ; the loop moves it to ``watch``               ``lock``
    ``tasks``       anyone (appends); the loop (runs them)         any
    ==============  ============================================  =================
    """

    #: By peer id.
    pipes: dict[int, Pipe] = field(default_factory=dict)
    #: Requests in flight, with what each belongs to: a pipe (a frame we
    #: sent), a message being received (receive.py), or None (drained).
    watch: list[tuple[Request, Any]] = field(default_factory=list)
    inflight: deque[tuple[Request, Any]] = field(default_factory=deque)
    tasks: deque[Callable[[], None]] = field(default_factory=deque)


class Incoming:
    """A message whose frame arrived and whose data buffers are in flight."""

    __slots__ = ("pipe", "frame", "buffers", "hint", "waiting", "error")

    def __init__(self, pipe: Pipe, frame: Frame, buffers: list[Any], hint: int) -> None:
        self.pipe = pipe
        self.frame = frame
        self.buffers = buffers
        self.hint = hint
        self.waiting = 0
        self.error: BaseException | None = None


class Piece:
    """One chunk of a staged buffer: ``then`` copies it over once it landed."""

    __slots__ = ("msg", "then")

    def __init__(self, msg: Incoming, then: Callable[[], None]) -> None:
        self.msg = msg
        self.then = then
