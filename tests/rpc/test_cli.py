"""The ``ucxrpc`` command: ``info`` and a quick ``bench`` run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.at_once import run_at_once

pytestmark = pytest.mark.processes

REPO_ROOT = Path(__file__).resolve().parents[2]


def _start(*args: str, cwd: Path | None = None, pythonpath: tuple[str, ...] = (),
           ucx: dict[str, str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python -m ucxrpc.cli args...``; ``env`` adds to this process's."""
    # No UCX_* variable from this process (only ``ucx``): had it imported
    # ucxx, its UCX_MEMTYPE_CACHE=n would reach the child however ucxrpc behaves.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    child_env.update(env or {})
    child_env.update(ucx or {})
    child_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *pythonpath])
    return subprocess.Popen([sys.executable, "-m", "ucxrpc.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=child_env)


def _stdout(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _ucxrpc(*args: str, timeout: float, cwd: Path | None = None) -> str:
    return _stdout(run_at_once({"run": lambda: _start(*args, cwd=cwd)}, timeout)["run"])


def _readiness(out: str) -> dict[str, str]:
    return {line[:14].strip(): line[14:] for line in out.splitlines()}


@pytest.fixture(scope="module")
def info_runs(
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """``ucxrpc info`` in each environment the tests below read, all started
    at once: each imports torch and loads UCX (seconds of CPU), and one after
    another they left a core idle.  Each test checks its own run's exit."""
    broken = tmp_path_factory.mktemp("broken_cupy")
    (broken / "cupy").mkdir()
    (broken / "cupy" / "__init__.py").write_text(
        'raise ImportError("libnvrtc.so.13: cannot open shared object file")\n')
    prefer = "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"
    return run_at_once({
        "plain": lambda: _start("info"),
        # With RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, ucxx loads a system
        # UCX (how a cluster gets InfiniBand, README); this machine has none,
        # so libucx falls back to its wheel's, and info says which one it got.
        "prefer_system=false": lambda: _start("info", env={prefer: "false"}),
        "prefer_system=true": lambda: _start("info", env={prefer: "true"}),
        "sysv_seg_size": lambda: _start("info", ucx={"UCX_SYSV_SEG_SIZE": "65600"}),
        "broken_cupy": lambda: _start("info", pythonpath=(str(broken),)),
    }, timeout=60)


@pytest.fixture(scope="module")
def plain_info(info_runs) -> str:
    """What ``ucxrpc info`` prints in this environment as it is."""
    return _stdout(info_runs["plain"])


@pytest.mark.timeout(90)
def test_info_reports_ucx_transports_and_cuda(plain_info):
    out = plain_info
    assert "UCX           1." in out
    assert "tcp/lo" in out and "sysv/memory" in out
    assert "CUDA support" in out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("prefer_system", ["false", "true"])
def test_info_names_the_ucx_library_this_process_loaded(prefer_system, info_runs):
    # (the runs, and why: info_runs)
    line = _readiness(_stdout(info_runs[f"prefer_system={prefer_system}"]))["UCX"]
    path = line.split(" (", 1)[1].rstrip(")")
    assert os.path.basename(path).startswith("libucp.so") and os.path.exists(path), line


def _gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.timeout(90)
def test_info_says_whether_each_cuda_piece_is_ready_and_why_not(plain_info):
    got = _readiness(plain_info)
    for label in ("CUDA", "CuPy", "cuda_copy", "cuda_ipc", "memtype cache"):
        assert got[label].startswith(("ready (", "not ready: ")), (label, got)
        assert len(got[label]) > len("not ready: ") + 10, (label, got)  # a reason is given
    # ucxx's own UCX_MEMTYPE_CACHE=n comes too late for libucs; ucxrpc's does not
    assert got["memtype cache"] == "ready (UCX_MEMTYPE_CACHE=n, as UCX read it)", got
    assert got["fragments"].startswith("host,cuda "), got
    if not _gpu_here():
        import torch

        assert got["CUDA"].startswith("not ready: torch "), got
        if torch.version.cuda is None:
            assert got["CUDA"] == f"not ready: torch {torch.__version__} is built without CUDA"
        assert got["cuda_copy"] == got["cuda_ipc"] == "not ready: no usable GPU (see CUDA)"
        assert got["CuPy"].startswith("not ready: CuPy "), got
        assert got["CUDA support"].startswith("not usable"), got


@pytest.mark.timeout(90)
def test_info_names_a_ucx_setting_that_breaks_pipes(plain_info, info_runs):
    assert _readiness(plain_info)["UCX settings"].startswith("ready (")
    got = _readiness(_stdout(info_runs["sysv_seg_size"]))
    assert got["UCX settings"].startswith("not ready: UCX_SYSV_SEG_SIZE=65600 is over 65535 "), got


@pytest.mark.timeout(90)
def test_info_names_a_broken_cupy(info_runs):
    # (a cupy first on the path that raises the ImportError of a missing libnvrtc)
    got = _readiness(_stdout(info_runs["broken_cupy"]))
    assert got["CuPy"].startswith("not ready: CuPy is installed but does not import "
                                  "(ImportError: libnvrtc.so.13: cannot open"), got
    assert got["CuPy"].endswith("small CUDA tensors go one by one"), got


@pytest.mark.timeout(150)
def test_quick_bench_on_a_busy_host_compares_and_writes_json_and_plot(tmp_path):
    # On a busy host (one busy process beside the workers), as the figures
    # that matter are taken.  The smallest --quick run that still has a first
    # and a last size and a latency figure: the run is what is checked here,
    # not its figures (most of its time is the workers' start-up anyway).
    # torch's series is left to the run across two simulated hosts
    # (tests/bench/test_netns.py), which runs all three: its start-up is the
    # slowest of the three, and the series run the same code either way.
    out = _ucxrpc("bench", "--quick", "--sizes", "4K,1M", "--iters", "20",
                  "--time-per-size", "0.01", "--compare", "ucxx",
                  "--load", "1", "--json", "r.json", "--plot", "r.png", "--no-progress",
                  "--local", timeout=130, cwd=tmp_path)
    assert "ucxrpc/raw" in out and "ucxrpc/torch" not in out
    assert "load:        1 busy process (a Python loop each)" in out
    assert "ucxrpc pipe worker0 -> worker1:" in out and "raw ucxx endpoint lanes:" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    data = json.loads((tmp_path / "r.json").read_text())
    rows = {row["metric"]: row for row in data["table"]}
    p50 = rows["latency_p50_us"]["values"]
    assert p50["ucxrpc"] > 0 and p50["ucxx"] > 0 and "torch" not in p50
    assert set(data["series"]) == {"ucxrpc", "ucxx"} and data["errors"] == {}
    assert data["config"]["load"] == 1
    # The busy process took its share: about one of the machine's CPUs.
    cpus = os.cpu_count() or 1
    assert all(run["cpu_others"] > 0.5 / cpus for runs in data["runs"].values() for run in runs)
    sizes = data["config"]["sizes"]
    for key in ("ucxrpc", "ucxx"):
        (result,) = data["results"][key]
        for section in ("one_way", "round_trip", "bidirectional"):
            entries = result[section]
            assert [e["bytes"] for e in entries] == sizes, (key, section)
            for e in entries:
                assert e["min_s"] <= e["median_s"] <= e["max_s"]
                assert e["gbps_min"] <= e["gbps"] <= e["gbps_max"]
    assert f"bidirectional_gbps/{sizes[-1]}" in rows
