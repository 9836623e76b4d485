#!/usr/bin/env python
"""A per-frame table of where each thread's time goes, from py-spy's raw
(collapsed) stacks.

    py-spy record --threads --idle --rate 400 --format raw -o rank0.txt --pid PID
    python benchmarks/stacks.py rank0.txt [--per-call-us 937] [--top 25]

Each line of the input is ``thread (tid): name;frame;frame;... count``
(``--threads`` puts the thread first; without it every sample is one
thread).  For each thread, the table gives every frame's inclusive share of
that thread's samples (a frame counted once per sample, however deep it
recurs), and, with ``--per-call-us`` (a loop's median call time), that share
as microseconds per call.  Frames are ``function (file)``: lines are
dropped, so one function's calls from several lines add up.  Idle samples
(py-spy's ``--idle``) stay in: a thread asleep in ``epoll`` is part of the
answer.

The GPU check's ``percall`` step writes one such table per rank
(benchmarks/gpu_check.sh); ``tests/bench/test_stacks.py`` runs it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

__all__ = ["frame_shares", "parse", "render"]

_LINE = re.compile(r"^(?P<stack>.*)\s(?P<count>\d+)$")
_THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\):?\s*(?P<name>.*)$")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::\d+)?\)$")


def _frame(text: str) -> str:
    """``func (file)``, its line number dropped."""
    found = _FRAME.match(text.strip())
    return f"{found['func']} ({found['file']})" if found else text.strip()


def parse(lines: Iterable[str]) -> dict[str, list[tuple[list[str], int]]]:
    """Samples per thread name: (frames outermost first, count) pairs.
    Malformed lines are skipped."""
    out: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in lines:
        found = _LINE.match(line.rstrip("\n"))
        if not found:
            continue
        parts = found["stack"].split(";")
        thread = "all"
        head = _THREAD.match(parts[0])
        if head:
            thread = head["name"] or f"tid {head['tid']}"
            parts = parts[1:]
        out[thread].append(([_frame(p) for p in parts if p], int(found["count"])))
    return dict(out)


def frame_shares(samples: list[tuple[list[str], int]]) -> tuple[int, list[tuple[str, float]]]:
    """(total samples, [(frame, inclusive share)] largest first)."""
    total = sum(n for _, n in samples)
    seen: Counter[str] = Counter()
    for frames, n in samples:
        for f in set(frames):
            seen[f] += n
    return total, [(f, c / total) for f, c in seen.most_common()] if total else []


def render(threads: dict[str, list[tuple[list[str], int]]], per_call_us: float | None,
           top: int) -> str:
    """The table, a section per thread (most samples first)."""
    out = []
    for name, samples in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        total, shares = frame_shares(samples)
        out.append(f"## {name}: {total} samples")
        out.append(f"{'share':>7}  {'us/call':>8}  frame")
        for frame, share in shares[:top]:
            us = f"{share * per_call_us:8.1f}" if per_call_us else f"{'':8}"
            out.append(f"{share * 100:6.1f}%  {us}  {frame}")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", help="py-spy --format raw output")
    parser.add_argument("--per-call-us", type=float, default=None,
                        help="median call time of the sampled loop, to show µs per call")
    parser.add_argument("--top", type=int, default=30, help="frames per thread (default 30)")
    parser.add_argument("--thread", default=None, help="only threads whose name contains this")
    args = parser.parse_args(argv)
    with open(args.stacks, encoding="utf-8") as f:
        threads = parse(f)
    if args.thread:
        threads = {k: v for k, v in threads.items() if args.thread in k}
    if not threads:
        print(f"no samples in {args.stacks}", file=sys.stderr)
        return 1
    print(render(threads, args.per_call_us, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
