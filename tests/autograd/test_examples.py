"""The programs in examples/ run as a user would run them, and learn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LOSS = re.compile(r"^(?:(\S+) )?step\s+(\d+) loss ([0-9.]+)$")


def _run(script: str) -> dict[str, list[float]]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / script)], cwd=EXAMPLES, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the example and the ranks it spawned
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    losses: dict[str, list[float]] = {}
    for line in out.splitlines():
        m = LOSS.match(line.strip())
        if m:
            losses.setdefault(m.group(1) or "", []).append(float(m.group(3)))
    assert losses, out
    return losses


@pytest.mark.parametrize("script, trainers, ratio", [
    ("parameter_server.py", 2, 0.5),
    ("pipeline_parallel.py", 1, 0.25),
    ("rnn_remote_embedding.py", 1, 0.1),
])
def test_example_learns(script, trainers, ratio):
    losses = _run(script)
    assert len(losses) == trainers
    for name, curve in losses.items():
        assert len(curve) >= 10, name
        # the average of the last three steps against the first step
        assert sum(curve[-3:]) / 3 < ratio * curve[0], (name, curve)
