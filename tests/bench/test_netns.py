"""``ucxrpc bench`` across two hosts, simulated by two network namespaces.

Namespaces A and B share no network but a veth pair with addresses in a
private test range, so every connection between the two ranks crosses that
link. Rank 0 runs in A and rank 1 in B, each started as torchrun would start
it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). UCX is held to tcp: the
namespaces share the IPC namespace, so UCX could otherwise pick shared
memory between them. Needs root and ``ip netns``; skipped with the reason
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.processes

REPO_ROOT = Path(__file__).resolve().parents[2]
_RUN_S = 110.0       # both ranks, all three series; rank 0's --timeout is below it
_IP_S = 20.0


@dataclass(frozen=True)
class _Side:
    netns: str
    dev: str
    addr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=_IP_S)


@pytest.fixture
def two_hosts() -> Iterator[tuple[_Side, _Side]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip command")
    tag = os.getpid() % 100_000
    subnet = f"10.213.{os.getpid() % 256}"
    a = _Side(f"ucxb{tag}a", f"vb{tag}a", f"{subnet}.1")
    b = _Side(f"ucxb{tag}b", f"vb{tag}b", f"{subnet}.2")
    try:
        _ip("netns", "add", a.netns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"ip netns add is not allowed here: {getattr(exc, 'stderr', exc)}")
    try:
        _ip("netns", "add", b.netns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for side in (a, b):
            _ip("link", "set", side.dev, "netns", side.netns)
            _ip("-n", side.netns, "addr", "add", f"{side.addr}/30", "dev", side.dev)
            _ip("-n", side.netns, "link", "set", "lo", "up")
            _ip("-n", side.netns, "link", "set", side.dev, "up")
        yield a, b
    finally:
        for side in (a, b):   # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", side.netns], capture_output=True,
                           timeout=_IP_S)
        subprocess.run(["ip", "link", "del", a.dev], capture_output=True, timeout=_IP_S)


def _start(side: _Side, rank: int, master: str, args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=master,
        # The namespaces are brand new and empty: no port there is taken.
        MASTER_PORT="29500",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        UCX_NET_DEVICES=side.dev, TP_SOCKET_IFNAME=side.dev, GLOO_SOCKET_IFNAME=side.dev)
    for key in ("UCX_TLS", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        env.pop(key, None)
    with open(cwd / f"rank{rank}.log", "w") as log:   # the child keeps its own descriptor
        return subprocess.Popen(
            ["ip", "netns", "exec", side.netns, sys.executable, "-m", "ucxrpc.bench", *args],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(procs: list[subprocess.Popen]) -> None:
    """Kill what is left of each rank's process group (its benchmark children too)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)


@pytest.mark.timeout(180)
def test_bench_runs_across_two_namespaces_over_the_veth(two_hosts, tmp_path):
    a, b = two_hosts
    rank0_args = ["--quick", "--transports", "tcp", "--compare", "torch", "--compare", "ucxx",
                  "--json", "r.json", "--no-plot", "--no-progress", "--timeout", "100"]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(a, 0, a.addr, rank0_args, tmp_path))
        procs.append(_start(b, 1, a.addr, ["--timeout", "100"], tmp_path))
        codes = [proc.wait(_RUN_S) for proc in procs]
    finally:
        _finish(procs)
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert codes == [0, 0], "\n\n".join(logs)

    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["errors"] == {}
    assert doc["machine"]["peer_host"] and doc["config"]["transport_choices"] == [["tcp"]]
    for key in ("ucxrpc", "torch", "ucxx"):
        (result,) = doc["results"][key]
        assert result["latency"]["p50_us"] > 0
        assert [e["bytes"] for e in result["bidirectional"]] == doc["config"]["sizes"]
    (pipe,) = doc["results"]["ucxrpc"][0]["pipe_info"]
    assert pipe["lanes"] and all(lane == {"transport": "tcp", "device": a.dev}
                                 for lane in pipe["lanes"]), pipe
    lanes = doc["results"]["ucxx"][0]["transports"]
    assert lanes and set(lanes) == {f"tcp/{a.dev}"}, lanes
    assert f"ucxrpc pipe worker0 -> worker1: tcp (lanes: tcp/{a.dev}" in logs[0]
    assert "rank 1: [torch] done" in logs[1]
