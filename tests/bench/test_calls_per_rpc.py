"""benchmarks/calls_per_rpc.py: Python and C calls a call, on every thread
of both processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]


def test_an_rpc_async_burst_is_counted_on_the_threads_that_handle_it(tmp_path):
    # An rpc_async's reply is handled on the caller's progress thread, and
    # the callee serves on its pool's: threads init_rpc starts, which a
    # profile hook set after it never reached (the replies went uncounted).
    out = tmp_path / "counts.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "calls_per_rpc.py"),
                    str(free_port()), "2", "async", str(out)],
                   cwd=REPO, check=True, timeout=120, capture_output=True)
    counts = json.loads(out.read_text())
    calls = 2 * 100
    assert counts["n"] == 2
    caller, callee = counts["caller"], counts["callee"]
    # Every call made, and every reply handled, on the caller ...
    assert caller["api.py:rpc_async"] == calls
    assert caller["agent/calls.py:complete"] >= calls
    # ... and every request served on the callee (and the request that
    # stops the count); nothing counted twice.
    assert callee["agent/serving.py:_serve"] == calls + 1
    assert callee["calls_per_rpc.py:noop"] == calls
