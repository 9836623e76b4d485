"""Which CUDA context the transport makes current for UCX (cudactx.py).

The decision runs on any machine; making a context current needs a GPU
(tests/rpc/test_gpu_setup.py checks it on the progress thread).
"""

from __future__ import annotations

import pytest
import torch

from ucxrpc.transport.cuda import context as cudactx


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch says a GPU is usable, current device 3 (nothing else of CUDA
    is called by the decision)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_no_gpu_no_context() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cudactx.wanted_device(["cuda:0"], None) is None


@pytest.mark.parametrize("transports", [["tcp"], ["sm", "cma"], ["tcp,sm"]])
def test_transports_without_cuda_want_none(gpu: None, transports: list[str]) -> None:
    assert cudactx.wanted_device(["cuda:1"], transports) is None


@pytest.mark.parametrize("transports", [None, ["sm", "cuda"], ["tcp,cuda_ipc"], ["gdr_copy"]])
def test_the_first_declared_cuda_device_wins(gpu: None, transports: list[str] | None) -> None:
    assert cudactx.wanted_device(["cpu", torch.device("cuda:1"), "cuda:0"], transports) == 1
    assert cudactx.wanted_device([2], transports) == 2


def test_a_worker_that_declared_none_gets_the_current_device(gpu: None) -> None:
    # A peer may send it CUDA tensors to land in host memory: UCX still
    # needs an active context for its device-to-host pipeline.
    assert cudactx.wanted_device([], None) == 3
    assert cudactx.wanted_device(["cpu"], None) == 3
    assert cudactx.wanted_device(["cuda"], None) == 3


def test_a_transport_without_a_gpu_says_why_it_has_no_context() -> None:
    from ucxrpc.transport import Limits, Transport

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    tr = Transport(my_id=0, secret=b"s" * 32, limits=Limits(),
                   on_message=lambda *a: None, on_frame_error=lambda *a: None,
                   on_broken=lambda *a: None, cuda_devices=["cuda:0"])
    try:
        assert tr.stats()["cuda_context"].startswith("none")
    finally:
        tr.close()
