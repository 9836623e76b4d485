"""Tests of tests/workers.py itself, with trivial targets (no torch, no UCX)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from tests.workers import (
    WorkerFailed,
    WorkerTimeout,
    child_pids,
    forkserver_pid,
    free_port,
    run_workers,
    spawn_worker,
    stop_worker,
)

# Read at import on purpose: children import this module after run_workers
# has set their environment, and this records what they saw then.
_ENV_KEY = "UCXRPC_TEST_WORKERS_HELPER"
_ENV_AT_IMPORT = os.environ.get(_ENV_KEY)


# ---- targets (module level, so spawned children can import them) ----------


def _report(rank: int, world_size: int, init_method: str, *args: object) -> tuple[object, ...]:
    # Higher ranks finish first, so rank order cannot come from arrival order.
    time.sleep(0.05 * (world_size - rank))
    return (rank, world_size, init_method, os.getpid(), *args)


def _env_seen(rank: int, world_size: int, init_method: str) -> tuple[str | None, str | None]:
    return _ENV_AT_IMPORT, os.environ.get(_ENV_KEY)


def _fail_on_odd(rank: int, world_size: int, init_method: str) -> int:
    if rank % 2:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _hang_on_rank1(rank: int, world_size: int, init_method: str) -> int:
    if rank == 1:
        _sleep_forever()
    return rank


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def _fail_rank0_hang_others(rank: int, world_size: int, init_method: str) -> int:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    _sleep_forever()
    return rank


def _exit_hard(rank: int, world_size: int, init_method: str) -> int:
    os._exit(3)


def _return_unpicklable(rank: int, world_size: int, init_method: str) -> object:
    return threading.Lock()


def _leak_thread(rank: int, world_size: int, init_method: str) -> int:
    threading.Thread(target=_sleep_forever, name="leaked-non-daemon").start()
    return rank


def _serve_forever(port: int) -> None:
    _sleep_forever()


# ---- tests -------------------------------------------------------------------


def _assert_no_children() -> None:
    assert multiprocessing.active_children() == []
    assert [pid for pid in child_pids() if not _is_mp_helper(pid)] == []
    server = forkserver_pid()  # the workers' parent (tests/workers.START_METHOD)
    assert server is None or child_pids(server) == []


def _is_mp_helper(pid: int) -> bool:
    from multiprocessing import resource_tracker

    return pid in (getattr(resource_tracker._resource_tracker, "_pid", None), forkserver_pid())


def test_free_port_is_bindable_and_varies() -> None:
    ports = {free_port() for _ in range(5)}
    assert len(ports) > 1
    port = ports.pop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_results_come_back_in_rank_order() -> None:
    results = run_workers(_report, 3, args=("extra",), timeout=30)
    assert [r[0] for r in results] == [0, 1, 2]  # type: ignore[index]
    assert {r[1] for r in results} == {3}  # type: ignore[index]
    init_methods = {r[2] for r in results}  # type: ignore[index]
    assert len(init_methods) == 1
    (init_method,) = init_methods
    assert init_method.startswith("tcp://127.0.0.1:")  # type: ignore[union-attr]
    assert len({r[3] for r in results}) == 3  # type: ignore[index]
    assert all(r[4] == "extra" for r in results)  # type: ignore[index]
    _assert_no_children()


def test_given_init_method_is_passed_through() -> None:
    results = run_workers(_report, 2, timeout=30, init_method="file:///tmp/rdv")
    assert [r[2] for r in results] == ["file:///tmp/rdv"] * 2  # type: ignore[index]


def test_env_is_set_before_the_target_module_is_imported() -> None:
    results = run_workers(_env_seen, 2, timeout=30, env={_ENV_KEY: "set-by-test"})
    assert results == [("set-by-test", "set-by-test")] * 2


def test_failing_rank_traceback_surfaces() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_fail_on_odd, 4, timeout=30)
    err = info.value
    assert sorted(err.failures) == [1, 3]
    assert "ValueError: boom from rank 1" in err.failures[1]
    assert "ValueError: boom from rank 3" in err.failures[3]
    assert "_fail_on_odd" in err.failures[1]  # a real traceback, not just the message
    assert err.results == {0: 0, 2: 2}
    assert "boom from rank 3" in str(err)
    _assert_no_children()


def test_hanging_rank_is_killed_at_the_deadline_with_its_stack() -> None:
    timeout = 2.0
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        run_workers(_hang_on_rank1, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 4.0
    err = info.value
    assert err.ranks == [1]
    assert err.results == {0: 0}
    assert "_sleep_forever" in err.stacks[1]
    assert "_sleep_forever" in str(err)
    _assert_no_children()


def test_others_are_stopped_soon_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.workers.FAILURE_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_workers(_fail_rank0_hang_others, 2, timeout=30)
    assert time.monotonic() - start < 10.0
    err = info.value
    assert "rank 0 gives up" in err.failures[0]
    assert list(err.stopped) == [1]
    assert "_sleep_forever" in err.stopped[1]
    _assert_no_children()


def test_rank_exiting_without_a_result_is_a_failure() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_exit_hard, 1, timeout=30)
    assert "exited with code 3 without reporting" in info.value.failures[0]


def test_unpicklable_result_is_a_failure() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_return_unpicklable, 1, timeout=30)
    assert "does not pickle" in info.value.failures[0]


def test_rank_that_returns_but_does_not_exit_is_a_failure() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_leak_thread, 1, timeout=3)
    text = info.value.failures[0]
    assert "did not exit" in text
    assert "_sleep_forever" in text
    _assert_no_children()


def test_targets_must_be_module_level() -> None:
    def local(rank: int, world_size: int, init_method: str) -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        run_workers(local, 1)
    with pytest.raises(TypeError, match="module-level"):
        run_workers(lambda *a: None, 1)
    _assert_no_children()


def test_spawn_worker_can_be_sigkilled_and_stopped() -> None:
    proc = spawn_worker(_serve_forever, free_port())
    try:
        assert proc.is_alive()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        stop_worker(proc)
    stop_worker(proc)  # idempotent
    _assert_no_children()
