"""benchmarks/stages.py: a no-op call's wall time by stage, both sides."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# benchmarks/ is not a package: the module is loaded from its file.
_spec = importlib.util.spec_from_file_location("stages", REPO / "benchmarks" / "stages.py")
assert _spec is not None and _spec.loader is not None
stages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stages)

SEAMS_C = ("pickled", "send", "take", "message", "complete", "drove")
SEAMS_E = ("take", "message", "claim", "drove", "serve", "user", "reply", "send")


def _call(t0: int, caller: dict, callee: dict) -> None:
    """One call's stamps, each seam 10 ns after the one before."""
    t = t0
    caller["start"].append(t)
    order = [("c", "pickled"), ("c", "send"), ("e", "take"), ("e", "message"), ("e", "claim"),
             ("e", "drove"), ("e", "serve"), ("e", "user"), ("e", "reply"), ("e", "send"),
             ("c", "take"), ("c", "message"), ("c", "complete"), ("c", "drove")]
    for side, seam in order:
        t += 10
        (caller if side == "c" else callee)[seam].append(t)
    caller["end"].append(t + 10)


def _empty() -> tuple[dict, dict]:
    return ({k: [] for k in SEAMS_C + ("start", "end")}, {k: [] for k in SEAMS_E})


def test_each_stage_is_the_time_between_its_seams():
    caller, callee = _empty()
    _call(1000, caller, callee)
    _call(5000, caller, callee)
    per_stage = stages.stage_times(caller, callee)
    assert [len(v) for v in per_stage] == [2] * len(stages.STAGES)
    assert all(v == [10, 10] for v in per_stage)
    out = stages.table(per_stage)
    assert out["calls"] == 2 and out["total"]["p50_us"] == round(10 * len(stages.STAGES) / 1000, 1)


def test_a_call_missing_a_seam_is_left_out_not_matched_to_the_next_calls():
    caller, callee = _empty()
    _call(1000, caller, callee)
    _call(5000, caller, callee)
    callee["serve"].pop(0)  # the first call's serve was never seen
    per_stage = stages.stage_times(caller, callee)
    assert [len(v) for v in per_stage] == [1] * len(stages.STAGES)


def _run_tool(tmp_path, *args: str) -> dict:
    """stages.py run for real with ``args``: its table, each stage's
    percentiles checked in order."""
    out_json = tmp_path / "stages.json"
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stages.py"), *args,
                          "--json", str(out_json)],
                         capture_output=True, text=True, timeout=100, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out_json.read_text())
    assert all(0 < row["p10_us"] <= row["p50_us"] <= row["p90_us"] for row in result["stages"])
    return result


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_tool_times_every_stage_of_real_calls(tmp_path):
    result = _run_tool(tmp_path, "--calls", "200", "--warmup", "50")
    # Nearly every call is seen whole (a stamp from a warm-up call's tail
    # may cost the first one).
    assert result["calls"] >= 190, result
    assert [row["stage"] for row in result["stages"]] == [s[0] for s in stages.STAGES]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_tool_times_a_call_carrying_buffers_along_their_own_path(tmp_path):
    # A 128 KiB tensor travels as a buffer of its own through UCX on a
    # quiet host (below cma.MIN_BYTES, over the inline threshold): the
    # receiver's Python path (decoded, then delivered), which a no-op's
    # frame never takes, so every seam is that path's.  (The dict's 400 KiB
    # bundle is read by address, in the native core: the no-op's seams.)
    result = _run_tool(tmp_path, "--calls", "60", "--warmup", "20", "--payload", "128K")
    assert result["calls"] >= 55, result
    assert [row["stage"] for row in result["stages"]] == [s[0] for s in stages.PAYLOAD_STAGES]
