"""Every error ucxrpc raises, in one tree.

torch's RPC users catch ``RuntimeError`` for RPC failures, so the root
subclasses it; a timeout is also a ``TimeoutError``.  Lower-layer (ucxx)
exceptions are converted inside ``transport/`` and chained with ``from exc``.

::

    RpcError (RuntimeError)
    ├── TransportError
    │   ├── ConnectError        a pipe to the peer could not be opened
    │   ├── ClosedError         we closed it (shutdown, close())
    │   └── BrokenError         peer or network failed; __cause__ says how
    │       ├── PeerLeftError   the peer left its dynamic group
    │       └── UnreachableError  the peer's host cannot be reached now; its
    │                           process may live, and the pipe comes back
    ├── RpcTimeoutError         also a TimeoutError; message says it timed out
    ├── RemoteError             carries worker name, remote type, traceback
    ├── SerializationError      cannot pickle / unpickle / decode a frame
    ├── FrameError              malformed, truncated or oversize frame
    ├── AuthenticationError     handshake refused
    ├── RRefError
    ├── WorkerNameError     also a ValueError: a name torch's rule refuses
    └── DistAutogradError
"""

from __future__ import annotations

__all__ = [
    "RpcError",
    "TransportError",
    "ConnectError",
    "ClosedError",
    "BrokenError",
    "PeerLeftError",
    "UnreachableError",
    "RpcTimeoutError",
    "RemoteError",
    "SerializationError",
    "FrameError",
    "AuthenticationError",
    "RRefError",
    "WorkerNameError",
    "DistAutogradError",
]


class RpcError(RuntimeError):
    """Root of every ucxrpc error."""


class TransportError(RpcError):
    """A pipe to a peer failed or is unusable."""


class ConnectError(TransportError):
    """A pipe to the peer could not be opened."""


class ClosedError(TransportError):
    """The pipe or agent was closed on purpose (shutdown)."""


class BrokenError(TransportError):
    """The peer died or the network failed; ``__cause__`` says how."""


class PeerLeftError(BrokenError):
    """The peer left its dynamic group: its calls fail as a dead peer's do
    (what it was asked may not have run), but nothing went wrong."""


class UnreachableError(BrokenError):
    """The peer's host answers nothing (a partition, a host gone silent) or
    its pipe failed while its process lives: calls in flight to it fail, as
    a dead peer's do, but the peer is not taken for dead.  The pipe is
    re-established once its host answers again (docs/reliability.md)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC ran past its timeout; the message says so, as torch's does."""


class RemoteError(RpcError):
    """A remote exception that could not be rebuilt with its own type.

    Attributes:
        worker: name of the worker that raised it.
        remote_type: qualified name of the remote exception's type.
        remote_traceback: the formatted remote traceback.
    """

    def __init__(self, message: str, *, worker: str = "", remote_type: str = "",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class SerializationError(RpcError):
    """A value could not be pickled or unpickled, or its buffers do not fit."""


class FrameError(RpcError):
    """A frame on the wire is malformed, truncated or larger than allowed."""


class AuthenticationError(RpcError):
    """A peer failed the pipe handshake (wrong job secret, replay, ...)."""


class WorkerNameError(RpcError, ValueError):
    """A worker name torch's rule refuses: a RuntimeError as torch raises,
    and a ValueError, which it is."""


class RRefError(RpcError):
    """Misuse or failure of a remote reference."""


class DistAutogradError(RpcError):
    """Failure of distributed autograd."""
