"""The Markdown report of a compat run (``REPORT.md``).

Failures are grouped by cause: first the groups of ``known_failures.py``
(causes found by reading the failures), then whatever failed outside them,
grouped by its error line with numbers masked.  Known failures that passed
this time are listed so that the list can be pruned.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["render", "run_metadata", "write"]


def run_metadata(start_method: str, timeout: float, argv: Sequence[str]) -> dict[str, str]:
    """What a report says about the run it comes from."""
    import torch

    import ucxrpc

    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__,
        "ucxrpc": f"{ucxrpc.__version__} ({_revision()})",
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
        "start_method": start_method,
        "timeout_s": f"{timeout:g}",
        "command": ".venv/bin/python -m tests.compat.run " + " ".join(argv[1:]),
    }


def _revision() -> str:
    """The checkout's commit, and whether ucxrpc/ differs from it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "ucxrpc"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    if not head:
        return "commit unknown"
    return f"commit {head}" + (", with uncommitted changes in ucxrpc/" if dirty else "")


def write(path: str, results: Sequence[Any], planned: int, meta: dict[str, str]) -> None:
    """Write the report for ``results`` (of ``planned`` tests) to ``path``, atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(render(results, planned, meta))
    os.replace(tmp, path)


def render(results: Sequence[Any], planned: int, meta: dict[str, str]) -> str:
    """The report's text."""
    from tests.compat.known_failures import KNOWN_FAILURES

    passed = [r for r in results if r.outcome == "passed"]
    failed = [r for r in results if r.outcome != "passed"]
    out = ["# torch's RPC tests on ucxrpc", ""]
    out += _summary(results, planned, len(passed), meta)
    out += _failure_groups(failed, KNOWN_FAILURES)
    fixed = [(label, r.key) for r in passed for label, (_, keys) in KNOWN_FAILURES.items()
             if r.key in keys]
    if fixed:
        out += ["## Listed in known_failures.py, passed this run", ""]
        out += [f"- `{key}` ({label})" for label, key in fixed] + [""]
    out += ["## Every test", "", "| test | result | s | first line of the failure |",
            "|---|---|---:|---|"]
    out += [f"| `{r.key}` | {r.outcome} | {r.seconds:.1f} | {_cell(r.reason)} |"
            for r in results]
    return "\n".join(out) + "\n"


def _summary(results: Sequence[Any], planned: int, passed: int,
             meta: dict[str, str]) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        counts[r.outcome] += 1
    state = "complete" if len(results) == planned else f"partial: {len(results)} of {planned} run"
    other = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if k != "passed")
    total_s = sum(r.seconds for r in results)
    return [
        f"**{passed} of {planned} passed** ({state}{'; ' + other if other else ''}).", "",
        f"- torch {meta['torch']}, ucxrpc {meta['ucxrpc']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs; {meta['date']}",
        f"- ranks started by {meta['start_method']}; torch's per-test timeout "
        f"{meta['timeout_s']} s; {total_s / 60:.0f} min of tests",
        f"- `{meta['command'].strip()}`",
        "- The set: every test torch's `rpc_utils.generate_tests` makes from its generic "
        "and TensorPipe suites, less `tests/compat/excluded.py` (JIT, CUDA, faulty "
        "agent, torch's backend registry, torch internals, one test torch skips on Linux).",
        "",
    ]


def _failure_groups(failed: Sequence[Any],
                    known: dict[str, tuple[str, tuple[str, ...]]]) -> list[str]:
    if not failed:
        return []
    out = [f"## Failures by cause ({len(failed)})", ""]
    placed = set()
    for label, (description, keys) in known.items():
        members = [r for r in failed if r.key in keys]
        if not members:
            continue
        placed.update(r.key for r in members)
        out += [f"### {label} ({len(members)})", "", description, ""]
        out += [f"- `{r.key}`: {_inline(r.reason)}" for r in members] + [""]
    rest: dict[str, list[Any]] = defaultdict(list)
    for r in failed:
        if r.key not in placed:
            rest[_shape(r.reason)].append(r)
    for shape, members in sorted(rest.items(), key=lambda kv: -len(kv[1])):
        out += [f"### Not yet classified: {_inline(shape)} ({len(members)})", ""]
        out += [f"- `{r.key}`: {_inline(r.reason)}" for r in members] + [""]
    return out


def _shape(reason: str) -> str:
    """An error line with ranks, numbers, ids and addresses masked, to group by."""
    shape = re.sub(r"^rank \d+: ", "", reason)
    shape = re.sub(r"0x[0-9a-f]+", "0x…", shape)
    return re.sub(r"\d+(\.\d+)?", "N", shape)[:160]


def _inline(text: str) -> str:
    return "`" + text.replace("`", "'") + "`" if text else "(no message)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")
