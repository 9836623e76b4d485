"""The progress bar: rendering, terminal detection, throttling, log lines."""

from __future__ import annotations

import io

from ucxrpc.bench.progress import Progress, render_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_render_bar():
    line = render_bar(5, 10, "ucxrpc: one-way 4 KiB", 72.0, width=80)
    assert line.startswith("[") and "] " in line
    assert " 50%  5/10  ucxrpc: one-way 4 KiB" in line and line.endswith("1:12")
    assert len(line) <= 80
    assert render_bar(0, 10, "x", 0, 80).count("#") == 0
    full = render_bar(12, 10, "x", 3725.0, 80)            # clamped
    assert "100%  10/10" in full and "-" not in full.split("]")[0] and "1:02:05" in full


def test_render_bar_shortens_the_label_first():
    line = render_bar(1, 3, "a very long label " * 10, 5.0, width=60)
    assert len(line) <= 60 and "…" in line and "[" in line and line.endswith("0:05")


def test_bar_counts_steps_across_runs_and_redraws_in_place():
    out, clock = _Terminal(), _Clock()
    bar = Progress(total=6, stream=out, clock=clock)
    assert bar.enabled
    bar.start_run("ucxrpc", 3)
    clock.now += 1
    bar.step("latency")
    assert bar.done == 1 and "ucxrpc: latency" in out.getvalue()
    bar.end_run()                      # a failed run's missing steps count as done
    assert bar.done == 3
    bar.start_run("torch", 3)
    for _ in range(5):                 # never past the run's own steps
        clock.now += 1
        bar.step("x")
    assert bar.done == 6
    assert "\n" not in out.getvalue() and out.getvalue().count("\r") >= 4
    bar.close()
    assert out.getvalue().endswith("\r\x1b[K")


def test_redraws_are_throttled():
    out, clock = _Terminal(), _Clock()
    bar = Progress(total=100, stream=out, clock=clock)
    bar.start_run("r", 100)
    drawn = out.getvalue().count("\r")
    for _ in range(50):                # no time passes: no redraw
        bar.step("s")
    assert out.getvalue().count("\r") == drawn
    clock.now += 1
    bar.step("s")
    assert out.getvalue().count("\r") == drawn + 1


def test_log_lines_go_above_the_bar():
    out = _Terminal()
    bar = Progress(total=2, stream=out, clock=_Clock())
    bar.start_run("r", 2)
    bar.log("[r] done in 1.0 s")
    text = out.getvalue()
    assert "\r\x1b[K[r] done in 1.0 s\n" in text and text.rstrip().endswith("0:00\x1b[K")


def test_no_bar_unless_a_terminal_or_forced():
    pipe = io.StringIO()
    bar = Progress(total=2, stream=pipe)
    assert not bar.enabled
    bar.start_run("r", 2)
    bar.step("s")
    bar.log("[r] running ...")
    bar.close()
    assert pipe.getvalue() == "[r] running ...\n"
    forced = io.StringIO()
    bar = Progress(total=2, stream=forced, enabled=True, clock=_Clock())
    bar.start_run("r", 2)
    assert "[" in forced.getvalue()
    assert not Progress(total=1, stream=_Terminal(), enabled=False).enabled
