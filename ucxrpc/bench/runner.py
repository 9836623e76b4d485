"""Run every series of a benchmark, locally or as one of two hosts.

A benchmark is a list of :class:`Run` (a series and its round, with
``--repeat``), run one after the other under one deadline with a progress
bar over all of them. Locally each run spawns both ranks
(:func:`ucxrpc.bench.launch.run_local`); across hosts rank 0 drives the same
list through a :class:`ucxrpc.bench.hosts.HostSession` and rank 1 follows
the list rank 0 published (:func:`serve_rank1`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .launch import RunOutcome, run_local
from .plan import Series
from .progress import Progress
from .workload import WorkloadConfig, count_steps, describe_config

__all__ = ["BUSY_WARN", "Run", "plan_runs", "run_all", "serve_rank1"]

#: Share of all CPUs other processes may take during a run before the figures
#: come with a warning.
BUSY_WARN = 0.05


@dataclass(frozen=True)
class Run:
    series: Series
    round: int
    rounds: int

    @property
    def tag(self) -> str:
        label = self.series.label
        return label if self.rounds == 1 else f"{label} {self.round + 1}/{self.rounds}"

    def config(self, cfg: WorkloadConfig) -> WorkloadConfig:
        return dataclasses.replace(cfg, transports=self.series.transports)


def plan_runs(series: Sequence[Series], repeat: int) -> list[Run]:
    """Every series ``repeat`` times, interleaved (a, b, a, b, ...).

    Interleaving spreads slow drifts of the machine over every series
    instead of loading them onto whichever ran last.
    """
    return [Run(s, r, repeat) for r in range(repeat) for s in series]


def run_all(runs: Sequence[Run], cfg: WorkloadConfig, deadline: float, progress: Progress,
            execute: Callable[[int, Run, WorkloadConfig, float, Any], RunOutcome] | None = None,
            ) -> dict[str, list[RunOutcome]]:
    """Run ``runs`` in order; outcomes per series key, in run order.

    ``execute(index, run, config, deadline, on_progress)`` runs one (default:
    both ranks on this host). Progress and per-run lines go to ``progress``.
    """
    def local(index: int, run: Run, run_cfg: WorkloadConfig, until: float,
              on_progress: Any) -> RunOutcome:
        return run_local(run.series.key, run.series.impl, run_cfg, until, on_progress)

    execute = execute or local
    outcomes: dict[str, list[RunOutcome]] = {}
    for index, run in enumerate(runs):
        run_cfg = run.config(cfg)
        progress.start_run(run.tag, count_steps(run.series.impl, run_cfg))
        if not progress.enabled:
            progress.log(f"[{run.tag}] running ...")
        try:
            outcome = execute(index, run, run_cfg, deadline, progress.step)
        finally:
            progress.end_run()
        _log_outcome(progress, run.tag, outcome)
        outcomes.setdefault(run.series.key, []).append(outcome)
    return outcomes


def _log_outcome(progress: Progress, tag: str, outcome: RunOutcome) -> None:
    state = "failed" if outcome.error else "done"
    others = "" if outcome.cpu_others is None else \
        f" (other processes: {outcome.cpu_others:.0%} of the CPUs)"
    progress.log(f"[{tag}] {state} in {outcome.wall_s:.1f} s{others}")
    if outcome.cpu_others is not None and outcome.cpu_others > BUSY_WARN:
        outcome.warnings.append(
            f"other processes used {outcome.cpu_others:.0%} of the CPUs during this "
            "run; its figures are distorted (a benchmark wants the machine to itself)")
    for warning in outcome.warnings:
        progress.log(f"[{tag}] warning: {warning}")


def plan_document(runs: Sequence[Run], cfg: WorkloadConfig, device: str, host: str,
                  timeout_s: float) -> dict[str, Any]:
    """What rank 0 publishes for rank 1: JSON-ready."""
    return {"runs": [{"impl": r.series.impl, "key": r.series.key,
                      "transports": list(r.series.transports or ()) or None,
                      "round": r.round, "rounds": r.rounds} for r in runs],
            "config": describe_config(cfg), "device": device, "host": host,
            "timeout_s": timeout_s}


def _runs_from(doc: dict[str, Any]) -> tuple[list[Run], WorkloadConfig]:
    fields = dict(doc["config"])
    fields["sizes"] = tuple(fields["sizes"])
    fields["transports"] = tuple(fields["transports"]) if fields.get("transports") else None
    cfg = WorkloadConfig(**fields)
    runs = [Run(Series(r["impl"], tuple(r["transports"]) if r["transports"] else None,
                       r["key"]), r["round"], r["rounds"]) for r in doc["runs"]]
    return runs, cfg


def serve_rank1(session: Any, join_deadline: float) -> int:
    """Rank 1's whole benchmark: follow rank 0's plan, run by run, under rank
    0's timeout (counted from when the plan arrived).

    Returns:
        0 when every run finished on this side, 1 otherwise.
    """
    plan = session.join(join_deadline)
    deadline = time.monotonic() + float(plan["timeout_s"])
    runs, cfg = _runs_from(plan)
    device = plan["local_device"]
    print(f"rank 1: {len(runs)} runs with {plan.get('host', '?')} (rank 0), tensors on {device}",
          file=sys.stderr, flush=True)
    failed = 0
    for index, run in enumerate(runs):
        outcome = session.serve(index, run.series.key, run.series.impl, run.config(cfg),
                                device, deadline)
        state = f"failed: {outcome.error}" if outcome.error else "done"
        print(f"rank 1: [{run.tag}] {state} ({outcome.wall_s:.1f} s)", file=sys.stderr,
              flush=True)
        failed += outcome.error is not None
    session.close(deadline)
    return 1 if failed else 0
