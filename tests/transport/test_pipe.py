"""A pipe's CUDA path comes from the lanes its endpoint really uses.

"gpu-direct" once came from which transports UCX loaded, so a pipe whose
endpoint had no cuda_ipc lane (cuda_copy-only UCX_TLS, another host) was
reported as direct while UCX staged every byte through bounce buffers.
"""

from __future__ import annotations

import pytest

from ucxrpc.transport.pipe import CudaPath, cuda_path


@pytest.mark.parametrize("transports", [{"cuda_ipc", "sysv", "cuda_copy"}, {"cuda_ipc", "tcp"}])
def test_a_cuda_ipc_lane_is_gpu_direct(transports: set[str]) -> None:
    assert cuda_path(True, transports) is CudaPath.GPU_DIRECT


@pytest.mark.parametrize("transports", [{"cuda_copy", "sysv"}, {"tcp", "cuda_copy"}, {"tcp"},
                                        set()])
def test_device_memory_without_a_cuda_ipc_lane_is_staged_by_ucx(transports: set[str]) -> None:
    assert cuda_path(True, transports) is CudaPath.UCX_STAGED


def test_without_cuda_on_both_sides_ucxrpc_stages() -> None:
    assert cuda_path(False, {"cuda_ipc", "cuda_copy"}) is CudaPath.STAGED
    assert CudaPath.STAGED.value == "staged" and CudaPath.GPU_DIRECT.value == "gpu-direct"
