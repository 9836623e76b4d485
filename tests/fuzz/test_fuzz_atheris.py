"""A short coverage-guided run of tests/fuzz/atheris_frames.py (libFuzzer).

Skipped, with the reason, where atheris is not installed (it is not a
declared test dependency: ``pip install atheris``).  Longer runs: see the
harness's docstring.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

HARNESS = Path(__file__).with_name("atheris_frames.py")
RUNS = 20_000


def test_atheris_finds_nothing_in_a_short_run(tmp_path: Path) -> None:
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (pip install atheris)")
    # A fixed seed keeps the run repeatable; crash-* files land in tmp_path.
    cmd = [sys.executable, str(HARNESS), f"-runs={RUNS}", "-seed=1", "-max_len=4096",
           "-max_total_time=30", f"-artifact_prefix={tmp_path}/"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=75)
    out = proc.stdout + proc.stderr
    crashes = sorted(p.name for p in tmp_path.glob("crash-*"))
    assert proc.returncode == 0 and not crashes, f"atheris found a crash {crashes}:\n{out[-6000:]}"
    assert f"Done {RUNS} runs" in out, out[-3000:]
