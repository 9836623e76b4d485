"""The ``ucxrpc`` command: ``info`` and a quick ``bench`` run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _ucxrpc(*args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, "-m", "ucxrpc.cli", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(90)
def test_info_reports_ucx_transports_and_cuda():
    out = _ucxrpc("info", timeout=60)
    assert "UCX           1." in out
    assert "tcp/lo" in out and "sysv/memory" in out
    assert "CUDA support" in out


@pytest.mark.timeout(200)
def test_quick_bench_compares_with_torch_and_reports_the_pipe(tmp_path):
    out = _ucxrpc("bench", "--quick", "--compare", "torch", "--json", str(tmp_path / "r.json"),
                  timeout=180)
    assert "ucxrpc/torch" in out
    assert "ucxrpc pipe worker0 -> worker1:" in out
    data = json.loads((tmp_path / "r.json").read_text())
    rows = {row["metric"]: row for row in data["table"]}
    p50 = rows["latency_p50_us"]["values"]
    assert p50["ucxrpc"] > 0 and p50["torch"] > 0
