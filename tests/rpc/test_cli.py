"""The ``ucxrpc`` command: ``info`` and a quick ``bench`` run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ucxrpc(*args: str, timeout: float, cwd: Path | None = None,
            pythonpath: tuple[str, ...] = (), ucx: dict[str, str] | None = None) -> str:
    # No UCX_* variable from this process (only ``ucx``): had it imported
    # ucxx, its UCX_MEMTYPE_CACHE=n would reach the child however ucxrpc behaves.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(ucx or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *pythonpath])
    proc = subprocess.run([sys.executable, "-m", "ucxrpc.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _readiness(out: str) -> dict[str, str]:
    return {line[:14].strip(): line[14:] for line in out.splitlines()}


@pytest.fixture(scope="module")
def plain_info() -> str:
    """What ``ucxrpc info`` prints in this environment, run once for the
    tests that read it as it is."""
    return _ucxrpc("info", timeout=60)


@pytest.mark.timeout(90)
def test_info_reports_ucx_transports_and_cuda(plain_info):
    out = plain_info
    assert "UCX           1." in out
    assert "tcp/lo" in out and "sysv/memory" in out
    assert "CUDA support" in out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("prefer_system", ["false", "true"])
def test_info_names_the_ucx_library_this_process_loaded(prefer_system, monkeypatch):
    # With RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, ucxx loads a system UCX
    # (how a cluster gets InfiniBand, README); this machine has none, so
    # libucx falls back to its wheel's, and info says which one it got.
    monkeypatch.setenv("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", prefer_system)
    line = _readiness(_ucxrpc("info", timeout=60))["UCX"]
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
def test_info_names_a_ucx_setting_that_breaks_pipes():
    assert _readiness(_ucxrpc("info", timeout=60))["UCX settings"].startswith("ready (")
    got = _readiness(_ucxrpc("info", timeout=60, ucx={"UCX_SYSV_SEG_SIZE": "65600"}))
    assert got["UCX settings"].startswith("not ready: UCX_SYSV_SEG_SIZE=65600 is over 65535 "), got


@pytest.mark.timeout(90)
def test_info_names_a_broken_cupy(tmp_path):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(
        'raise ImportError("libnvrtc.so.13: cannot open shared object file")\n')
    got = _readiness(_ucxrpc("info", timeout=60, pythonpath=(str(tmp_path),)))
    assert got["CuPy"].startswith("not ready: CuPy is installed but does not import "
                                  "(ImportError: libnvrtc.so.13: cannot open"), got
    assert got["CuPy"].endswith("small CUDA tensors go one by one"), got


@pytest.mark.timeout(150)
def test_quick_bench_compares_all_three_and_writes_json_and_plot(tmp_path):
    # On a busy host (one busy process beside the workers), as the figures
    # that matter are taken.
    out = _ucxrpc("bench", "--quick", "--compare", "torch", "--compare", "ucxx", "--load", "1",
                  "--json", "r.json", "--plot", "r.png", "--no-progress", "--local",
                  timeout=130, cwd=tmp_path)
    assert "ucxrpc/torch" in out and "ucxrpc/raw" in out
    assert "load:        1 busy process (a Python loop each)" in out
    assert "ucxrpc pipe worker0 -> worker1:" in out and "raw ucxx endpoint lanes:" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    data = json.loads((tmp_path / "r.json").read_text())
    rows = {row["metric"]: row for row in data["table"]}
    p50 = rows["latency_p50_us"]["values"]
    assert p50["ucxrpc"] > 0 and p50["torch"] > 0 and p50["ucxx"] > 0
    assert set(data["series"]) == {"ucxrpc", "torch", "ucxx"} and data["errors"] == {}
    assert data["config"]["load"] == 1
    # The busy process took its share: about one of the machine's CPUs.
    cpus = os.cpu_count() or 1
    assert all(run["cpu_others"] > 0.5 / cpus for runs in data["runs"].values() for run in runs)
    sizes = data["config"]["sizes"]
    for key in ("ucxrpc", "torch", "ucxx"):
        (result,) = data["results"][key]
        for section in ("one_way", "round_trip", "bidirectional"):
            entries = result[section]
            assert [e["bytes"] for e in entries] == sizes, (key, section)
            for e in entries:
                assert e["min_s"] <= e["median_s"] <= e["max_s"]
                assert e["gbps_min"] <= e["gbps"] <= e["gbps_max"]
    assert f"bidirectional_gbps/{sizes[-1]}" in rows
