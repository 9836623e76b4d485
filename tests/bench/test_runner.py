"""The run list: interleaving, the plan rank 0 hands to rank 1, progress and
outcomes, with a stand-in for the processes."""

from __future__ import annotations

import io
import json

from ucxrpc.bench import plan
from ucxrpc.bench.launch import RunOutcome
from ucxrpc.bench.progress import Progress
from ucxrpc.bench.runner import _runs_from, plan_document, plan_runs, run_all
from ucxrpc.bench.workload import count_steps, quick_config


def _series():
    return plan.build_series(["ucxrpc", "torch", "ucxx"], [("tcp",), ("sm", "cma")])


def test_runs_interleave_series_per_round():
    runs = plan_runs(_series(), repeat=2)
    assert [r.series.key for r in runs[:5]] == ["ucxrpc[tcp]", "ucxrpc[sm,cma]", "torch",
                                                "ucxx[tcp]", "ucxx[sm,cma]"]
    assert [r.series.key for r in runs[5:]] == [r.series.key for r in runs[:5]]
    assert runs[6].tag == "ucxrpc [sm,cma] 2/2" and runs[0].config(quick_config()).transports \
        == ("tcp",)


def test_plan_survives_json_for_rank1():
    runs, cfg = plan_runs(_series(), repeat=2), quick_config(device="cpu")
    doc = json.loads(json.dumps(plan_document(runs, cfg, "cpu", "host0", 120.0)))
    again, cfg_again = _runs_from(doc)
    assert again == runs and cfg_again == cfg
    assert doc["device"] == "cpu" and doc["host"] == "host0" and doc["timeout_s"] == 120.0


def test_run_all_counts_progress_and_keeps_failures():
    runs = plan_runs(plan.build_series(["ucxrpc", "ucxx"], [None]), repeat=1)
    cfg = quick_config()
    seen = []

    def execute(index, run, run_cfg, deadline, on_progress):
        seen.append((index, run.series.key, run_cfg.transports))
        if run.series.impl == "ucxx":
            on_progress("latency")
            return RunOutcome(run.series.key, error="worker1 failed: boom", wall_s=1.0)
        for _ in range(count_steps("ucxrpc", run_cfg)):
            on_progress("step")
        return RunOutcome(run.series.key, result={"latency": {"p50_us": 1.0}}, wall_s=2.0,
                          cpu_others=0.5)

    log = io.StringIO()
    total = sum(count_steps(r.series.impl, cfg) for r in runs)
    progress = Progress(total, stream=log)
    outcomes = run_all(runs, cfg, deadline=0.0, progress=progress, execute=execute)
    assert seen == [(0, "ucxrpc", None), (1, "ucxx", None)]
    assert progress.done == total                     # the failed run's steps count as done
    assert outcomes["ucxrpc"][0].result and outcomes["ucxx"][0].error
    text = log.getvalue()
    assert "[ucxrpc] done in 2.0 s (other processes: 50% of the CPUs)" in text
    assert "[ucxrpc] warning: other processes used 50%" in text
    assert "[raw ucxx] failed in 1.0 s" in text
