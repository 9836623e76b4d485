"""Run torch's shipped RPC tests against ucxrpc and report per test.

    .venv/bin/python -m tests.compat.run --report tests/compat/REPORT.md

runs the public set (every generated test not in ``excluded.py``), one test
at a time, and writes a Markdown report: the pass count, failures grouped by
cause (``known_failures.py``, then by error line), and every test's result
with the first line of its failure.  The report is rewritten after each test,
so an interrupted run still leaves one.  Options: ``-k SUBSTR`` and
``-t SUITE.TEST`` (both repeatable) to pick tests, ``--list`` to print the
set without running it, ``--from-json`` to regroup saved results,
``--include-excluded``, ``--timeout``, ``--start-method spawn`` (upstream's
way of starting ranks; slower), ``--json PATH``.

Time bounds: torch's ``MultiProcessTestCase`` waits ``--timeout`` seconds
(default 120) for a test's ranks, then terminates them and fails the test;
should the parent itself hang past that, a watchdog kills the test's ranks by
PID ``--timeout`` + 30 s in.  After every test, ranks still alive are killed
by PID (``fixture.kill_started``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["Result", "TestRef", "collect", "first_line", "main", "run_one"]

DEFAULT_TIMEOUT_S = 120
# How long past torch's own timeout the watchdog waits before it kills ranks.
_WATCHDOG_GRACE_S = 30


@dataclass(frozen=True)
class TestRef:
    """One generated test: ``key`` is ``"<torch suite>.<test>"``."""

    key: str
    class_name: str
    test_name: str


@dataclass
class Result:
    """How one test went: ``outcome`` is passed, failed, timeout or skipped."""

    key: str
    outcome: str
    seconds: float
    reason: str = ""
    details: str = ""


def collect(include_excluded: bool = False, patterns: Sequence[str] = (),
            keys: Sequence[str] = ()) -> tuple[list[TestRef], list[str]]:
    """The tests to run, in suite order, and the stale keys of ``excluded.py``.

    With ``patterns`` or ``keys``, only tests whose key contains one of the
    patterns or equals one of the keys (excluded ones too, when named).

    Imports ``tests.compat.suites`` (which installs the shim).
    """
    from tests.compat import excluded, suites

    loader = unittest.TestLoader()
    refs, known = [], set()
    for class_name, cls in suites.CLASSES.items():
        suite = class_name[len(suites.PREFIX):]
        for test_name in loader.getTestCaseNames(cls):
            key = f"{suite}.{test_name}"
            known.add(key)
            named = key in keys
            if key in excluded.EXCLUDED and not (include_excluded or named):
                continue
            if (patterns or keys) and not (named or any(p in key for p in patterns)):
                continue
            refs.append(TestRef(key, class_name, test_name))
    stale = sorted(set(excluded.EXCLUDED) - known)
    return refs, stale


def run_one(ref: TestRef, timeout: float) -> Result:
    """Run one generated test in this process (its ranks in child processes)."""
    from tests.compat import fixture, suites

    case = suites.CLASSES[ref.class_name](ref.test_name)
    outcome = unittest.TestResult()
    # torch's parent logs a timed-out rank's stacks (and little else) here.
    stacks = _Capture()
    torch_log = logging.getLogger("torch.testing._internal.common_distributed")
    torch_log.addHandler(stacks)
    watchdog = threading.Timer(timeout + _WATCHDOG_GRACE_S, fixture.kill_started, (0.0,))
    watchdog.daemon = True
    start = time.monotonic()
    watchdog.start()
    try:
        case.run(outcome)
    finally:
        watchdog.cancel()
        torch_log.removeHandler(stacks)
        killed = fixture.kill_started()
    seconds = time.monotonic() - start
    result = _result(ref.key, outcome, seconds, killed)
    if result.outcome != "passed" and stacks.lines:
        result.details += "\n\ntorch's log of the test:\n" + "\n".join(stacks.lines)
    return result


class _Capture(logging.Handler):
    """Keeps the text of ERROR records logged during one test."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _result(key: str, outcome: unittest.TestResult, seconds: float, killed: list[int]) -> Result:
    problems = outcome.errors + outcome.failures
    if problems:
        details = problems[0][1]
        reason = first_line(details)
        state = "timeout" if reason.startswith("timed out") else "failed"
    elif outcome.skipped:
        state, details = "skipped", outcome.skipped[0][1]
        reason = details.splitlines()[0] if details else "skipped"
    elif outcome.testsRun != 1:
        state, details, reason = "failed", "", "did not run"
    else:
        state, details, reason = "passed", "", ""
    if killed:
        note = f"ranks still alive after the test were killed: pids {killed}"
        details = f"{details}\n{note}".strip()
        reason = reason or note
    return Result(key, state, round(seconds, 1), reason, details)


_CHILD_ERROR = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")
_TIMED_OUT = re.compile(r"Process (\d+) terminated or timed out after ([\d.]+) seconds")
# Errors a rank gets because another rank failed first and was stopped.
_SECONDARY = re.compile(r"unreachable|is broken|process is gone|Connection closed by peer|"
                        r"Connection reset by peer|peer .* (died|exited)")


