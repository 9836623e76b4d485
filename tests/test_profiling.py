"""The caller's side of RPC profiling (ucxrpc/profiling.py) without
processes: torch's keys, and what a profiled call sends."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from ucxrpc import profiling
from ucxrpc._torch_profiler import Session, Settings
from ucxrpc.functions import _plain, async_execution


def udf(x):
    return x


@async_execution
def async_udf(x):
    return x


@_plain
def plain_udf(x):
    return x


@_plain
@async_execution
def plain_async_udf(x):
    return x


def test_keys_are_torchs() -> None:
    assert profiling.rpc_key("sync", udf, "worker0", "worker1") == "rpc_sync#udf(worker0 -> worker1)"
    assert (profiling.rpc_key("async", torch.add, "a", "b") == "rpc_async#aten::add(a -> b)")
    assert (profiling.rpc_key("remote", Settings._replace, "a", "a")
            == "rpc_remote#Settings._replace(a -> a)")
    # torch raises here (no __qualname__); the call goes on, named by its type.
    assert (profiling.rpc_key("async", functools.partial(udf, 1), "a", "b")
            == "rpc_async#partial(a -> b)")


def _span(session: Session | None) -> profiling.Span:
    agent = SimpleNamespace(devices=[], info=SimpleNamespace(id=0))
    return profiling.Span(agent, "k", session)  # type: ignore[arg-type]


def test_a_profiled_call_sends_the_function_with_the_sessions_settings() -> None:
    settings = Settings(record_shapes=True)
    span = _span(Session(settings))
    for func, serve in ((udf, profiling._serve), (async_udf, profiling._serve_async),
                        (plain_udf, profiling._serve_plain),
                        (plain_async_udf, profiling._serve_async_plain)):
        sent, args, kwargs = span.request(func, (1,), {"y": 2})
        assert sent is serve and args == (settings, func, (1,), {"y": 2}) and kwargs == {}
    # Wrappers keep what the layers below read off a function.
    assert profiling._serve_async._wrapped_async_rpc_function is not None
    assert profiling._serve_async_plain._wrapped_async_rpc_function is not None
    assert profiling._serve_plain._ucxrpc_plain and profiling._serve_async_plain._ucxrpc_plain
    assert not getattr(profiling._serve, "_ucxrpc_plain", False)


def test_without_a_session_the_call_goes_as_it_is() -> None:
    from torch.autograd.profiler_legacy import profile

    with profile() as prof:  # its record_function span needs a profiler on
        span = _span(None)
        assert span.request(udf, (1,), {}) == (udf, (1,), {})
        fut: torch.futures.Future = torch.futures.Future()
        out = span.finish(fut)
        fut.set_exception(ValueError("remote failure"))
    try:
        out.wait()
    except ValueError:
        pass
    else:
        raise AssertionError("the failure did not keep its type")
    assert [e.name for e in prof.function_events] == ["k"]
