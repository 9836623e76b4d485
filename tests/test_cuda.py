"""ucxrpc/_cuda.py on a CPU: its private torch bindings are checked once
against the public API, and used where they agree; where they disagree or
fail, a warning says so and the public helpers run from then on.

Both sides are fakes here (this torch has no CUDA): what is checked is the
choice, not CUDA.  On a GPU the real bindings go through the same check
(tests/rpc/test_cuda_rpc.py runs CUDA calls).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from ucxrpc import _cuda


class FakeStream(SimpleNamespace):
    pass


@pytest.fixture
def public(monkeypatch):
    """torch.cuda's public helpers, faked: device 1, its stream 7."""
    state = {"device": 1, "stream": (7, 1, 1), "set": []}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i=None: FakeStream(
        stream_id=state["stream"][0], device_index=state["stream"][1],
        device_type=state["stream"][2]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: state["set"].append(("public", i)))
    monkeypatch.setattr(_cuda, "_checked", False)
    return state


def _private(monkeypatch, public, *, stream=None, device=None):
    calls = []
    monkeypatch.setattr(_cuda, "_get_stream", lambda i: stream if stream is not None
                        else public["stream"])
    monkeypatch.setattr(_cuda, "_get_device", lambda: device if device is not None
                        else public["device"])
    monkeypatch.setattr(_cuda, "_set_device", lambda i: calls.append(("private", i)))
    monkeypatch.setattr(_cuda, "_set_stream", lambda **kw: calls.append(("stream", kw)))
    return calls


def test_private_bindings_that_agree_are_used(monkeypatch, public):
    calls = _private(monkeypatch, public)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cuda.current(1) == (7, 1, 1) and _cuda.device() == 1
        _cuda.set_device(0)
    # The check set the stream to the one current, then the call.
    assert calls == [("stream", {"stream_id": 7, "device_index": 1, "device_type": 1}),
                     ("private", 0)], calls
    assert public["set"] == [] and _cuda._get_stream is not None


@pytest.mark.parametrize("wrong", ["stream", "device", "raises", "setter raises"])
def test_private_bindings_that_disagree_give_way_to_the_public_api(monkeypatch, public, wrong):
    calls = _private(monkeypatch, public, stream=(9, 1, 1) if wrong == "stream" else None,
                     device=3 if wrong == "device" else None)
    if wrong == "raises":
        def broken(i):
            raise TypeError("takes no arguments")
        monkeypatch.setattr(_cuda, "_get_stream", broken)
    if wrong == "setter raises":
        def renamed(**kw):
            raise TypeError("_cuda_setStream() got an unexpected keyword argument 'stream_id'")
        monkeypatch.setattr(_cuda, "_set_stream", renamed)
    with pytest.warns(RuntimeWarning, match="private CUDA stream bindings disagree"):
        assert _cuda.current(1) == (7, 1, 1)  # the public answer
    assert _cuda._get_stream is None and _cuda._set_device is None
    _cuda.set_device(0)
    assert public["set"] == [("public", 0)] and calls == [], calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once: no second warning
        assert _cuda.device() == 1


def test_a_torch_without_them_uses_the_public_api_quietly(monkeypatch, public):
    for name in ("_get_stream", "_set_stream", "_get_device", "_set_device"):
        monkeypatch.setattr(_cuda, name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cuda.current(1) == (7, 1, 1) and _cuda.device() == 1
