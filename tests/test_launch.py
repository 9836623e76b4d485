"""Tests of ucxrpc/_launch.py, the launcher of the tests, the bench and the
examples, with real child processes and trivial targets (no torch, no UCX).

Every test bounds its waits and stops what it started by pid in ``finally``.
"""

from __future__ import annotations

import ast
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The `from` form: a child has this module without the ucxrpc package.
from ucxrpc._launch import LIFETIME_EXIT_CODE, spawn, start, stop_process

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "ucxrpc" / "_launch.py"
_ENV_KEY = "UCXRPC_TEST_LAUNCH"
# Read at import on purpose: a child imports this module after the launcher
# has applied its environment.
_ENV_AT_IMPORT = os.environ.get(_ENV_KEY)


# ---- targets (module level, so spawned children can import them) ----------


def _report(rank: int, extra: str) -> tuple[object, ...]:
    # Higher ranks finish first, so rank order cannot come from arrival order.
    time.sleep(0.05 * (3 - rank))
    heavy = sorted(m for m in ("torch", "ucxrpc") if m in sys.modules)
    return rank, extra, os.getpid(), _ENV_AT_IMPORT, heavy


def _environ(rank: int, keys: tuple[str, ...]) -> tuple[object, ...]:
    heavy = sorted(m for m in ("torch", "ucxrpc", "ucxx") if m in sys.modules)
    return _ENV_AT_IMPORT, {k: os.environ.get(k) for k in keys}, heavy


def _fail_on_odd(rank: int) -> int:
    if rank % 2:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _exit_hard(rank: int) -> None:
    os._exit(3)


def _sleep_forever(*_: object) -> None:
    while True:
        time.sleep(3600)


