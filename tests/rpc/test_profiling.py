"""RPC under torch's profiler, over real UCX pipes between processes.

What torch's agent records under the legacy profiler, ucxrpc records too
(ucxrpc/profiling.py): each call's span under torch's key, the callee's
events attributed to the callee, a Chrome trace holding both; under the
Kineto profiler, as torch, no RPC events and a warning.  torch's own
profiler tests run in tests/compat.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings

import pytest
import torch

from tests.workers import run_workers
from ucxrpc.functions import async_execution

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

REMOTE_OP = "#remote_op: "


def _init(rank: int, world_size: int, init_method: str) -> None:
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))


def _legacy_profile(**kw: object):
    from torch.autograd.profiler_legacy import profile

    with warnings.catch_warnings():  # torch deprecates the legacy profiler
        warnings.simplefilter("ignore")
        return profile(**kw)


def _summary(prof) -> list[tuple[str, int, bool]]:
    return [(e.name, e.node_id, e.is_remote) for e in prof.function_events]


# ---------------------------------------------------------------- callees

def udf(x):
    with torch.autograd.profiler.record_function("##udf##"):
        return torch.add(x, 1).relu()


def unprofiled_here():
    """Run by a caller with no profiler on: is anything profiling here?"""
    from ucxrpc import _torch_profiler

    return torch.autograd._profiler_enabled() or _torch_profiler.current_session() is not None


def raise_value_error():
    raise ValueError("expected failure")


def add_later(x):
    time.sleep(0.05)
    return torch.add(x, 2)


@async_execution
def relay(to, x):
    import ucxrpc as rpc

    return rpc.rpc_async(to, add_later, args=(x,))


# ---------------------------------------------------------------- scenarios

def _two_workers(rank: int, world_size: int, init_method: str, trace_dir: str) -> dict:
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    out: dict = {}
    if rank == 0:
        x = torch.ones(3)
        out["unprofiled_callee"] = rpc.rpc_sync("worker1", unprofiled_here)
        with _legacy_profile(record_shapes=True) as prof:
            rpc.rpc_sync("worker1", udf, args=(x,))
            rpc.rpc_async("worker1", torch.mul, args=(x, x)).wait()
            rref = rpc.remote("worker1", udf, args=(x,))
            rref.to_here()
            rref._get_profiling_future().wait()
            own = rpc.remote("worker0", udf, args=(x,))
            own._get_profiling_future().wait()
            try:
                rpc.rpc_sync("worker1", raise_value_error)
            except ValueError as exc:
                out["error"] = type(exc).__name__
            failing = rpc.remote("worker1", raise_value_error)
            failing._get_profiling_future().wait()  # created: the error is the value's
            try:
                failing.to_here()
            except ValueError as exc:
                out["remote_error"] = type(exc).__name__
        out["legacy"] = _summary(prof)
        with _legacy_profile() as many:
            futs = [rpc.rpc_async("worker1", torch.mul, args=(x, i)) for i in range(20)]
            out["many_values"] = [f.wait().tolist() for f in futs]
        out["many"] = _summary(many)
        out["shapes"] = {e.name: e.input_shapes for e in prof.function_events if e.is_remote}
        path = os.path.join(trace_dir, "legacy.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            out["trace"] = json.load(f)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.profiler.profile() as kineto:
                value = rpc.rpc_sync("worker1", udf, args=(x,))
        out["kineto_value"] = value.tolist()
        out["kineto_warnings"] = [str(w.message) for w in caught]
        out["kineto"] = sorted({e.name for e in kineto.events()})
        try:
            rref._get_profiling_future()  # an RRef made unprofiled has none
        except RuntimeError:
            pass
        plain = rpc.remote("worker1", udf, args=(x,))
        try:
            plain._get_profiling_future()
        except RuntimeError as exc:
            out["no_profiling_future"] = str(exc)
    rpc.shutdown()
    return out


def _three_workers(rank: int, world_size: int, init_method: str) -> list:
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    out: list = []
    if rank == 0:
        with _legacy_profile() as prof:
            rpc.rpc_async("worker1", relay, args=("worker2", torch.ones(2))).wait()
        out = _summary(prof)
    rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def two_workers() -> dict:
    with tempfile.TemporaryDirectory() as trace_dir:
        return run_workers(_two_workers, 2, args=(trace_dir,), timeout=90)[0]


# ---------------------------------------------------------------- tests

def test_calls_are_spans_under_torchs_keys(two_workers: dict) -> None:
    local = {name for name, node, remote in two_workers["legacy"] if node == 0 and not remote}
    assert {"rpc_sync#udf(worker0 -> worker1)",
            "rpc_async#aten::mul(worker0 -> worker1)",  # a builtin by its qualified name
            "rpc_remote#udf(worker0 -> worker1)",
            "rpc_remote#udf(worker0 -> worker0)",
            "rpc_sync#raise_value_error(worker0 -> worker1)",
            "to_here#(worker0)->(worker1)"} <= local
    # One span per call.
    names = [name for name, _, _ in two_workers["legacy"]]
    assert names.count("rpc_sync#udf(worker0 -> worker1)") == 1
    # The remote error keeps its type under the profiler.
    assert two_workers["error"] == "ValueError"
    assert two_workers["remote_error"] == "ValueError"
    assert "rpc_remote#raise_value_error(worker0 -> worker1)" in names


def test_concurrent_calls_each_get_their_events(two_workers: dict) -> None:
    assert two_workers["many_values"] == [[float(i)] * 3 for i in range(20)]
    key = "rpc_async#aten::mul(worker0 -> worker1)"
    names = [name for name, _, _ in two_workers["many"]]
    assert names.count(key) == 20
    assert names.count(key + REMOTE_OP + "aten::mul") == 20


def test_callee_events_are_attributed_to_the_callee(two_workers: dict) -> None:
    events = two_workers["legacy"]
    for key, node in (("rpc_sync#udf(worker0 -> worker1)", 1),
                      ("rpc_remote#udf(worker0 -> worker1)", 1),
                      ("rpc_remote#udf(worker0 -> worker0)", 0)):
        remote = {name[len(key + REMOTE_OP):]: n for name, n, is_remote in events
                  if is_remote and name.startswith(key + REMOTE_OP)}
        assert {"##udf##", "aten::add", "aten::relu"} <= set(remote), (key, remote)
        assert set(remote.values()) == {node}
    assert ("rpc_async#aten::mul(worker0 -> worker1)" + REMOTE_OP + "aten::mul", 1, True) in events
    # The caller's settings reach the callee: shapes were recorded there.
    shapes = two_workers["shapes"]
    assert shapes["rpc_sync#udf(worker0 -> worker1)" + REMOTE_OP + "aten::add"] == [[3], [], []]
    # A failed call has its span, and no events from the callee.
    assert not any(name.startswith("rpc_sync#raise_value_error(worker0 -> worker1)" + REMOTE_OP)
                   for name, _, _ in events)


def test_chrome_trace_shows_the_call_on_both_workers(two_workers: dict) -> None:
    trace = two_workers["trace"]
    key = "rpc_sync#udf(worker0 -> worker1)"
    [span] = [e for e in trace if e["name"] == key]
    callee = [e for e in trace if e["name"].startswith(key + REMOTE_OP)]
    assert isinstance(span["tid"], int)  # the caller's thread
    assert {e["name"][len(key + REMOTE_OP):] for e in callee} >= {"##udf##", "aten::add"}
    # The callee's events are on its own track, named by its node.
    assert all("node_id:1," in e["tid"] for e in callee)
    # ... and within the call, on the one clock of this host.
    scope = next(e for e in callee if e["name"].endswith("##udf##"))
    assert span["ts"] <= scope["ts"] and scope["ts"] + scope["dur"] <= span["ts"] + span["dur"]


def test_kineto_profiler_records_no_rpc_as_in_torch(two_workers: dict) -> None:
    assert two_workers["kineto_value"] == [2.0, 2.0, 2.0]
    assert not [name for name in two_workers["kineto"] if name.startswith("rpc_")]
    assert any("Kineto profiler will profile the caller, but not the worker" in w
               for w in two_workers["kineto_warnings"])


def test_no_profiler_no_profiling(two_workers: dict) -> None:
    assert two_workers["unprofiled_callee"] is False
    assert "Profiling future has not been set" in two_workers["no_profiling_future"]


def test_nested_calls_are_attributed_to_each_node() -> None:
    events = run_workers(_three_workers, 3, timeout=90)[0]
    outer = "rpc_async#relay(worker0 -> worker1)"
    inner = "rpc_async#add_later(worker1 -> worker2)"
    assert (outer, 0, False) in events
    assert (outer + REMOTE_OP + inner, 1, True) in events
    assert (outer + REMOTE_OP + inner + REMOTE_OP + "aten::add", 2, True) in events
