"""A network partition between two hosts (network namespaces).

worker0 (and the rendezvous store) run on host A, worker1 on host B
(:mod:`ucxrpc.bench.netns`: network namespaces joined by a veth pair, each
worker in namespaces of its own), over TCP only.  Once both have exchanged calls, the
link goes down: a call across it fails on each side, naming the other
worker, once TCP keepalive on the lifeline has gone unanswered for
``peer_timeout`` (no FIN comes from a host that vanished).  Then (see :mod:`tests.faults._netns_worker`):

* ``heal``: worker0 shuts down during the partition; the link comes back and
  worker1, whose store went away with worker0, shuts down too;
* ``cut-off``: worker1 shuts down during the partition, cut off from the
  store, with ``shutdown(timeout=2)``, which must hold;
* ``rejoin`` (dynamic membership, ``world_size=None``): the link comes back,
  worker1 leaves and joins again under the same name and rank, and calls
  work both ways again.

The three run at once, each between hosts of its own (``scenarios``); each
test checks its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults import _common as c
from tests.faults._netns_worker import CUT_OFF_SHUTDOWN_TIMEOUT_S, write
from ucxrpc._launch import free_port
from ucxrpc.bench.netns import Hosts, Unavailable

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
#: How long the test waits for a worker's next step.
STEP_WAIT_S = 30.0
#: How long worker1's shutdown(timeout=2), cut off from the store, may take.
CUT_OFF_SHUTDOWN_BOUND_S = CUT_OFF_SHUTDOWN_TIMEOUT_S + 10.0


class _Job:
    """The two workers, one on each host (:meth:`Hosts.popen`: its own
    namespaces, dying with the test); killed in :meth:`stop`."""

    def __init__(self, hosts: Hosts, ctl: Path, mode: str) -> None:
        self.hosts = hosts
        self.ctl = ctl
        self.mode = mode
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        init_method = f"tcp://{self.hosts.hosts[0].address}:{free_port()}"
        for rank, host in enumerate(self.hosts.hosts):
            env = dict(os.environ, UCX_NET_DEVICES=host.veth, PYTHONPATH=str(REPO))
            with open(self.ctl / f"worker{rank}.log", "w") as log:
                self.procs.append(self.hosts.popen(
                    host, [sys.executable, "-m", "tests.faults._netns_worker", str(self.ctl),
                           str(rank), init_method, self.mode],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))

    def cut(self) -> None:
        """Start both workers, wait until they exchanged calls, then take the
        link down and tell them when."""
        self.start()
        self.wait_for("ready0")
        self.wait_for("ready1")
        self.hosts.set_link(self.hosts.hosts[0], False)
        write(self.ctl / "down", repr(time.monotonic()))

    def wait_for(self, name: str, timeout: float = STEP_WAIT_S) -> str:
        """The contents of control file ``name`` once a worker wrote it; fails
        the test, with every thread's stack of the workers still running,
        when it does not come in time or a worker exits without it."""
        path = self.ctl / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None and not (self.ctl / f"result{rank}.json").exists():
                    pytest.fail(f"worker{rank} exited with {proc.returncode} before writing "
                                f"{name}:\n{self.logs()}")
            if time.monotonic() > deadline:
                self.dump_stacks()
                pytest.fail(f"{name} did not come within {timeout} s (worker stacks in the "
                            f"logs):\n{self.logs()}")
            time.sleep(0.05)
        return path.read_text()

    def result(self, rank: int, timeout: float = STEP_WAIT_S) -> dict:
        out = json.loads(self.wait_for(f"result{rank}.json", timeout))
        if "error" in out:
            pytest.fail(f"worker{rank} failed:\n{out['error']}\n{self.logs()}")
        return out

    def dump_stacks(self) -> None:
        # To the worker itself: the Popen is `unshare`, which SIGUSR1 kills.
        for proc in self.procs:
            pid = self.hosts.worker_pid(proc)
            if pid is not None:
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-6000:]}"
                         for p in sorted(self.ctl.glob("worker*.log")))

    def wait_exit(self) -> None:
        """Both workers exit, with status 0, once they wrote their results."""
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=STEP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.dump_stacks()
                pytest.fail(f"worker{rank} did not exit after its result:\n{self.logs()}")
            assert code == 0, f"worker{rank} exited with {code}:\n{self.logs()}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _heal_or_cut_off(hosts: Hosts, ctl: Path, mode: str) -> tuple[dict, dict]:
    a, _ = hosts.hosts
    job = _Job(hosts, ctl, mode)
    try:
        job.cut()
        r0 = job.result(0)  # worker0 shuts down during the partition
        job.wait_for("detected1")
        if mode == "heal":
            hosts.set_link(a, True)
            write(ctl / "up", "1")
            r1 = job.result(1)
        else:
            r1 = job.result(1, timeout=CUT_OFF_SHUTDOWN_BOUND_S + 5)
        job.wait_exit()
    finally:
        job.stop()
    return r0, r1


def _rejoin(hosts: Hosts, ctl: Path, mode: str) -> tuple[dict, dict]:
    a, _ = hosts.hosts
    job = _Job(hosts, ctl, mode)
    try:
        job.cut()
        job.wait_for("detected0")
        job.wait_for("detected1")
        hosts.set_link(a, True)
        write(ctl / "up", "1")
        r1 = job.result(1)
        r0 = job.result(0)
        job.wait_exit()
    finally:
        job.stop()
    return r0, r1


_SCENARIOS = {"heal": _heal_or_cut_off, "cut-off": _heal_or_cut_off, "rejoin": _rejoin}


def _mode_of(item: pytest.Item) -> str:
    """The scenario a test of this module checks."""
    callspec = getattr(item, "callspec", None)
    return callspec.params["mode"] if callspec is not None else "rejoin"


@pytest.fixture(scope="module")
def scenarios(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The scenarios of the tests selected in this module, each on hosts A
    and B of its own, all run at once (one thread each); mode -> the future
    of its two workers' results, which its test checks.  A scenario mostly
    waits: for keepalive to find the partition, for a shutdown cut off from
    the store; one after another they waited in turn.  Skipped where the
    hosts cannot be made."""
    selected = {_mode_of(item) for item in request.session.items
                if getattr(item, "module", None) is request.module}
    modes = [mode for mode in _SCENARIOS if mode in selected]
    pairs: dict[str, Hosts] = {}
    try:
        try:
            for mode in modes:
                pairs[mode] = Hosts().__enter__()
        except Unavailable as exc:
            pytest.skip(str(exc))
        with ThreadPoolExecutor(len(pairs)) as pool:
            yield {mode: pool.submit(_SCENARIOS[mode], pairs[mode],
                                     tmp_path_factory.mktemp(mode), mode) for mode in modes}
    finally:  # (the pool's exit waited for every scenario, each of which stops its workers)
        for pair in pairs.values():
            pair.close()


