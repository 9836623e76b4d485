"""The programs in examples/ run as a user would run them, and learn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LOSS = re.compile(r"^(?:(\S+) )?step\s+(\d+) loss ([0-9.]+)$")
RUN_S = 120.0

CASES = [  # script, trainers, ratio
    ("parameter_server.py", 2, 0.5),
    ("pipeline_parallel.py", 1, 0.25),
    ("rnn_remote_embedding.py", 1, 0.1),
]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, tuple[int | None, str]]:
    """The examples of the tests selected in this module, run at once, each
    in a session of its own: script -> (exit status, output).  An example's
    time is its ranks' start-up (each imports torch and ucxrpc: seconds of
    CPU), which left a core idle when they ran one after another; their
    training takes well under a second."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if getattr(item, "module", None) is request.module}
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    procs: dict[str, subprocess.Popen[str]] = {}
    outs: dict[str, tuple[int | None, str]] = {}
    deadline = time.monotonic() + RUN_S
    try:
        for script in (script for script, _, _ in CASES if script in selected):
            procs[script] = subprocess.Popen(
                [sys.executable, str(EXAMPLES / script)], cwd=EXAMPLES, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        for script, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = f"(still running after {RUN_S} s: killed)"
            outs[script] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # the example and the ranks it spawned
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outs


def _losses(code: int | None, out: str) -> dict[str, list[float]]:
    assert code == 0, out
    losses: dict[str, list[float]] = {}
    for line in out.splitlines():
        m = LOSS.match(line.strip())
        if m:
            losses.setdefault(m.group(1) or "", []).append(float(m.group(3)))
    assert losses, out
    return losses


@pytest.mark.parametrize("script, trainers, ratio", CASES)
def test_example_learns(script, trainers, ratio, runs):
    losses = _losses(*runs[script])
    assert len(losses) == trainers
    for name, curve in losses.items():
        assert len(curve) >= 10, name
        # the average of the last three steps against the first step
        assert sum(curve[-3:]) / 3 < ratio * curve[0], (name, curve)
