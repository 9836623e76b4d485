"""Which CUDA context the transport makes current for UCX (cudactx.py).

The decision runs on any machine; making a context current needs a GPU
(tests/rpc/test_gpu_setup.py checks it on the progress thread).  Lending the
device's context to the thread that starts the transport, and taking it
back, runs here on a fake driver (tests/rpc/test_cuda_rpc.py checks it on a
GPU).
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


class _FakeDriver:
    """The three driver calls a lent context makes (the ``_v2`` entry points
    cuda.h names: the bare ones are the pre-CUDA-4 ABI), on a stack of
    current contexts as the driver keeps one per thread (one thread here)."""

    def __init__(self, own: int | None, refuse: bool = False) -> None:
        self.stack = [own] if own else []
        self.refuse = refuse

    def current(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def cuCtxGetCurrent(self, ref) -> int:
        ref._obj.value = self.current()
        return 0

    def cuCtxPushCurrent_v2(self, ctx) -> int:
        if self.refuse:
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        self.stack.append(ctx)
        return 0

    def cuCtxPopCurrent_v2(self, ref) -> int:
        self.stack.pop()
        return 0


DEVICE_CTX = 0xD1


@pytest.mark.parametrize("own", [None, 0x51], ids=["no context", "a context of its own"])
def test_the_transport_s_start_lends_the_device_s_context_and_takes_it_back(
        gpu: None, monkeypatch: pytest.MonkeyPatch, own: int | None) -> None:
    # The transport starts on the user's init_rpc thread: UCX's worker opens
    # under the device's context, and the thread is left as it was found,
    # with no context or its own (its torch device) (issue 50, item 4).
    from ucxrpc.transport.cuda.side import CudaSide

    driver = _FakeDriver(own)
    monkeypatch.setattr(cudactx, "_lib", lambda: driver)
    monkeypatch.setattr(cudactx, "_primary", lambda device: DEVICE_CTX + device)
    side = CudaSide(["cuda:1"], None)
    with side.lent() as said:
        assert said == "cuda:1" and driver.current() == DEVICE_CTX + 1
    assert driver.current() == own
    with pytest.raises(KeyError):  # a failing start takes it back too
        with side.lent():
            raise KeyError("the worker did not open")
    assert driver.current() == own


def test_a_context_the_driver_refuses_to_lend_is_said_and_nothing_is_taken_back(
        gpu: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ucxrpc.transport.cuda.side import CudaSide

    driver = _FakeDriver(0x51, refuse=True)
    monkeypatch.setattr(cudactx, "_lib", lambda: driver)
    monkeypatch.setattr(cudactx, "_primary", lambda device: DEVICE_CTX + device)
    with CudaSide(["cuda:1"], None).lent() as said:
        assert said.startswith("failed: cuCtxPushCurrent failed with CUDA error 201"), said
    assert driver.stack == [0x51]
    assert "UCX may fail to move CUDA memory" in caplog.text
    with CudaSide(["cpu"], ["tcp"]).lent() as said:  # no device: nothing lent
        assert said.startswith("none")
