"""Whether a GPU machine is set up as ucxrpc's CUDA paths need it (the
review of 2026-11-23, probes 1, 6, 7 and 8), and the switch that makes a
GPU run fail instead of skip.

The probes are marked ``gpu``; run them where there is one with
``UCXRPC_REQUIRE_GPU=1 python -m pytest -m gpu -rs tests/rpc/test_gpu_setup.py``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.at_once import run_at_once
from tests.rpc._gpu import BOTH, N, checksum, init
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


# 1. Two processes on one GPU: UCX moves device memory over cuda_ipc, not
#    through staging of its own (a cuda_copy-only pipeline would be 10-25 GB/s
#    under the same "gpu-direct" name before the label looked at the lanes).
def _lanes(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        t = torch.ones(N, device="cuda")
        assert rpc.rpc_sync("worker1", checksum, (t,)) == N
        out = rpc.get_pipe_info("worker1")[0]
    rpc.shutdown()
    return out


@pytest.mark.gpu
def test_gpu_direct_pipe_has_a_cuda_ipc_lane():
    info = run_workers(_lanes, 2, timeout=150)[0]
    assert "cuda_ipc" in info["transports"], info
    assert info["cuda_path"] == "gpu-direct", info


# 6. cuda:0 -> cpu, 16 MiB, where the receiver never touches CUDA itself:
#    UCX's pipeline must not need a CUDA context or device fragments there.
def _to_cpu(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, {0: {"worker1": {0: "cpu"}}})
    out = None
    if rank == 0:
        t = torch.full((N,), 2.0, device="cuda")
        # worker1 declared no CUDA device and never touches CUDA itself.
        out = (rpc.rpc_sync("worker1", checksum, (t,)),
               rpc.rpc_sync("worker1", rpc._get_debug_info)["cuda_context"])
    rpc.shutdown()
    return out


@pytest.mark.gpu
def test_cuda_to_cpu_large_tensor():
    # The receiver's transport made cuda:0's context current before UCX
    # started and on its progress thread (cudactx.py; review finding 4).
    assert run_workers(_to_cpu, 2, timeout=150)[0] == (2.0 * N, "cuda:0")


# 7. transports naming cuda_ipc but not cuda_copy: ucxrpc adds cuda_copy,
#    the one transport whose memory domain detects device memory; without
#    it UCX took device pointers for host memory.
def _ipc_only(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH, transports=["sm", "cuda_ipc"])
    out = None
    if rank == 0:
        out = (rpc.rpc_sync("worker1", checksum, (torch.ones(N, device="cuda"),)),
               os.environ.get("UCX_TLS"))
    rpc.shutdown()
    return out


@pytest.mark.gpu
def test_cuda_ipc_without_cuda_copy_is_safe():
    total, tls = run_workers(_ipc_only, 2, timeout=150)[0]
    assert total == float(N)
    assert tls == "sm,cuda_ipc,cuda_copy"


# Memory CUDA IPC cannot share (torch's expandable segments, set at run
# time).  Before, the pipe sent it as any other and UCX fell back inside
# each transfer: 0.5 GB/s, with progress calls of up to 2.1 s (H200,
# 2026-11-27).  Now it goes through device buffers CUDA IPC can share
# (bounce.py), or without CuPy is staged through host memory; the result is
# the same either way.
def _expandable(rank, world_size, init_method, cupy):
    import sys

    if not cupy:
        sys.modules["cupy"] = None  # import cupy raises ImportError
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    import ucxrpc as rpc
    from ucxrpc.transport.cuda import context as cudactx

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        t = torch.full((N,), 3.0, device="cuda")
        back = rpc.rpc_sync("worker1", torch.add, (t, 1.0))
        info = rpc.get_pipe_info("worker1")[0]
        out = (cudactx.ipc_shareable(0), info["cuda_path"], back.device.type,
               float(back.double().sum().item()), rpc._get_debug_info())
    rpc.shutdown()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cupy", [True, False], ids=["bounced", "staged-without-cupy"])
def test_memory_cuda_ipc_cannot_share_still_arrives(cupy):
    (shareable, why), path, device, total, stats = run_workers(
        _expandable, 2, args=(cupy,), timeout=150)[0]
    assert not shareable and "cannot share" in why, why
    assert device == "cuda" and total == 4.0 * N
    if cupy:
        assert path == "gpu-direct"
        assert stats["bounced_bytes"] >= 4 * N and stats["staged_bytes"] == 0, stats
    else:
        assert path == "staged"
        assert stats["staged_bytes"] >= 4 * N and stats["bounced_bytes"] == 0, stats


# 8. UCX_MEMTYPE_CACHE=n reaches libucs in a worker started without it (a
#    pytest parent that imported ucxx has put it in the environment the
#    ranks inherit: removed first, as in a script run on its own; nothing
#    this module imports loads UCX).
def _memtype(rank, world_size, init_method):
    os.environ.pop("UCX_MEMTYPE_CACHE", None)
    import ucxrpc as rpc
    from ucxrpc.transport.ucx.environment import effective_settings

    init(rank, world_size, init_method, BOTH)
    out = effective_settings().get("UCX_MEMTYPE_CACHE")
    rpc.shutdown()
    return out


@pytest.mark.gpu
def test_memtype_cache_is_really_off():
    assert run_workers(_memtype, 2, timeout=150)[0] == "n"


def _pytest_runs(runs: dict[str, tuple[list[str], dict[str, str]]],
                 timeout: float = 100) -> dict[str, subprocess.CompletedProcess[str]]:
    """``python -m pytest`` in the repository, one run per (arguments,
    environment), all started at once and waited for under one deadline;
    what still runs after it is killed.  Each run imports torch and ucxrpc
    (seconds of CPU): one after another they left a core idle."""
    def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return run_at_once({name: functools.partial(start, args, env)
                        for name, (args, env) in runs.items()}, timeout)


# The switch: on a GPU machine a gpu test that skips is a failure.
@pytest.mark.timeout(120)
def test_require_gpu_turns_a_gpu_skip_into_a_failure(tmp_path):
    target = "tests/test_kernels.py::test_pack_unpack_on_the_gpu_matches_the_cpu"
    base = {k: v for k, v in os.environ.items() if k != "UCXRPC_REQUIRE_GPU"}
    base["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for the child, wherever this runs
    # (hypothesis's pytest plugin is off: a GPU image has no hypothesis, and
    # the target needs none)
    args = ["-q", "-rs", "-p", "no:randomly", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", target]
    runs = _pytest_runs({"skipped": (args, base),
                         "failed": (args, {**base, "UCXRPC_REQUIRE_GPU": "1"})})
    skipped, failed = runs["skipped"], runs["failed"]
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    assert failed.returncode == 1, failed.stdout
    assert "UCXRPC_REQUIRE_GPU=1, yet this gpu test skipped: Skipped: needs a CUDA GPU" \
        in failed.stdout, failed.stdout


# benchmarks/gpu_check.sh: the one command a GPU machine runs.
@pytest.mark.timeout(60)
def test_gpu_check_script_parses_and_its_pytest_step_requires_the_gpu(tmp_path):
    script = REPO / "benchmarks" / "gpu_check.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    dry = subprocess.run(["bash", str(script), str(tmp_path), "pytest", "percall", "floor"],
                         env={**os.environ, "GPU_CHECK_DRY_RUN": "1"}, capture_output=True,
                         text=True, timeout=30)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    commands = [line for line in dry.stdout.splitlines() if line.startswith("would run: ")]
    assert len(commands) == 3, dry.stdout
    pytest_step = commands[0]
    assert " UCXRPC_REQUIRE_GPU=1 " in pytest_step and " -m pytest -m gpu -rs " in pytest_step
    assert pytest_step.endswith(" tests"), pytest_step  # the whole tree: conftest picks
    assert commands[1:] == ["would run: bash -c percall", "would run: bash -c floor"]
    summary = (tmp_path / "summary.txt").read_text()
    assert all(f"{step:<13} ok" in summary for step in ("pytest", "percall", "floor")), summary


# A GPU machine has torch, CuPy, numpy and pytest, not the Docker or fuzz
# tests' dependencies: `pytest -m gpu` once stopped at collecting
# tests/docker/test_docker.py (import jsonschema).  It now leaves alone the
# modules without a gpu test (tests/conftest.py, pytest_ignore_collect).
@pytest.mark.timeout(120)
def test_a_gpu_run_collects_without_the_docker_and_fuzz_dependencies(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "hypothesis").mkdir(parents=True)
    for path in (blocked / "jsonschema.py", blocked / "yaml.py",
                 blocked / "hypothesis" / "__init__.py"):
        path.write_text("raise ImportError('not on the GPU image')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)])}
    # (hypothesis's own pytest plugin is off too: not there on a GPU image)
    collect = ["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    runs = _pytest_runs({
        "control": ([*collect, "tests/docker/test_docker.py"], env),  # the blocking works
        "gpu": ([*collect, "-m", "gpu", "tests"], env)})
    control, gpu = runs["control"], runs["gpu"]
    assert control.returncode != 0 and "not on the GPU image" in control.stdout, control.stdout
    assert gpu.returncode == 0, gpu.stdout + gpu.stderr
    assert "tests/rpc/test_cuda_rpc.py::" in gpu.stdout and "ERROR" not in gpu.stdout
