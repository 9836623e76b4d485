"""A one-line progress bar for long benchmark runs, on a terminal only.

Standard library only. The bar is redrawn in place with a carriage return,
so it is drawn only when the stream is a terminal (or when forced): in a log
file or a pipe, a stream of half-lines would be noise, and the per-run lines
that :meth:`Progress.log` prints say enough there.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress", "render_bar"]

_MIN_REDRAW_S = 0.1
_CLEAR = "\r\x1b[K"


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def render_bar(done: int, total: int, label: str, elapsed: float, width: int = 80) -> str:
    """``[#####-----]  50%  5/10  label  0:12``, at most ``width`` characters.

    The label is shortened (with ``…``) before the bar is; ``done`` is
    clamped to ``[0, total]``.
    """
    total = max(total, 1)
    done = min(max(done, 0), total)
    tail = f"  {100 * done // total:3d}%  {done}/{total}  "
    clock = f"  {_clock_text(elapsed)}"
    bar_width = max(10, min(20, width - len(tail) - len(clock) - 2 - 30))
    filled = bar_width * done // total
    bar = "[" + "#" * filled + "-" * (bar_width - filled) + "]"
    room = width - len(bar) - len(tail) - len(clock)
    if room < len(label):
        label = label[:max(0, room - 1)] + "…" if room > 1 else ""
    return (bar + tail + label + clock)[:width]


class Progress:
    """Counts steps over a whole benchmark and draws the bar.

    Args:
        total: steps in the whole benchmark.
        stream: where the bar and log lines go (default ``sys.stderr``).
        enabled: draw the bar; ``None`` means only if ``stream`` is a
            terminal.
        clock: seconds, for the elapsed time and redraw throttling.
    """

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.total, self.done = total, 0
        self.clock = clock
        self._start = clock()
        self._drawn_at: float | None = None
        self._run_label, self._step_label = "", ""
        self._run_end = 0

    def start_run(self, label: str, steps: int) -> None:
        """A run of ``steps`` steps begins (the ones before it count as done)."""
        self.done = self._run_end
        self._run_end = self.done + steps
        self._run_label, self._step_label = label, "starting"
        self._draw(force=True)

    def step(self, label: str) -> None:
        """One step of the current run finished; ``label`` says which."""
        self.done = min(self.done + 1, self._run_end)
        self._step_label = label
        self._draw()

    def end_run(self) -> None:
        """The run is over, finished or not: its steps count as done."""
        self.done = self._run_end
        self._draw(force=True)

    def log(self, line: str) -> None:
        """Print ``line`` above the bar (or just print it, without a bar)."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write(_CLEAR)
        self.stream.write(line + "\n")
        self.stream.flush()
        if self.enabled and self._drawn_at is not None:
            self._draw(force=True)

    def close(self) -> None:
        """Erase the bar; idempotent."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write(_CLEAR)
            self.stream.flush()
        self._drawn_at = None

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if not force and self._drawn_at is not None and now - self._drawn_at < _MIN_REDRAW_S:
            return
        width = shutil.get_terminal_size((80, 24)).columns - 1
        label = f"{self._run_label}: {self._step_label}" if self._step_label else self._run_label
        self.stream.write("\r" + render_bar(self.done, self.total, label, now - self._start,
                                            width) + "\x1b[K")
        self.stream.flush()
        self._drawn_at = now
