"""Tests of tests/workers.py itself, with trivial targets (no torch, no UCX):
run_workers, spawn_worker, and the group of ranks kept up across tests
(WorkerGroup, worker_group)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.workers import (
    ScenarioFailed,
    WorkerFailed,
    WorkerGroup,
    WorkerTimeout,
    child_pids,
    forkserver_pid,
    free_port,
    run_workers,
    sigstop,
    spawn_worker,
    stop_worker,
    thread_states,
    worker_group,
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


# ---- a group's setups and scenarios ------------------------------------------

_STATE: dict[str, object] = {}


def _group_setup(rank: int, world_size: int, init_method: str, log_dir: str):
    _STATE.update(rank=rank, world_size=world_size, init_method=init_method)
    Path(log_dir, f"up-{rank}-{os.getpid()}").touch()
    yield
    Path(log_dir, f"down-{rank}-{os.getpid()}").touch()


def _plain_setup(rank: int, world_size: int, init_method: str):
    _STATE.update(rank=rank, world_size=world_size)
    yield


def _setup_fails_on_rank1(rank: int, world_size: int, init_method: str):
    if rank == 1:
        raise RuntimeError("rank 1 cannot come up")
    yield


def _teardown_fails_on_rank1(rank: int, world_size: int, init_method: str):
    _STATE.update(rank=rank, world_size=world_size)
    yield
    if rank == 1:
        raise RuntimeError("rank 1 cannot go down")


def _whoami(*args: object) -> tuple[object, ...]:
    return (_STATE["rank"], _STATE["world_size"], os.getpid(), args)


def _raise_in_scenario() -> None:
    raise ValueError("scenario went wrong")


def _exit_in_scenario() -> None:
    os._exit(7)


def _kill_then_hang(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _sleep_forever()


def _break_the_group() -> str:
    _STATE["broken"] = True
    return "passed"


def _group_check() -> None:
    assert not _STATE.get("broken"), "the scenario left this rank broken"


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


@pytest.mark.processes
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


@pytest.mark.processes
def test_given_init_method_is_passed_through() -> None:
    results = run_workers(_report, 2, timeout=30, init_method="file:///tmp/rdv")
    assert [r[2] for r in results] == ["file:///tmp/rdv"] * 2  # type: ignore[index]


@pytest.mark.processes
def test_env_is_set_before_the_target_module_is_imported() -> None:
    results = run_workers(_env_seen, 2, timeout=30, env={_ENV_KEY: "set-by-test"})
    assert results == [("set-by-test", "set-by-test")] * 2


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
def test_rank_exiting_without_a_result_is_a_failure() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_exit_hard, 1, timeout=30)
    assert "exited with code 3 without reporting" in info.value.failures[0]


@pytest.mark.processes
def test_unpicklable_result_is_a_failure() -> None:
    with pytest.raises(WorkerFailed) as info:
        run_workers(_return_unpicklable, 1, timeout=30)
    assert "does not pickle" in info.value.failures[0]


@pytest.mark.processes
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


@pytest.mark.processes
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


def _spin_in_a_thread(port: int) -> None:
    threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
    time.sleep(60)


@pytest.mark.processes
def test_sigstop_returns_once_every_thread_is_stopped() -> None:
    """Also a spinning thread, which would go on running for a while after
    a bare kill on a loaded machine."""
    proc = spawn_worker(_spin_in_a_thread, free_port())
    try:
        assert proc.pid is not None
        time.sleep(0.3)  # the spinner started
        sigstop(proc.pid)
        states = thread_states(proc.pid)
        assert len(states) >= 2 and all(s in "tT" for s in states), states
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        stop_worker(proc)
    _assert_no_children()


# ---- the group ---------------------------------------------------------------


def _alive(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.processes
def test_a_group_runs_scenarios_on_rank_0_of_ranks_it_keeps_up(tmp_path: Path) -> None:
    group = WorkerGroup(_group_setup, 2, args=(str(tmp_path),))
    try:
        assert group.pids == []  # nothing starts before the first scenario
        first = group.run(_whoami, 1, "a")
        second = group.run(_whoami)
        pids = group.pids
        assert first == (0, 2, pids[0], (1, "a"))
        assert second == (0, 2, pids[0], ())
        assert group.starts == 1 and all(_alive(pid) for pid in pids)
        assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
            f"up-{rank}-{pid}" for rank, pid in enumerate(pids))
        group.close()  # each rank runs the rest of its setup, then exits
        assert sorted(f.name.split("-")[0] for f in tmp_path.iterdir()) == ["down"] * 2 + ["up"] * 2
        assert not any(_alive(pid) for pid in pids) and group.pids == []
        group.close()  # idempotent
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_failing_scenario_surfaces_its_traceback_and_the_next_gets_a_fresh_group() -> None:
    group = WorkerGroup(_plain_setup, 2)
    try:
        group.run(_whoami)
        before = group.pids
        with pytest.raises(ScenarioFailed) as info:
            group.run(_raise_in_scenario)
        assert info.value.scenario == "_raise_in_scenario"
        assert "ValueError: scenario went wrong" in info.value.text
        assert "_raise_in_scenario" in str(info.value)  # a real traceback
        assert not any(_alive(pid) for pid in before) and group.pids == []
        assert group.run(_whoami)[:2] == (0, 2)  # type: ignore[index]
        assert group.starts == 2 and group.pids[0] not in before
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_scenario_past_its_deadline_is_stopped_with_every_ranks_stacks() -> None:
    group = WorkerGroup(_plain_setup, 2)
    try:
        group.run(_whoami)
        started = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            group.run(_sleep_forever, timeout=1.0)
        assert time.monotonic() - started < 1.0 + 4.0
        assert info.value.ranks == [0]
        assert "_sleep_forever" in info.value.stacks[0]
        assert "_serve_rank" in info.value.stacks[1]  # rank 1, waiting for the parent
        assert group.pids == []
        assert group.run(_whoami)[:2] == (0, 2)  # type: ignore[index]
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_rank_that_dies_fails_the_scenario_naming_it() -> None:
    group = WorkerGroup(_plain_setup, 2)
    try:
        with pytest.raises(WorkerFailed) as info:
            group.run(_exit_in_scenario)
        assert "exited with code 7" in info.value.failures[0]
        assert "while running _exit_in_scenario" in info.value.failures[0]
        group.run(_whoami)  # a fresh group
        rank1 = group.pids[1]
        with pytest.raises(WorkerFailed) as info:
            group.run(_kill_then_hang, rank1)
        assert list(info.value.failures) == [1]
        assert "SIGKILL" in info.value.failures[1]
        assert "_kill_then_hang" in info.value.stopped[0]  # rank 0, where it was
        assert group.run(_whoami)[:2] == (0, 2)  # type: ignore[index]
        assert group.starts == 3
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_scenario_that_leaves_the_group_broken_fails_and_the_next_gets_a_fresh_group() -> None:
    group = WorkerGroup(_plain_setup, 2, check=_group_check)
    try:
        assert group.run(_whoami)[:2] == (0, 2)  # type: ignore[index]
        with pytest.raises(ScenarioFailed) as info:
            group.run(_break_the_group)
        assert "left the group unfit" in str(info.value)
        assert "the scenario left this rank broken" in info.value.text
        assert group.run(_whoami)[:2] == (0, 2)  # type: ignore[index]
        assert group.starts == 2
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_group_that_cannot_start_fails_every_scenario_with_that_failure() -> None:
    group = WorkerGroup(_setup_fails_on_rank1, 2)
    try:
        with pytest.raises(WorkerFailed) as info:
            group.run(_whoami)
        assert "RuntimeError: rank 1 cannot come up" in info.value.failures[1]
        with pytest.raises(WorkerFailed) as again:
            group.run(_whoami)  # not started again
        assert again.value is info.value and group.starts == 1
    finally:
        group.close()
    _assert_no_children()


@pytest.mark.processes
def test_a_rank_that_fails_on_its_way_down_fails_close() -> None:
    group = WorkerGroup(_teardown_fails_on_rank1, 2)
    try:
        group.run(_whoami)
        pids = group.pids
        with pytest.raises(WorkerFailed, match="rank 1 cannot go down"):
            group.close()
        assert not any(_alive(pid) for pid in pids)
    finally:
        group.close()
    _assert_no_children()


def test_setups_and_scenarios_must_be_module_level() -> None:
    def setup(rank: int, world_size: int, init_method: str):
        yield

    with pytest.raises(TypeError, match="module-level"):
        WorkerGroup(setup, 2)
    group = WorkerGroup(_plain_setup, 2)
    with pytest.raises(TypeError, match="module-level"):
        group.run(lambda: None)
    assert group.pids == [] and group.starts == 0
    _assert_no_children()


# One group for the two tests below, as a test module shares its group.
pair = worker_group(_plain_setup, 2)
_PAIR_PIDS: set[int] = set()


@pytest.mark.processes
def test_the_fixture_gives_a_group_kept_up_for_the_module(pair: WorkerGroup) -> None:
    _PAIR_PIDS.add(pair.run(_whoami)[2])  # type: ignore[index]
    assert pair.starts == 1 and len(_PAIR_PIDS) == 1


@pytest.mark.processes
def test_the_fixture_gives_the_next_test_the_same_ranks(pair: WorkerGroup) -> None:
    _PAIR_PIDS.add(pair.run(_whoami)[2])  # type: ignore[index]
    assert pair.starts == 1 and len(_PAIR_PIDS) == 1