@pytest.mark.parametrize("mode", ["heal", "cut-off"])
def test_partition(scenarios, mode):
    r0, r1 = scenarios[mode].result()
    print(f"\n  partition (veth down, {mode}) over {r0['pipes']}:")
    _check_partition(r0, r1)
    c.check_shutdown(r0["shutdown_s"], "worker0 (during the partition)")
    if mode == "heal":
        c.check_shutdown(r1["shutdown_s"], "worker1 (link back, the store gone with worker0)")
    else:
        print(f"  worker1 (cut off from the store) shutdown(timeout="
              f"{CUT_OFF_SHUTDOWN_TIMEOUT_S:g}): {r1['shutdown_s']:.2f} s")
        assert r1["shutdown_s"] < CUT_OFF_SHUTDOWN_BOUND_S


def test_partition_then_rejoin(scenarios):
    r0, r1 = scenarios["rejoin"].result()
    print("\n  partition (veth down) of a dynamic group, then worker1 rejoins:")
    _check_partition(r0, r1)
    print(f"  worker1 left in {r1['leave_s']:.2f} s and joined again in {r1['rejoin_s']:.2f} s")
    c.check_shutdown(r1["leave_s"], "worker1 (leaving the group after the partition)")
    c.check_shutdown(r1["shutdown_s"], "worker1 (rejoined)")
    c.check_shutdown(r0["shutdown_s"], "worker0")


def _check_partition(r0: dict, r1: dict) -> None:
    c.check_failure(r0["call"], "worker1", "worker0 -> worker1 across the partition",
                    bound=c.PARTITION_BOUND_S)
    c.check_failure(r1["call"], "worker0", "worker1 -> worker0 across the partition",
                    bound=c.PARTITION_BOUND_S)
    c.check_failure(r0["later"], "worker1", "worker0 later call", bound=1.0)
    c.check_failure(r1["later"], "worker0", "worker1 later call", bound=1.0)
