"""Helpers for tests of messages between two workers over real pipes,
by address or not: importable where reading by address is unavailable (the
by-address test modules skip themselves there)."""

from __future__ import annotations

import pytest
import torch

__all__ = ["debug_counts", "needs_sibling_reads", "siblings_may_read", "start_worker"]


def siblings_may_read() -> bool:
    """Whether this kernel lets a process read a sibling's memory: Yama's
    ptrace_scope 1 or more allows only descendants (and the pipe then stays
    on UCX, which the test checks instead)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True  # no Yama


needs_sibling_reads = pytest.mark.skipif(
    not siblings_may_read(), reason="this kernel does not let sibling processes read each other")


_COUNTS = ("bytes_read_by_address", "buffers_read_by_peers", "buffers_held_for_peers",
           "buffers_written_into_peers", "grants_used")


def debug_counts(keys: tuple[str, ...] = _COUNTS) -> dict[str, int]:
    """These counters of this worker's ``_get_debug_info()``."""
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return {k: info[k] for k in keys}


def start_worker(rank, world_size, init_method, **options):
    """``init_rpc`` as ``worker{rank}`` (``rpc_timeout`` 30 unless given);
    rank 0 then makes one call, whose reply follows the peer's CMA_OK:
    reading by address is on from the next message (the first one cannot
    wait for it)."""
    import ucxrpc as rpc

    options.setdefault("rpc_timeout", 30)
    opts = rpc.UcxRpcBackendOptions(init_method=init_method, **options)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank == 0:
        rpc.rpc_sync("worker1", torch.add, (1, 1))
    return rpc
