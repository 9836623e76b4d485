"""The ``ucxrpc`` command: ``info`` and a quick ``bench`` run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ucxrpc(*args: str, timeout: float, cwd: Path | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "ucxrpc.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(90)
def test_info_reports_ucx_transports_and_cuda():
    out = _ucxrpc("info", timeout=60)
    assert "UCX           1." in out
    assert "tcp/lo" in out and "sysv/memory" in out
    assert "CUDA support" in out


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
