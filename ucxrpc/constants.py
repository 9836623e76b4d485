"""torch's ``torch.distributed.rpc.constants`` names, with ucxrpc's values."""

from __future__ import annotations

from datetime import timedelta

from .options import DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT
from .timeouts import UNSET

__all__ = ["DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS", "DEFAULT_PROCESS_GROUP_TIMEOUT",
           "DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT"]

#: The options' default ``rpc_timeout``, in seconds.
DEFAULT_RPC_TIMEOUT_SEC: float = DEFAULT_RPC_TIMEOUT
#: ``shutdown``'s default ``timeout``: no limit.
DEFAULT_SHUTDOWN_TIMEOUT: float = 0.0
#: A call's ``timeout`` meaning "the default RPC timeout".
UNSET_RPC_TIMEOUT: float = UNSET
#: torch's, for its process-group rendezvous; ucxrpc's rendezvous does not use it.
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)
