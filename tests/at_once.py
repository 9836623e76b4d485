"""Subprocesses a test starts at once and waits for under one deadline.

Several tests run independent programs that each import torch and ucxrpc
(seconds of CPU); one after another they left one of CI's two cores idle.
:func:`run_at_once` starts them all, then collects them; what still runs
at the deadline is killed, and every process it started (also when a later
one failed to start) is reaped before it returns or raises.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping


def run_at_once(starts: Mapping[str, Callable[[], subprocess.Popen[str]]],
                timeout: float) -> dict[str, subprocess.CompletedProcess[str]]:
    """Call each of ``starts`` (each returns a process started with stdout
    and stderr piped, as text), then wait for them all under one deadline of
    ``timeout`` seconds; name -> its completed process (a killed one's
    stderr says so)."""
    procs: dict[str, subprocess.Popen[str]] = {}
    outs: dict[str, tuple[str, str]] = {}
    try:
        for name, start in starts.items():
            procs[name] = start()
        deadline = time.monotonic() + timeout
        for name, proc in procs.items():
            try:
                outs[name] = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outs[name] = ("", f"(still running after {timeout:g} s: killed)")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    return {name: subprocess.CompletedProcess(proc.args, proc.returncode, *outs[name])
            for name, proc in procs.items()}
