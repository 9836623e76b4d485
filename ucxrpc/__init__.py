"""ucxrpc: torch.distributed.rpc on UCX.  ``import ucxrpc as rpc``.

Importing starts nothing: no threads, no UCX context, no environment
changes; all of that happens in :func:`init_rpc`.
"""

from __future__ import annotations

from . import autograd, constants, functions, optim
from .agent import WorkerInfo
from .api import (BackendType, get_pipe_info, get_rpc_timeout, get_worker_info, init_rpc,
                  is_available, is_initialized, rpc_async, rpc_sync, shutdown)
from .api import (_get_current_rpc_agent, _get_debug_info, _is_current_rpc_agent_set,
                  _set_rpc_timeout)
from .errors import (AuthenticationError, BrokenError, ClosedError, ConnectError,
                     DistAutogradError, FrameError, PeerLeftError, RemoteError, RpcError,
                     RpcTimeoutError, RRefError, SerializationError, TransportError,
                     UnreachableError, WorkerNameError)
from .options import RpcBackendOptions, UcxRpcBackendOptions
from .rref import RRef, remote
from .tensorpipe import TensorPipeRpcBackendOptions

#: torch's private names that libraries and programs call on torch's module
#: (``rpc._is_current_rpc_agent_set()``...): here under those names, not in
#: ``__all__`` (as in torch); ucxrpc.torch_rpc's stand-in has them too.
_TORCH_PRIVATE = (_get_current_rpc_agent, _get_debug_info, _is_current_rpc_agent_set,
                  _set_rpc_timeout)

__version__ = "0.1.0"  # the package's version: pyproject.toml reads it from here

__all__ = [
    "AuthenticationError",
    "BackendType",
    "BrokenError",
    "ClosedError",
    "ConnectError",
    "DistAutogradError",
    "FrameError",
    "PeerLeftError",
    "RRef",
    "RRefError",
    "RemoteError",
    "RpcBackendOptions",
    "RpcError",
    "RpcTimeoutError",
    "SerializationError",
    "TensorPipeRpcBackendOptions",
    "TransportError",
    "UnreachableError",
    "WorkerNameError",
    "UcxRpcBackendOptions",
    "WorkerInfo",
    "autograd",
    "constants",
    "functions",
    "get_pipe_info",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "is_initialized",
    "optim",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
