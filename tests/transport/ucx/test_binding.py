"""The ucxx binding (ucxrpc/transport/ucx/binding.py), without processes:
when device memory may be handed to UCX.  Its pipes between processes are
tested through the transport (tests/transport/ucx/test_ucp.py, tests/rpc/)."""

from __future__ import annotations

from ucxrpc.transport.ucx.binding import cuda_memory


def test_device_memory_goes_to_ucx_only_with_cuda_copy_loaded():
    host = [("tcp", "lo"), ("sysv", "memory")]
    assert cuda_memory(True, host + [("cuda_copy", "cuda"), ("cuda_ipc", "cuda")])
    assert cuda_memory(True, host + [("cuda_copy", "cuda")])
    assert not cuda_memory(True, host + [("cuda_ipc", "cuda")])
    assert not cuda_memory(True, host + [("gdr_copy", "cuda")])
    assert not cuda_memory(True, host)
    # ucxx's cuda_support is a test of UCX_TLS: true on a machine without a GPU
    assert not cuda_memory(False, host + [("cuda_copy", "cuda")])
