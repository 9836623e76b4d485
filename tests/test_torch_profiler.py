"""The adapter over torch's legacy profiler (ucxrpc/_torch_profiler.py),
checked against the pinned torch: the private hooks it takes exist and
behave as it assumes.  No processes: the events a callee would send are
made here, by a CalleeProfile on another thread."""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch.autograd import profiler_legacy

from ucxrpc import _torch_profiler as tp

NODE = 5


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """install(), undone afterwards: torch's functions back.  The node id
    stays (torch takes no -1 back); it only labels legacy events."""
    monkeypatch.setattr(profiler_legacy.profile, "_start_trace", tp._torch_start_trace)
    monkeypatch.setattr(profiler_legacy, "_parse_legacy_records", tp._torch_parse)
    tp.install(NODE)
    yield


def _legacy_profile(**kw: object) -> profiler_legacy.profile:
    with warnings.catch_warnings():  # torch deprecates the legacy profiler
        warnings.simplefilter("ignore")
        return profiler_legacy.profile(**kw)


def _ops() -> None:
    with torch.autograd.profiler.record_function("##scope##"):
        torch.ones(2).add(1).relu()


def _callee_events(settings: tp.Settings) -> list[tp.Event]:
    """What a callee thread sends back for ``_ops`` under ``settings``."""
    out: list[list[tp.Event]] = []

    def run() -> None:
        profile = tp.CalleeProfile(settings)
        profile.start()
        try:
            # A call the callee made itself, already back with its events.
            assert tp.current_session() is profile.session
            profile.session.add([tp.Event("nested", "nested", 9, None, tp.now_us(),
                                          tp.now_us() + 1.0)])
            _ops()
        finally:
            profile.stop()
        assert tp.current_session() is None
        out.append(profile.events())

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out[0]


def test_the_pinned_torch_has_the_hooks() -> None:
    assert callable(profiler_legacy._parse_legacy_records)
    assert callable(profiler_legacy.profile._start_trace)
    assert callable(torch._C._distributed_rpc._set_profiler_node_id)
    assert callable(torch.jit._builtins._find_builtin)
    assert tp.builtin_name(torch.add) == "aten::add"
    assert tp.builtin_name(_ops) is None


def test_which_profiler_is_on() -> None:
    assert not tp.profiler_enabled()
    with _legacy_profile():
        assert tp.profiler_enabled() and tp.legacy_profiler_on()
    with torch.profiler.profile():
        assert tp.profiler_enabled() and not tp.legacy_profiler_on()
    # torch.autograd.profiler.profile is Kineto, whatever use_kineto says.
    with torch.autograd.profiler.profile(use_kineto=False):
        assert not tp.legacy_profiler_on()


def test_now_us_is_the_legacy_profilers_clock() -> None:
    before = tp.now_us()
    torch.autograd._enable_profiler_legacy(tp._config(tp.Settings()))
    records = torch.autograd._disable_profiler_legacy()
    start_us, _ = tp._start_of(records)
    assert before - 1000 <= start_us <= tp.now_us() + 1000


def test_install_is_idempotent(installed: None) -> None:
    parse = profiler_legacy._parse_legacy_records
    tp.install(NODE)
    assert profiler_legacy._parse_legacy_records is parse


def test_a_profile_opens_a_session_with_its_settings(installed: None) -> None:
    assert tp.current_session() is None
    with _legacy_profile(record_shapes=True, profile_memory=True):
        session = tp.current_session()
        assert session is not None
        assert session.settings == tp.Settings(record_shapes=True, profile_memory=True)
    assert tp.current_session() is None  # ended with the profile


def test_local_events_carry_the_node_id(installed: None) -> None:
    with _legacy_profile() as prof:
        torch.ones(1)
    assert {e.node_id for e in prof.function_events} == {NODE}


def test_callee_events_join_the_callers_profile(installed: None) -> None:
    remote = _callee_events(tp.Settings(record_shapes=True))
    prefix = "rpc_async#f(a -> b)#remote_op: "
    with _legacy_profile() as prof:
        start = tp.now_us()
        session = tp.current_session()
        assert session is not None
        session.add([tp.Event("rpc_async#f(a -> b)", "rpc_async#f(a -> b)", NODE, None,
                              start, tp.now_us() + 10_000, is_async=True)])
        session.add(e.remote(prefix) for e in remote)
        torch.ones(1)
    events = prof.function_events
    span = next(e for e in events if e.name == "rpc_async#f(a -> b)")
    assert span.node_id == NODE and span.is_async and not span.is_remote
    # Times are the profile's own: microseconds since its start.
    assert 0 <= span.time_range.start < 10_000
    add = next(e for e in events if e.name == prefix + "aten::add")
    assert add.is_remote and add.node_id == NODE  # the callee process's node id
    assert add.input_shapes == [[2], [], []]
    # The callee's own calls come along, on its session's thread.
    nested = next(e for e in events if e.name == prefix + "nested")
    assert nested.node_id == 9 and nested.thread == add.thread
    # The tree is built over them: the callee's scope holds its operators.
    scope = next(e for e in events if e.name == prefix + "##scope##")
    assert {c.name for c in scope.cpu_children} >= {prefix + "aten::ones", prefix + "aten::add"}
    # Sorted as torch sorts: by start.
    starts = [e.time_range.start for e in events]
    assert starts == sorted(starts)


def test_memory_events_stay_top_level(installed: None) -> None:
    memory = tp.Event("[memory]", None, -1, 0, 1.0, 1.0, cpu_memory_usage=64)
    assert memory.remote("k#remote_op: ") is memory
    with _legacy_profile() as prof:
        session = tp.current_session()
        assert session is not None
        session.add([memory])
    [event] = [e for e in prof.function_events if e.name == "[memory]"]
    assert event.cpu_memory_usage == 64 and event.time_range.start == 0


def test_callee_profile_records_memory_when_asked() -> None:
    usage = {e.cpu_memory_usage for e in _callee_events(tp.Settings(profile_memory=True))}
    assert usage != {0}
    assert {e.cpu_memory_usage for e in _callee_events(tp.Settings())} == {0}


def test_callee_profile_on_a_profiling_thread_records_nothing() -> None:
    with _legacy_profile():
        profile = tp.CalleeProfile(tp.Settings())
        profile.start()  # torch refuses a second profiler on this thread
        profile.stop()
    assert profile.events() == []


def test_chrome_trace_puts_remote_events_on_their_nodes_track(installed: None, tmp_path) -> None:
    remote = _callee_events(tp.Settings())
    with _legacy_profile() as prof:
        session = tp.current_session()
        assert session is not None
        session.add(e.remote("k#remote_op: ") for e in remote)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    tids = {e["tid"] for e in trace if e["name"] == "k#remote_op: aten::add"}
    assert len(tids) == 1 and f"node_id:{NODE}" in tids.pop()
