"""benchmarks/stacks.py: py-spy's raw stacks into a per-frame table, and
benchmarks/percall.py, the loop the GPU check samples (here on host tensors)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# benchmarks/ is not a package: the module is loaded from its file.
_spec = importlib.util.spec_from_file_location("stacks", REPO / "benchmarks" / "stacks.py")
assert _spec is not None and _spec.loader is not None
stacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)

RAW = """\
thread (11): MainThread;run (percall.py:40);rpc_sync (ucxrpc/api.py:80);wait (ucxrpc/agent/core.py:370) 6
thread (11): MainThread;run (percall.py:40);rpc_sync (ucxrpc/api.py:80);call (ucxrpc/agent/core.py:300) 3
thread (11): MainThread;run (percall.py:41);rpc_sync (ucxrpc/api.py:81);call (ucxrpc/agent/core.py:310);call (ucxrpc/agent/core.py:311) 1
thread (12): ucxrpc-progress-0;_loop (ucxrpc/transport/loop/progress.py:452) 4
not a sample line
"""


def test_samples_are_grouped_by_thread_and_lines_dropped_from_frames():
    threads = stacks.parse(RAW.splitlines())
    assert sorted(threads) == ["MainThread", "ucxrpc-progress-0"]
    frames, count = threads["MainThread"][0]
    assert frames[-1] == "wait (ucxrpc/agent/core.py)" and count == 6


def test_a_frame_counts_once_per_sample_however_deep_it_recurs():
    total, shares = stacks.frame_shares(stacks.parse(RAW.splitlines())["MainThread"])
    assert total == 10
    share = dict(shares)
    assert share["rpc_sync (ucxrpc/api.py)"] == 1.0  # lines 80 and 81: one function
    assert share["wait (ucxrpc/agent/core.py)"] == pytest.approx(0.6)
    assert share["call (ucxrpc/agent/core.py)"] == pytest.approx(0.4)  # 3 + 1, not 3 + 2
    assert [f for f, _ in shares][0] in ("run (percall.py)", "rpc_sync (ucxrpc/api.py)")


@pytest.mark.processes
def test_the_table_gives_microseconds_per_call(tmp_path):
    path = tmp_path / "rank0.txt"
    path.write_text(RAW)
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stacks.py"), str(path),
                          "--per-call-us", "500", "--thread", "Main"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "## MainThread: 10 samples"
    assert "  60.0%     300.0  wait (ucxrpc/agent/core.py)" in lines
    assert "progress" not in out.stdout


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_percall_loop_reports_one_json_line_and_its_pids(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "percall.py"), "--device",
                          "cpu", "--size", "64K", "--seconds", "0.5", "--pid-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["impl"] == "ucxrpc" and result["size"] == 64 << 10 and result["calls"] > 0
    assert result["p10_us"] <= result["p50_us"] <= result["p90_us"]
    assert {p.name for p in tmp_path.iterdir()} == {"rank0.pid", "rank1.pid", "go"}
