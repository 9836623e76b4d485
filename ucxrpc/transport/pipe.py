"""A pipe: both directions to one peer, and a message being received.

A pipe's outgoing side is a small state machine (:class:`OutState`): NEW
until first used, HELLO_SENT while our handshake is answered, OPEN once the
peer proved it holds the job secret, BROKEN when the peer or network failed
(the error is kept and raised for every later send), CLOSED when we closed
it.  The incoming side is authenticated when ``in_key`` is set.  All fields
are guarded by ``lock`` where several threads reach them (sending); the
rest belong to the progress thread.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from .hostmem import cma
from .wire.frame import Frame, Kind
from .wire.gather import Buffer
from .ucx.binding import Endpoint, Request

__all__ = ["CudaPath", "Incoming", "OutState", "Piece", "Pipe", "cuda_path"]


class CudaPath(enum.Enum):
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


class OutState(enum.Enum):
    NEW = "new"
    HELLO_SENT = "hello-sent"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


class Pipe:
    """Both directions to one peer: our endpoint out, their frames in."""

    def __init__(self, peer_id: int, name: str, address: bytes,
                 lifeline: str | None = None) -> None:
        self.peer_id = peer_id
        self.name = name
        self.address = address
        self.lifeline = lifeline  # the peer's lifeline address, if it published one
        self.watched = False      # its lifeline is (being) connected
        self.ep: Endpoint | None = None
        self.direct = False  # device memory goes to UCX as is (else: staged)
        self.lock = threading.Lock()
        self.out_state = OutState.NEW
        self.out_key = b""
        self.out_seq = 0
        self.out_nonce = b""
        self.backlog: list[tuple[bytes | memoryview, Sequence[Buffer], Kind, int,
                                 list[int] | None]] = []
        # Small messages waiting for the frame in flight (batch.py), and
        # that frame's send request until the loop saw it complete.
        self.outbox: list[np.ndarray] = []
        self.outbox_bytes = 0  # batch.BASE + batch.cost() of each, once not empty
        self.last_frame: Request | None = None
        # Handshakes answered and not yet proved, ny -> nx: several, so that a
        # forged HELLO or PROOF cannot spoil a genuine one in progress.
        self.in_nonces: dict[bytes, bytes] = {}
        self.peer_max_frame = 1 << 62  # the receiver's max_frame_bytes, if known
        self.fifo: bool | None = None  # whether it reaches us through a shared-memory FIFO
        # Reading by address (cma.py): the peer's process and published offer
        # (None: not on this host, or this side does not read by address);
        # whether we read its REMOTE buffers (we probed it and sent CMA_OK),
        # whether it reads ours (it sent CMA_OK); our buffers it has not yet
        # acknowledged, by the sequence number of their frame, in order, and
        # the last of those frames it reads in two halves (cma.SPLIT_BYTES).
        self.cma_pid = 0
        self.cma_offer: cma.Offer | None = None
        self.cma_in = False
        self.cma_out = False
        self.cma_held: dict[int, list[torch.Tensor]] = {}
        self.cma_split_seq = 0
        # Grants (grants.py): our memory lent to the peer, by grant id, and
        # the peer's lent to us, (id, address) by size class.
        self.lent: dict[int, torch.Tensor] = {}
        self.granted: dict[int, list[tuple[int, int]]] = {}
        # The peer's frames whose REMOTE buffers we are done with, up to this
        # sequence number (set after the reads, on the loop), and how far the
        # last frame we sent acknowledged them (frame.py: ``ack``).
        self.read_through = 0
        self.ack_sent = 0
        # How far the peer acknowledged ours (the highest ``ack`` it sent).
        self.acked = 0
        # Whether the peer's loop could not poll when it sent its last frame
        # (frame.py: ``state``): large buffers go to it by address sooner.
        self.peer_busy = False
        self.in_key: bytes | None = None
        self.in_seq = 0
        self.error: BaseException | None = None
        self.sent = 0
        self.received = 0


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
