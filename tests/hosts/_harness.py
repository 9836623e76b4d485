"""The test side of the two-host tier: make the hosts, start workers on
them, wait for what they write, stop them.

Workers (:mod:`tests.hosts._worker`) are exec'd inside the hosts' namespaces
(a process forked from the test could not enter them), with the repository
as their working directory and ``PYTHONPATH``; they talk to the test through
files in a control directory.  Every wait has a deadline; a worker that
hangs gets SIGUSR1 (every thread's stack into its log) before the test
fails with the logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ucxrpc.bench.netns import Host, Hosts, Unavailable

REPO = Path(__file__).resolve().parents[2]
#: How long the test waits for a worker's next step by default.
STEP_WAIT_S = 60.0
#: Any port is free on a brand-new host: the store's, for every job.
STORE_PORT = 29500


@contextmanager
def two_hosts(tag: str = "ucxh") -> Iterator[Hosts]:
    """Two simulated hosts, deleted after; the test skips where they cannot be made."""
    hosts = Hosts(tag)
    try:
        hosts.__enter__()
    except Unavailable as exc:
        pytest.skip(f"simulated hosts unavailable: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()


def write(path: Path, text: str) -> None:
    """Write ``path`` at once (a reader never sees it half written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment for a worker: the repository importable, no
    launcher variables of an enclosing job."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "UCX_TLS", "UCX_NET_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # A worker that crashes in native code leaves its threads' stacks in
    # its log (a SIGSEGV's exit code alone says nothing of where).
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(extra or {})
    return env


class Job:
    """Processes started on the hosts, by name; their logs in ``ctl``.

    :meth:`stop` kills what still runs (by the Popen objects made here)."""

    def __init__(self, hosts: Hosts, ctl: Path) -> None:
        self.hosts = hosts
        self.ctl = ctl
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()  # killed on purpose: their exit is no failure

    def start(self, name: str, host: Host, argv: Sequence[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in the repository, its output in ``<name>.log``."""
        with open(self.ctl / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            proc = self.hosts.popen(host, argv, env=env or worker_env(), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_worker(self, name: str, host: Host, *args: object) -> subprocess.Popen:
        """``python -m tests.hosts._worker CTL ARGS...`` on ``host``."""
        return self.start_worker_module("tests.hosts._worker", name, host, *args)

    def start_worker_module(self, module: str, name: str, host: Host,
                            *args: object) -> subprocess.Popen:
        """``python -m MODULE CTL ARGS...`` on ``host``."""
        return self.start(name, host, [sys.executable, "-m", module, str(self.ctl),
                                       *map(str, args)])

    def wait_for(self, file: str, timeout: float = STEP_WAIT_S) -> str:
        """The contents of control file ``file`` once a worker wrote it; fails
        the test, with the logs, when a process exits before (unless killed
        on purpose or done) or it does not come in time."""
        path = self.ctl / file
        deadline = time.monotonic() + timeout
        while not path.exists():
            for name, proc in self.procs.items():
                if proc.poll() is not None and not self._done(name) and not path.exists():
                    pytest.fail(f"{name} exited with {proc.returncode} before {file} came:\n"
                                f"{self.logs()}")
            if time.monotonic() > deadline:
                self.dump_stacks()
                pytest.fail(f"{file} did not come within {timeout:g} s (the workers' stacks "
                            f"are in their logs):\n{self.logs()}")
            time.sleep(0.05)
        return path.read_text()

    def _done(self, name: str) -> bool:
        """Whether ``name`` may have exited: killed on purpose, or it wrote
        its final ``<name>.json`` without an error (a worker that failed
        writes no more files: waiting for one is pointless)."""
        if name in self.killed:
            return True
        try:
            return "error" not in json.loads((self.ctl / f"{name}.json").read_text())
        except (OSError, ValueError):  # none (torchrun's nodes write none either)
            return False

    def json(self, file: str, timeout: float = STEP_WAIT_S) -> dict[str, Any]:
        """Control file ``file`` (JSON); fails the test if it holds an error."""
        out = json.loads(self.wait_for(file, timeout))
        if "error" in out:
            pytest.fail(f"{file}: the worker failed:\n{out['error']}\n{self.logs()}")
        return out

    def kill(self, name: str) -> float:
        """SIGKILL ``name`` (its whole namespace goes with it) and return the
        monotonic time just before."""
        self.killed.add(name)
        t = time.monotonic()
        self.procs[name].kill()
        return t

    def wait_exit(self, name: str, timeout: float = STEP_WAIT_S) -> int:
        """``name``'s exit code; fails the test if it does not exit in time."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            pytest.fail(f"{name} did not exit within {timeout:g} s:\n{self.logs()}")

    def dump_stacks(self) -> None:
        """SIGUSR1 to every worker still running (each dumps its stacks)."""
        sent = False
        for proc in self.procs.values():
            pid = self.hosts.worker_pid(proc)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    sent = True
                except ProcessLookupError:
                    pass
        if sent:
            time.sleep(1.0)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-6000:]}"
                         for p in sorted(self.ctl.glob("*.log")))

    def stop(self) -> None:
        """Kill what still runs and reap it; idempotent, never raises."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
