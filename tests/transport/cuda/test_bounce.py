"""transport/cuda/bounce.py where it cannot work: without CuPy it says why, so
that a worker whose device memory CUDA IPC cannot share stages it instead
(the paths themselves are GPU tests: tests/rpc/test_gpu_setup.py)."""

from __future__ import annotations

import sys

from ucxrpc.transport.cuda import bounce


def test_without_cupy_it_is_not_usable_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    usable, why = bounce.usable()
    assert not usable
    assert why.startswith("CuPy is not usable (ModuleNotFoundError: import of cupy"), why
