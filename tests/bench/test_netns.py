"""Two simulated hosts (:mod:`ucxrpc.bench.netns`), and ``ucxrpc bench
--hosts netns`` across them.

The first tests check the module itself: each worker is isolated (its own
hostname, PID, IPC, UTS and mount namespaces, a private ``/dev/shm``), TCP
crosses the link, :meth:`~ucxrpc.bench.netns.Hosts.drop` and
:meth:`~ucxrpc.bench.netns.Hosts.set_link` cut it and heal it, a SIGKILL of
the Popen takes the whole worker down, and the namespaces are gone after.

The last runs ``ucxrpc bench --hosts netns`` (:mod:`ucxrpc.bench.simhosts`):
it starts rank 0 on host 0 and rank 1 on host 1 as torchrun would start them
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so every connection between
the two ranks crosses the veth, and UCX, left to choose, must find tcp
there. Needs root, ``ip`` and ``unshare``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.hosts import _harness as harness
from ucxrpc.bench.netns import Host, Hosts, Unavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
_RUN_S = 130.0       # the whole bench, all three series; its --timeout is below it
_CHILD_S = 20.0      # a small probe program on a host
_NS = ("pid", "ipc", "uts", "mnt", "net")


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    with harness.two_hosts(tag="ucxb") as hosts:
        yield hosts


def _python(hosts: Hosts, host: Host, code: str, *, isolate: bool = True,
            timeout: float = _CHILD_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` on ``host``; fails the test if it fails."""
    proc = subprocess.run(hosts.command(host, [sys.executable, "-c", code], isolate=isolate),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


_PROBE = """\
import json, os, socket, sys
def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None
if len(sys.argv) > 1:
    open("/dev/shm/" + sys.argv[1], "w").close()
print(json.dumps({"hostname": socket.gethostname(), "pid": os.getpid(),
                  "ns": {n: os.readlink("/proc/self/ns/" + n) for n in %r},
                  "shm": sorted(os.listdir("/dev/shm")),
                  "hosts": {n: resolve(n) for n in %r}}))
"""


# -- the module: hosts, isolation, the link ------------------------------------

def test_names_and_addresses_are_this_process_s_and_distinct():
    first, second = Hosts(), Hosts()  # nothing is made before __enter__
    names = [h.netns for pair in (first, second) for h in pair.hosts]
    assert len(set(names)) == 4 and all(str(os.getpid()) in n for n in names), names
    for pair in (first, second):
        a, b = pair.hosts
        assert (a.index, b.index) == (0, 1) and a.veth == a.netns and len(a.veth) <= 15
        assert a.address.rsplit(".", 1)[0] == b.address.rsplit(".", 1)[0]
        assert int(b.address.rsplit(".", 1)[1]) == int(a.address.rsplit(".", 1)[1]) + 1
    with pytest.raises(ValueError, match="tag"):
        Hosts(tag="Not-A-Tag")
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.command(first.hosts[0], ["true"])


def test_not_root_is_unavailable(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(Unavailable, match="root"):
        Hosts().__enter__()


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_each_worker_is_a_host_of_its_own(two_hosts):
    a, b = two_hosts.hosts
    mine = {n: os.readlink(f"/proc/self/ns/{n}") for n in _NS}
    marker = f"ucxb-test-{os.getpid()}"
    probe = _PROBE % (_NS, (a.netns, b.netns))
    open(f"/dev/shm/{marker}-here", "w").close()  # the hosts must not see it
    try:
        seen = [json.loads(_python(two_hosts, h, probe).stdout) for h in (a, b)]
        proc = subprocess.run(two_hosts.command(a, [sys.executable, "-c", probe, marker]),
                              capture_output=True, text=True, timeout=_CHILD_S)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.exists(f"/dev/shm/{marker}"), "a host's /dev/shm is the machine's"
        plain = json.loads(_python(two_hosts, a, probe, isolate=False).stdout)
    finally:
        os.unlink(f"/dev/shm/{marker}-here")
    for host, out in zip((a, b), seen):
        assert out["hostname"] == host.netns
        assert out["pid"] == 1  # PID 1 of its own PID namespace
        assert all(out["ns"][n] != mine[n] for n in _NS), (out["ns"], mine)
        assert out["shm"] == [], out["shm"]
        assert out["hosts"] == {a.netns: a.address, b.netns: b.address}
    # (The others' inodes may be reused once a probe ends: only the network
    # namespaces, kept by their names, outlive them.)
    assert seen[0]["ns"]["net"] != seen[1]["ns"]["net"]
    # isolate=False: only the network namespace is the host's.
    assert plain["ns"]["net"] == seen[0]["ns"]["net"]
    assert all(plain["ns"][n] == mine[n] for n in ("pid", "ipc", "uts"))


_SERVER = """\
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello")
    c.close()
"""

_CLIENT = """\
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:
        print(c.recv(5).decode())
except socket.timeout:
    print("timeout")
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_tcp_crosses_the_link_and_drop_and_set_link_cut_it(two_hosts):
    a, b = two_hosts.hosts
    server = two_hosts.popen(b, [sys.executable, "-c", _SERVER], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"

        def connect(timeout: float = 5.0) -> str:
            argv = [sys.executable, "-c", _CLIENT, b.address, str(timeout)]
            proc = subprocess.run(two_hosts.command(a, argv), capture_output=True, text=True,
                                  timeout=_CHILD_S)
            assert proc.returncode == 0, proc.stderr
            return proc.stdout.strip()

        assert connect() == "hello"
        try:
            two_hosts.drop(b, True)
        except Unavailable as exc:
            pytest.skip(f"cannot drop packets here: {exc}")
        two_hosts.drop(b, True)  # once in force, a no-op
        assert connect(timeout=1.0) == "timeout"  # silence, not a refusal
        two_hosts.drop(b, False)
        assert connect() == "hello"
        two_hosts.drop(b, False)  # no rule left to delete: a no-op
        two_hosts.set_link(a, False)
        assert connect(timeout=1.0) in ("timeout", "OSError")  # no route: unreachable
        two_hosts.set_link(a, True)
        assert connect() == "hello"
    finally:
        server.kill()
        server.wait(_CHILD_S)


_TREE = """\
import subprocess, sys, time
subprocess.Popen(["sleep", "60"])
print("started", flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2:].split()[0] in ("Z", "X")


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_killing_the_popen_takes_the_whole_worker_down(two_hosts):
    a, _ = two_hosts.hosts
    proc = two_hosts.popen(a, [sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        worker = two_hosts.worker_pid(proc)
        assert worker is not None
        pids = [proc.pid, worker, *_children(worker)]
        assert len(pids) == 3, pids  # unshare, the worker, its sleep
    finally:
        proc.kill()
        proc.wait(_CHILD_S)
    deadline = time.monotonic() + 10.0
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p for p in pids if not _gone(p)] == [], "left behind by the kill"


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_the_namespaces_are_gone_after_the_block_even_on_error():
    try:
        with Hosts(tag="ucxb") as hosts:
            names = [h.netns for h in hosts.hosts]
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                    timeout=_CHILD_S).stdout
            assert all(n in listed.split() for n in names), listed
            raise KeyError("inside the block")
    except Unavailable as exc:
        pytest.skip(f"simulated hosts unavailable: {exc}")
    except KeyError:
        pass
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=_CHILD_S).stdout
    assert not any(n in listed.split() for n in names), listed
    assert not any(os.path.exists(f"/run/netns/{n}") for n in names)
    hosts.close()  # idempotent
    with pytest.raises(RuntimeError):
        hosts.popen(hosts.hosts[0], ["true"])


# -- ucxrpc bench --hosts netns ---------------------------------------------------

@pytest.mark.processes
@pytest.mark.timeout(150)
def test_bench_hosts_netns_runs_all_three_over_tcp_on_the_veth(tmp_path):
    try:
        Hosts(tag="ucxb").__enter__().close()
    except Unavailable as exc:
        pytest.skip(f"simulated hosts unavailable: {exc}")
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The smallest run that still measures all three across the link (a
    # first and a last size, a few timed calls each): UCX picks the
    # transports (no --transports): the isolation leaves it tcp.
    argv = [sys.executable, "-m", "ucxrpc", "bench", "--hosts", "netns", "--quick",
            "--sizes", "4K,1M", "--iters", "20", "--time-per-size", "0.01", "--json", "r.json",
            "--no-plot", "--no-progress", "--timeout", "100"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=_RUN_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    doc = json.loads((tmp_path / "r.json").read_text())
    machine = doc["machine"]
    assert doc["config"]["hosts"] == "netns" and doc["errors"] == {}
    a, b = machine["simulated_hosts"]["hosts"]
    assert machine["simulated_hosts"]["kind"] == "netns"
    assert (machine["hostname"], machine["peer_host"]) == (a["name"], b["name"])
    assert machine["master"] == f"{a['address']}:29500"
    assert "--hosts netns" in machine["command"] and "--hosts" in machine["bench_args"]
    assert doc["config"]["transport_choices"] == [None]   # UCX chose
    for key in ("ucxrpc", "torch", "ucxx"):
        (result,) = doc["results"][key]
        assert result["latency"]["p50_us"] > 0
        assert [e["bytes"] for e in result["bidirectional"]] == [4096, 1 << 20]
    (pipe,) = doc["results"]["ucxrpc"][0]["pipe_info"]
    assert pipe["transports"] == ["tcp"], pipe
    assert pipe["lanes"] and all(lane == {"transport": "tcp", "device": a["device"]}
                                 for lane in pipe["lanes"]), pipe
    assert set(doc["results"]["ucxx"][0]["transports"]) == {f"tcp/{a['device']}"}

    # Rank 0's output is the user's, as in a local run; rank 1's is not.
    out = proc.stdout
    assert "ucxrpc/torch" in out and "ucxrpc/raw" in out
    assert "two simulated hosts" in out and "JSON written to r.json" in out
    assert f"ucxrpc pipe worker0 -> worker1: tcp (lanes: tcp/{a['device']}" in out
    assert "rank 1:" not in proc.stdout + proc.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=_CHILD_S).stdout.split()
    assert a["name"] not in listed and b["name"] not in listed, listed
