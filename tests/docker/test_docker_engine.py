"""docker/ against a real Docker engine: opt-in, skipped everywhere else.

Runs only with ``UCXRPC_DOCKER_TESTS=1`` and a Docker engine that answers
``docker info``, on an image built beforehand (docker/README.md says how;
``UCXRPC_DOCKER_IMAGE``, default ``ucxrpc:cpu``, names it). Nothing here
builds an image: a build downloads hundreds of MB and needs settings of its
own (base image, torch wheel, CA bundle) that a test cannot guess.

* ``ucxrpc info`` in the image, with and without SYS_PTRACE: UCX loads the
  shared-memory transports, and CMA only with the capability;
* docker/compose.yaml as it is (plus ``--quick`` and, where this host cannot
  grant it, a lower memlock limit) runs the bench between its two containers
  over shared memory, and exits with rank 0's status 0;
* the same two containers without the shared namespaces fall back to TCP,
  which is what the namespace settings of compose.yaml are for.

Every container and network is created under a name unique to the run and
removed by that name afterwards, whatever the outcome; every docker command
runs under a timeout.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker" / "compose.yaml"
IMAGE = os.environ.get("UCXRPC_DOCKER_IMAGE", "ucxrpc:cpu")
QUICK = ["ucxrpc", "bench", "--quick", "--no-json", "--no-plot"]
SHORT_TIMEOUT_S = 60
BENCH_TIMEOUT_S = 300
CAP_SYS_RESOURCE = 24
PIPE_LINE = re.compile(r"ucxrpc pipe worker0 -> worker1: (\S+) \(lanes: ([^)]*)\)")


def _docker_reason() -> str | None:
    if os.environ.get("UCXRPC_DOCKER_TESTS") != "1":
        return "needs a Docker engine: set UCXRPC_DOCKER_TESTS=1 to run"
    if shutil.which("docker") is None:
        return "UCXRPC_DOCKER_TESTS=1 but no docker client on PATH"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True,
                              timeout=SHORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "UCXRPC_DOCKER_TESTS=1 but `docker info` did not answer"
    if info.returncode != 0:
        return f"UCXRPC_DOCKER_TESTS=1 but `docker info` failed: {info.stderr.strip()[-300:]}"
    return None


_REASON = _docker_reason()
pytestmark = [pytest.mark.processes, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _docker(*args: str, timeout: float = SHORT_TIMEOUT_S,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} exited {result.returncode}:\n"
                    f"{(result.stdout + result.stderr)[-4000:]}", pytrace=False)
    return result


def _compose_command() -> list[str]:
    """`docker compose` (v2 plugin) where there is one, else `docker-compose` (v1 or v2)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True,
                      timeout=SHORT_TIMEOUT_S).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed", pytrace=False)


@pytest.fixture(scope="module")
def image() -> str:
    if _docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"image {IMAGE} not found: build it first (docker/README.md), or name "
                    "another with UCXRPC_DOCKER_IMAGE", pytrace=False)
    return IMAGE


@pytest.fixture
def run_id() -> str:
    return f"ucxrpc-test-{uuid.uuid4().hex[:10]}"


def _transports(text: str) -> set[str]:
    line = next((ln for ln in text.splitlines() if ln.startswith("transports")), "")
    return {t.strip().split("/")[0] for t in line.split(None, 1)[-1].split(",") if t.strip()}


@pytest.mark.timeout(3 * SHORT_TIMEOUT_S)
def test_image_loads_the_shared_memory_transports(image: str, run_id: str) -> None:
    names = (f"{run_id}-plain", f"{run_id}-ptrace")
    try:
        plain = _docker("run", "--name", names[0], image, "ucxrpc", "info").stdout
        ptrace = _docker("run", "--name", names[1], "--cap-add", "SYS_PTRACE", image,
                         "ucxrpc", "info").stdout
    finally:
        _docker("rm", "-f", *names, check=False)
    assert {"sysv", "posix", "tcp"} <= _transports(plain), plain
    # CMA is ptrace-checked: compose.yaml adds SYS_PTRACE for it (see docker/README.md).
    assert "cma" in _transports(ptrace), ptrace


