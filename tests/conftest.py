"""Test-suite wiring shared by every test.

Markers (``gpu``, ``slow``), the per-test timeout and strictness live in
pyproject.toml; this file adds:

* GPU detection: tests marked ``gpu`` are skipped, with the reason, when
  ``torch.cuda.is_available()`` is false. Torch is imported only when such a
  test was collected. With ``UCXRPC_REQUIRE_GPU=1`` (a run on a GPU machine,
  e.g. benchmarks/gpu_check.sh) a ``gpu`` test that skips, for that reason
  or any other, fails instead: a skip there means a broken GPU setup (a
  CPU-only torch, a driver too old for it, ``CUDA_VISIBLE_DEVICES=""``),
  not a pass.
* A check after each test module that it left no child process running; any
  leftover is killed and the module gets an error naming it.
* A run that selects exactly the ``gpu`` marker (``pytest -m gpu``) does
  not import test modules that hold no ``gpu`` test: a GPU machine then
  needs only what the GPU tests need, not the Docker or fuzz tests'
  dependencies (jsonschema, yaml, hypothesis).  Such a module could only
  have been deselected whole.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time
from collections.abc import Generator, Iterator
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