def _fail_rank0_hang_others(rank: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    _sleep_forever()


def _ignore_sigterm_and_hang(ready: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ready).write_text("ready")
    _sleep_forever()


# ---- helpers -------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs: no such process, or a zombie (killed,
    waiting for a parent that is not ours to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].split()[0] in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for every pid to be gone; return those still running."""
    end = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if not _gone(pid)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.05)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- tests -------------------------------------------------------------------


@pytest.mark.processes
def test_ranks_run_and_report_in_rank_order() -> None:
    with start(_report, [(rank, "extra") for rank in range(3)],
               env={_ENV_KEY: "set"}) as ranks:
        pids = [p.pid for p in ranks.procs]
        outcomes = ranks.collect(30)
    assert [out.rank for out in outcomes] == [0, 1, 2]
    assert all(out.ok and out.exitcode == 0 for out in outcomes), outcomes
    values = [out.value for out in outcomes]
    assert [v[:2] for v in values] == [(0, "extra"), (1, "extra"), (2, "extra")]  # type: ignore[index]
    assert [v[2] for v in values] == pids  # type: ignore[index]
    # env applied before the target's module was imported, and the child
    # got there without importing the ucxrpc package (torch)
    assert all(v[3] == "set" for v in values), values  # type: ignore[index]
    assert all(v[4] == [] for v in values), values  # type: ignore[index]
    assert _wait_gone(pids, 0) == []


@pytest.mark.processes
def test_a_failing_rank_error_text_comes_back() -> None:
    with start(_fail_on_odd, [(rank,) for rank in range(3)]) as ranks:
        outcomes = ranks.collect(30)
    assert [out.ok for out in outcomes] == [True, False, True]
    assert [out.value for out in outcomes if out.ok] == [0, 2]
    failed = outcomes[1]
    assert failed.reported and failed.exitcode == 1
    assert failed.error is not None
    assert "ValueError: boom from rank 1" in failed.error
    assert "_fail_on_odd" in failed.error  # a traceback, not just the message


@pytest.mark.processes
def test_a_rank_that_dies_without_reporting_says_how() -> None:
    with start(_exit_hard, [(0,)]) as ranks:
        (out,) = ranks.collect(30)
    assert not out.reported and out.exitcode == 3
    assert out.error == "process exited with code 3 without reporting a result"


@pytest.mark.processes
def test_a_hanging_rank_is_stopped_within_a_bound_and_its_pid_is_gone(tmp_path: Path) -> None:
    ready = [tmp_path / f"rank{rank}.ready" for rank in range(2)]
    ranks = start(_ignore_sigterm_and_hang, [(str(path),) for path in ready])
    try:
        pids = [p.pid for p in ranks.procs]
        end = time.monotonic() + 30
        while not all(path.exists() for path in ready) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(path.exists() for path in ready), "the ranks did not start within 30 s"
        began = time.monotonic()
        outcomes = ranks.collect(0.5)
        assert time.monotonic() - began < 0.5 + 2.0
        assert [out.running for out in outcomes] == [True, True]
        began = time.monotonic()
        ranks.stop(timeout=0.5)  # SIGTERM is ignored: SIGKILL after 0.5 s
        assert time.monotonic() - began < 0.5 + 3.0
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.procs] == [-signal.SIGKILL] * 2
    assert _wait_gone(pids, 0) == []  # type: ignore[arg-type]
    ranks.stop()  # idempotent


@pytest.mark.processes
def test_failure_grace_ends_the_wait_soon_after_a_failure() -> None:
    with start(_fail_rank0_hang_others, [(0,), (1,)]) as ranks:
        began = time.monotonic()
        outcomes = ranks.collect(30, failure_grace=0.5)
        waited = time.monotonic() - began
        assert outcomes[0].error is not None and "rank 0 gives up" in outcomes[0].error
        assert outcomes[1].running and outcomes[1].error is None
        # start-up (seconds on a busy machine) + the grace, well before 30 s
        assert waited < 15.0


@pytest.mark.processes
def test_a_forked_rank_gets_the_callers_environment_with_torch_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with start(_environ, [(0, ())], method="forkserver") as ranks:  # the server runs now
        assert ranks.collect(60)[0].ok
    # Changed after the server started: a forked child must see the caller's
    # environment at its start, as a spawned one does, not the server's.
    monkeypatch.setenv("UCXRPC_TEST_LAUNCH_LATER", "later")
    monkeypatch.delenv("UCXRPC_TEST_LAUNCH_GONE", raising=False)
    keys = ("UCXRPC_TEST_LAUNCH_LATER", "UCXRPC_TEST_LAUNCH_GONE", _ENV_KEY)
    with start(_environ, [(rank, keys) for rank in range(2)], env={_ENV_KEY: "set"},
               method="forkserver") as ranks:
        outcomes = ranks.collect(60)
    assert all(out.ok for out in outcomes), outcomes
    want = ("set", {"UCXRPC_TEST_LAUNCH_LATER": "later", "UCXRPC_TEST_LAUNCH_GONE": None,
                    _ENV_KEY: "set"}, ["torch"])  # env first; torch alone preloaded
    assert [out.value for out in outcomes] == [want, want]


@pytest.mark.processes
def test_a_process_has_ended_once_it_is_a_zombie_or_gone() -> None:
    # What a forked child's watch on its starter decides by (a sandbox's
    # pidfd may wake early, and without one it is polled).
    from ucxrpc._launch import _ended

    assert not _ended(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        end = time.monotonic() + 30
        while not _ended(child.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert _ended(child.pid)  # exited, not yet reaped: a zombie
    finally:
        child.wait(10)
    assert _ended(child.pid)  # reaped: gone


def test_an_unknown_start_method_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="start method must be one of .*got 'fork'"):
        start(_report, [(0, "")], method="fork")


@pytest.mark.processes
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_process_exits_when_its_lifetime_is_over(method: str) -> None:
    proc = spawn(_sleep_forever, lifetime=1.0, method=method)
    try:
        proc.join(30)
        assert proc.exitcode == LIFETIME_EXIT_CODE
    finally:
        stop_process(proc)
    assert proc.pid is not None and _gone(proc.pid)


# A parent that starts two hanging ranks, prints their pids and waits to be
# killed. It loads the launcher as a child does, by path, to skip torch.
_PARENT = f"""
import importlib.util, sys, time
sys.path.insert(0, {str(REPO)!r})
spec = importlib.util.spec_from_file_location("ucxrpc._launch", {str(LAUNCH)!r})
launch = importlib.util.module_from_spec(spec)
sys.modules["ucxrpc._launch"] = launch
spec.loader.exec_module(launch)
from multiprocessing import forkserver
from tests.test_launch import _sleep_forever
ranks = launch.start(_sleep_forever, [(0,), (1,)], method=sys.argv[1])
server = getattr(forkserver._forkserver, "_forkserver_pid", None)
print(*(p.pid for p in ranks.procs), *([server] if server else []), flush=True)
time.sleep(60)
"""


@pytest.mark.processes
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_children_die_when_their_parent_is_sigkilled(method: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, method], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 30)
        assert ready, "the parent did not start its children within 30 s"
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == (2 if method == "spawn" else 3)  # and the server
        assert _wait_gone(pids, 0) == pids  # running, before the parent dies
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(pids, 10) == [], "orphans left behind"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait(10)
        _kill([pid for pid in pids if not _gone(pid)])
        if parent.stdout is not None:
            parent.stdout.close()


def test_the_launcher_imports_only_the_standard_library() -> None:
    # A child runs it before it has the package (see its docstring).
    tree = ast.parse(LAUNCH.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in {LAUNCH.name}: line {node.lineno}"
            imported.add((node.module or "").split(".")[0])
    assert imported - set(sys.stdlib_module_names) == set()


def test_free_ports_lie_below_the_ephemeral_range_and_are_not_given_twice() -> None:
    # Below it, no connect() gets one as its source port: a client of a
    # store whose server was not yet listening once connected to itself
    # there, and the server's bind failed (EADDRINUSE).
    import socket

    from ucxrpc._launch import _ephemeral_start, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), ports
    assert all(20000 <= p < _ephemeral_start() for p in ports), ports
    with socket.socket() as s:  # and it is free
        s.bind(("127.0.0.1", ports[-1]))
