"""Test-suite wiring shared by every test.

Markers (``gpu``, ``slow``, ``processes``), the per-test timeout and
strictness live in pyproject.toml; this file adds:

* GPU detection: tests marked ``gpu`` are skipped, with the reason, when
  ``torch.cuda.is_available()`` is false. Torch is imported only when such a
  test was collected. With ``UCXRPC_REQUIRE_GPU=1`` (a run on a GPU machine,
  e.g. benchmarks/gpu_check.sh) a ``gpu`` test that skips, for that reason
  or any other, fails instead: a skip there means a broken GPU setup (a
  CPU-only torch, a driver too old for it, ``CUDA_VISIBLE_DEVICES=""``),
  not a pass.
* A check after each test module that it left no child process running; any
  leftover is killed and the module gets an error naming it.
* The ``processes`` marker kept honest: a test that starts a process (in its
  setup, its body or its teardown; through multiprocessing, subprocess,
  ``os.fork``, ``os.posix_spawn`` or ``os.system``) without carrying the
  marker fails, naming what it started, so ``pytest -m "not processes"``
  (the quick loop) runs no process at all.
* A run that selects exactly the ``gpu`` marker (``pytest -m gpu``) does
  not import test modules that hold no ``gpu`` test: a GPU machine then
  needs only what the GPU tests need, not the Docker or fuzz tests'
  dependencies (jsonschema, yaml, hypothesis).  Such a module could only
  have been deselected whole.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import multiprocessing
import multiprocessing.process
import os
import platform
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Generator, Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from tests.workers import child_pids, forkserver_pid

# How long children of a finished module get to exit on their own before
# they count as left behind.
_LEFTOVER_GRACE_S = 2.0


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """Return why CUDA cannot be used here, or None when a CUDA GPU is usable."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return f"needs a CUDA GPU: torch does not import ({exc})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    return None


def gpu_required() -> bool:
    """Whether this run must have a GPU (``UCXRPC_REQUIRE_GPU=1``)."""
    return os.environ.get("UCXRPC_REQUIRE_GPU") == "1"


@pytest.fixture(scope="session")
def cuda_available() -> bool:
    """Whether a CUDA GPU is usable in this session."""
    return cuda_unavailable_reason() is None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (config.getoption("markexpr", "").strip() == "gpu" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        try:
            return "mark.gpu" not in collection_path.read_text(encoding="utf-8")
        except OSError:
            return None
    return None


_COMPAT = Path(__file__).parent / "compat"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tests/compat/ is kept as torch's suites need it (and by its owner):
    # its sample runs torch's tests in a child process, so it is marked here.
    for item in items:
        if item.path.is_relative_to(_COMPAT):
            item.add_marker(pytest.mark.processes)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str | None:
    if gpu_required():
        return "UCXRPC_REQUIRE_GPU=1: a gpu test that skips fails"
    return None


# ------------------------------------------------ the processes marker, kept honest


class _Starts:
    """Every process this test process starts, noted as it starts.

    The entry points are wrapped once for the session: a multiprocessing
    ``Process.start`` (any start method: a forkserver's child is forked by
    the server, not here), ``subprocess.Popen``, the fork/exec that
    multiprocessing uses for its own helpers (``spawn``, the forkserver, the
    resource tracker), ``os.fork``, ``os.forkpty``, ``os.posix_spawn[p]``
    and ``os.system``.  A log, not a look at live children: a process that
    started and ended within the test counts too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[str] = []

    def note(self, what: str) -> None:
        with self._lock:
            self._log.append(what)

    def mark(self) -> int:
        with self._lock:
            return len(self._log)

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return self._log[mark:]

    def install(self) -> None:
        def wrap(owner: object, name: str, describe: Callable[..., str]) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return

            @functools.wraps(original)
            def noted(*args: object, **kwargs: object) -> object:
                try:
                    what = describe(*args, **kwargs)
                except Exception:  # never let the bookkeeping stop the start
                    what = name
                self.note(what[:200])
                return original(*args, **kwargs)

            setattr(owner, name, noted)

        wrap(multiprocessing.process.BaseProcess, "start",
             lambda proc: f"multiprocessing process {proc.name!r}")
        wrap(subprocess.Popen, "_execute_child", lambda popen, args, *rest: f"subprocess {args!r}")
        wrap(_posixsubprocess, "fork_exec",
             lambda args, *rest: "fork/exec " + " ".join(map(os.fsdecode, args or ())))
        for name in ("fork", "forkpty"):
            wrap(os, name, lambda *a, _n=name: f"os.{_n}()")
        for name in ("posix_spawn", "posix_spawnp", "system"):
            wrap(os, name, lambda cmd, *a, _n=name, **k: f"os.{_n}({cmd!r})")


_STARTS = _Starts()
_STARTS_MARK = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # The standard library's own lazy child: platform runs `uname -p` the
    # first time anything asks for the processor (the bench's host record
    # does), then caches it.  Asked here, it counts against no test.
    platform.processor()
    _STARTS.install()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_STARTS_MARK] = _STARTS.mark()
    return (yield)


def _unmarked_starts(item: pytest.Item) -> str | None:
    """Why this test fails for starting processes unmarked, or None."""
    if item.get_closest_marker("processes") is not None or _STARTS_MARK not in item.stash:
        return None
    started = _STARTS.since(item.stash[_STARTS_MARK])
    item.stash[_STARTS_MARK] = _STARTS.mark()
    if not started:
        return None
    return (f"this test started {len(started)} process(es) without the 'processes' marker "
            "(mark it @pytest.mark.processes, or the module with pytestmark): "
            + "; ".join(started[:3]) + ("; ..." if len(started) > 3 else ""))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if (gpu_required() and report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("gpu") is not None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"UCXRPC_REQUIRE_GPU=1, yet this gpu test skipped: {reason}"
    # After the body (counting the setup) and after the teardown: the first
    # phase that saw an unmarked start fails.  A setup that failed or
    # skipped has no call phase: its starts are found at the teardown.
    if call.when in ("call", "teardown") and not report.failed:
        why = _unmarked_starts(item)
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why
    return report


def _exempt_pids() -> set[int]:
    """Long-lived helpers multiprocessing starts once per session by design."""
    exempt = set()
    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    if tracker_pid:
        exempt.add(tracker_pid)
    server_pid = forkserver_pid()
    if server_pid:
        exempt.add(server_pid)
    return exempt


def _leftover_children() -> list[int]:
    multiprocessing.active_children()  # reaps multiprocessing children that ended
    exempt = _exempt_pids()
    # The workers tests/workers.py starts are the forkserver's children.
    server_pid = forkserver_pid()
    forked = child_pids(server_pid) if server_pid else []
    return [pid for pid in child_pids() + forked if pid not in exempt]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        multiprocessing.active_children()
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped by whoever owns it
        if done:
            return
        time.sleep(0.02)


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_children() -> Iterator[None]:
    """Fail the module that leaves a child process running, and kill that child."""
    before = set(_leftover_children())
    yield
    deadline = time.monotonic() + _LEFTOVER_GRACE_S
    leftovers = [pid for pid in _leftover_children() if pid not in before]
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.05)
        leftovers = [pid for pid in _leftover_children() if pid not in before]
    if not leftovers:
        return
    described = [f"pid {pid}: {_cmdline(pid)}" for pid in leftovers]
    for pid in leftovers:
        _kill_and_reap(pid)
    pytest.fail(
        "this module left child processes running (now killed); stop them in a finally:\n  "
        + "\n  ".join(described),
        pytrace=False,
    )