def first_line(details: str) -> str:
    """The first line of the error that failed a test, from unittest's text.

    torch's parent raises "Process N exited with error code 10 and exception:"
    followed by each failed rank's traceback.  The reason is the final
    exception line of the first rank whose error is not just a peer having
    gone away (when one rank fails, torch stops the others, whose calls then
    fail), prefixed with the rank.  Timeouts and other parent-side failures
    give the parent's own exception line.
    """
    starts = list(_CHILD_ERROR.finditer(details))
    if starts:
        ranks = []
        for n, m in enumerate(starts):
            end = starts[n + 1].start() if n + 1 < len(starts) else len(details)
            ranks.append((m.group(1), _exception_line(details[m.end():end])))
        rank, line = next(((r, x) for r, x in ranks if not _SECONDARY.search(x)), ranks[0])
        return f"rank {rank}: {line}"
    m = _TIMED_OUT.search(details)
    if m:
        return f"timed out: rank {m.group(1)} still running after {float(m.group(2)):.0f} s"
    return _exception_line(details)


def _exception_line(tb: str) -> str:
    """The header line of the last exception in a formatted traceback."""
    lines = tb.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    i = starts[-1] + 1 if starts else 0
    while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        i += 1
    line = lines[i] if i < len(lines) else (lines[-1] if lines else "")
    # A remote error's header ("TypeError: On WorkerInfo(id=2, name=worker2):")
    # says where; the line after it says what.
    if line.endswith(":") and i + 1 < len(lines) and lines[i + 1].strip():
        line = f"{line} {lines[i + 1].strip()}"
    return line.strip()[:300]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from tests.compat import START_METHODS

    p = argparse.ArgumentParser(prog="python -m tests.compat.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", default="tests/compat/REPORT.md",
                   help="Markdown report to write (default: %(default)s)")
    p.add_argument("--json", help="also write every result, with full details, as JSON")
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="run only tests whose '<suite>.<test>' contains this (repeatable)")
    p.add_argument("-t", "--test", dest="keys", action="append", default=[],
                   help="run this '<suite>.<test>' (exact; repeatable)")
    p.add_argument("--from-json", metavar="PATH",
                   help="write the report from a --json file of an earlier run, run nothing")
    p.add_argument("--include-excluded", action="store_true",
                   help="run the tests excluded.py lists too")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds torch's fixture gives each test (default: %(default)s)")
    p.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                   help="how ranks start (default: %(default)s; spawn is upstream's)")
    p.add_argument("--list", action="store_true", help="print the tests and exit")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected tests; return 0 when all passed, 1 otherwise."""
    args = _parse(argv)
    if args.from_json:
        return _rerender(args.from_json, args.report)
    if args.start_method == "forkserver" and not args.list:
        _start_forkserver()
    refs, stale = collect(args.include_excluded, args.patterns, args.keys)
    missing = sorted(set(args.keys) - {ref.key for ref in refs})
    if missing:
        print(f"no such test: {', '.join(missing)}", file=sys.stderr)
        return 2
    for key in stale:
        print(f"warning: excluded.py lists {key}, which torch no longer has", file=sys.stderr)
    if args.list:
        for ref in refs:
            print(ref.key)
        print(f"{len(refs)} tests", file=sys.stderr)
        return 0
    from tests.compat import fixture, report
    from torch.testing._internal import common_distributed

    fixture.set_start_method(args.start_method)
    # torch's fixture reads this at each test: its wait for the ranks.
    common_distributed.TIMEOUT_DEFAULT = args.timeout
    logging.getLogger("torch.testing._internal.common_distributed").setLevel(logging.WARNING)
    meta = report.run_metadata(args.start_method, args.timeout, sys.argv)
    results: list[Result] = []
    for n, ref in enumerate(refs, 1):
        try:
            res = run_one(ref, args.timeout)
        except Exception:  # the runner's own failure: report it, go on
            res = Result(ref.key, "failed", 0.0, "runner error: " + traceback.format_exc(
                limit=1).strip().splitlines()[-1], traceback.format_exc())
        results.append(res)
        print(f"[{n}/{len(refs)}] {res.outcome:7} {res.seconds:6.1f}s {ref.key}"
              + (f"  -- {res.reason}" if res.reason else ""), flush=True)
        report.write(args.report, results, len(refs), meta)
        if args.json:
            _write_json(args.json, results, meta)
    passed = sum(r.outcome == "passed" for r in results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


def _start_forkserver() -> None:
    """Start the ranks' forkserver now, before this process imports anything
    heavy: its import of the suites (seconds of CPU) then runs beside this
    process's own import of them (``collect``) instead of holding up the
    first test.  A fresh interpreter either way; the fixture finds it running."""
    import multiprocessing
    from multiprocessing import forkserver

    from tests.compat import FORKSERVER_PRELOAD

    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()


def _rerender(path: str, report_path: str) -> int:
    """Rewrite the report from saved results, the reasons re-read from the details."""
    from tests.compat import report

    with open(path) as f:
        saved = json.load(f)
    results = [Result(**r) for r in saved["results"]]
    for r in results:
        if r.outcome in ("failed", "timeout") and r.details:
            r.reason = first_line(r.details)
    report.write(report_path, results, len(results), saved["meta"])
    return 0


def _write_json(path: str, results: list[Result], meta: dict[str, str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