def _memlock_override() -> str:
    """compose.yaml's memlock: -1 where this host can grant it, else the hard limit here.

    Raising RLIMIT_MEMLOCK's hard limit needs CAP_SYS_RESOURCE; a host (or a
    VM sandbox) whose root lacks it cannot start a container with an
    unlimited memlock. Assumes the engine is local and limited as we are.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.MULTILINE)
    cap_eff = int(match.group(1), 16) if match else 0
    if hard == resource.RLIM_INFINITY or cap_eff >> CAP_SYS_RESOURCE & 1:
        return ""
    return (f"    ulimits:\n      memlock: {{soft: {hard}, hard: {hard}}}\n")


@pytest.mark.timeout(BENCH_TIMEOUT_S + 3 * SHORT_TIMEOUT_S)
def test_compose_pair_runs_the_bench_over_shared_memory(image: str, run_id: str,
                                                        tmp_path: Path) -> None:
    memlock = _memlock_override()
    override = tmp_path / "override.yaml"
    override.write_text(
        "services:\n"
        f"  rank0:\n    image: {image}\n    command: {QUICK!r}\n{memlock}"
        f"  rank1:\n    image: {image}\n"
        f"    command: ['sh', '-c', '{' '.join(QUICK)} && exec sleep infinity']\n{memlock}")
    compose = [*_compose_command(), "-p", run_id, "-f", str(COMPOSE_FILE), "-f", str(override)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    try:
        result = subprocess.run([*compose, "up", "--no-build", "--exit-code-from", "rank0"],
                                capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                                env=env, cwd=REPO_ROOT)
    finally:
        subprocess.run([*compose, "down", "--remove-orphans", "--timeout", "5"],
                       capture_output=True, timeout=2 * SHORT_TIMEOUT_S, env=env, cwd=REPO_ROOT)
        left = _docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={run_id}",
                       check=False).stdout.split()
        if left:
            _docker("rm", "-f", *left, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"compose exited {result.returncode}:\n{output[-6000:]}"
    assert "no-op rpc_sync latency p50" in output, output[-6000:]
    pipes = PIPE_LINE.findall(output)
    assert pipes, f"the bench reported no pipe transports:\n{output[-6000:]}"
    for transport, lanes in pipes:
        assert transport in ("sysv", "posix", "cma") and "tcp" not in lanes, (
            f"compose pair used {transport} ({lanes}), not shared memory:\n{output[-6000:]}")


@pytest.fixture
def network(run_id: str) -> Iterator[str]:
    _docker("network", "create", run_id)
    try:
        yield run_id
    finally:
        _docker("network", "rm", run_id, check=False)


@pytest.mark.timeout(BENCH_TIMEOUT_S + 3 * SHORT_TIMEOUT_S)
def test_separate_namespaces_fall_back_to_tcp(image: str, run_id: str, network: str) -> None:
    names = (f"{run_id}-rank0", f"{run_id}-rank1")
    common = ["--network", network, "--cap-add", "SYS_PTRACE", "-e", "WORLD_SIZE=2",
              "-e", f"MASTER_ADDR={names[0]}", "-e", "MASTER_PORT=29500"]
    try:
        for rank, name in enumerate(names):
            _docker("run", "-d", "--name", name, *common, "-e", f"RANK={rank}", image, *QUICK)
        codes = _docker("wait", *names, timeout=BENCH_TIMEOUT_S).stdout.split()
        logs = _docker("logs", names[0])
        output = logs.stdout + logs.stderr
    finally:
        _docker("rm", "-f", *names, check=False)
    assert codes == ["0", "0"], f"exit codes {codes}:\n{output[-6000:]}"
    pipes = PIPE_LINE.findall(output)
    assert pipes and all(t == "tcp" for t, _ in pipes), output[-6000:]
