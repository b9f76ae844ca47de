"""The live view with an injected front end: what is drawn, how often, and without torch."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from nbaccel.display import ConsoleFrontend, LiveView, Panel, figure, png, progress
from nbaccel.metrics import SAMPLES, STEPS, Record
from nbaccel.run import Run


class Clock:
    """A clock that moves only when told: no verdict here depends on the machine's speed.
    Steps are binary fractions, so sums of them are exact."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A front end that keeps what it was given; a panel "costs" ``draw_cost`` seconds of the
    injected clock, as drawing would cost the real one."""

    draws = True

    def __init__(self, clock: Clock | None = None, draw_cost: float = 0.0):
        self.texts, self.images, self.closed = [], [], False
        self.clock, self.draw_cost = clock, draw_cost
        self.drawn_at: list[float] = []

    def text(self, line):
        self.texts.append(line)

    def image(self, png):
        if self.clock:
            self.drawn_at.append(self.clock.now)
            self.clock.now += self.draw_cost
        self.images.append(png)

    def close(self):
        self.closed = True


def a_run(steps: int = 20, ranks: int = 2, start: float | None = None) -> Run:
    start = time.time() if start is None else start
    run = Run(world_size=ranks, started=start)
    for step in range(steps):
        for rank in range(ranks):
            t = start + step * 0.1
            run.add(
                [
                    Record(rank, step, t, "loss", 1.0 / (step + 1) + rank),
                    Record(rank, step, t, SAMPLES, 32.0 * step),
                    Record(rank, step, t, STEPS, float(step)),
                ]
            )
    return run


TICK = 2**-7  # about 8 ms of the injected clock between two updates


def feed(view: LiveView, run: Run, clock: Clock, seconds: float) -> None:
    """Add a record and update the view every ``TICK`` of ``clock``, for ``seconds`` of it."""
    end = clock.now + seconds
    while clock.now < end:
        run.add([Record(0, len(run.records), 1e9 + clock.now, "loss", 0.5)])
        view.update(run)
        clock.now += TICK


def test_the_progress_line_is_throttled_to_four_a_second():
    clock = Clock()
    front = Recorder()
    front.draws = False
    view = LiveView(front, text_interval=0.25, clock=clock)
    feed(view, a_run(steps=1), clock, 1.5)  # 192 updates
    assert len(front.texts) == 6  # at 0, 0.25, ..., 1.25 s: not one per update


def test_the_panel_is_throttled_and_the_end_is_always_drawn():
    clock = Clock()
    front = Recorder(clock, draw_cost=0.125)  # a panel takes 0.1-0.3 s of a core here
    view = LiveView(front, image_interval=0.25, first_panels=3, clock=clock)
    run = a_run(steps=1)
    feed(view, run, clock, 20.0)
    # the first panel after a second's worth of data (here 0.25 s), the next two at the plain
    # interval from the start of the one before; then none for 100 times a panel's drawing
    # time (12.5 s), so that drawing costs at most 1% of a core
    start = 1000.0
    assert front.drawn_at == [start + 0.25, start + 0.5, start + 0.75, start + 0.75 + 12.625]
    view.close(run)
    assert len(front.images) == 5 and front.closed  # the final state, once more
    assert front.images[-1][:8] == b"\x89PNG\r\n\x1a\n"


def test_a_panel_redrawn_as_the_run_grows_equals_one_drawn_afresh():
    records = a_run(steps=300, start=5000.0).records
    panel = Panel()
    for cut in (10, 120, 250, len(records)):  # more steps, a wider time axis, new limits
        run = Run(world_size=2, started=records[0].time)
        run.add(records[:cut])
        now = records[cut - 1].time + 0.5  # the title's clock, as the live view would read it
        redrawn = panel.png(run, now=now)
    assert redrawn == png(run, now=now)  # the same bytes as a figure built from the final records
    assert redrawn != png(run, now=now + 1)  # and the title's clock is part of them


def test_a_rank_heard_late_takes_its_place_in_the_legend():
    run = Run(world_size=3)
    panel = Panel()
    for step, ranks in enumerate([(2,), (2, 0), (2, 0, 1)]):
        run.add([Record(rank, step, time.time(), "loss", 1.0 / (step + 1)) for rank in ranks])
        panel.update(run)
    labels = [text.get_text() for text in panel.loss_ax.get_legend().get_texts()]
    assert labels == ["rank 0", "rank 1", "rank 2", "mean"]


def test_nothing_is_shown_before_anything_is_recorded(monkeypatch):
    import nbaccel.display

    front = Recorder()
    LiveView(front)  # matplotlib is warmed once a process, not once a launch
    made = []
    monkeypatch.setattr(nbaccel.display, "Panel", lambda: made.append(1) or Panel())
    view = LiveView(front)
    view.close(Run())
    assert front.texts == [] and front.images == []
    assert made == []  # a launch that logs nothing builds no figure (it costs 0.2 s)


def test_the_panel_plots_each_rank_faint_and_the_mean_bold():
    fig = figure(a_run())
    loss_ax, speed_ax = fig.axes
    assert [line.get_label() for line in loss_ax.lines] == ["rank 0", "rank 1", "mean"]
    assert loss_ax.lines[-1].get_linewidth() > loss_ax.lines[0].get_linewidth()
    assert [line.get_label() for line in speed_ax.lines] == ["rank 0", "rank 1", "total"]
    total = speed_ax.lines[-1].get_ydata()
    assert abs(max(total) - 2 * 320.0) < 0.01  # 32 samples per 0.1 s on each of two ranks


def test_progress_reads_like_a_sentence():
    run = a_run(steps=20, start=5000.0)
    line = progress(run, total_steps=40, now=5002.0)
    assert line.startswith("step 19/40 | 2 ranks | 640 samples/s | 100 ms/step | loss ")
    assert line.endswith(" | 2 s, ETA 2 s")  # 19 steps in 2 s, 21 to go
    run.device = "CPU"  # a launch says what its ranks train on
    assert progress(run, total_steps=40, now=5002.0).startswith("step 19/40 | 2 ranks on CPU |")


def test_a_terminal_gets_one_line_rewritten_then_ended():
    stream = io.StringIO()
    view = LiveView(ConsoleFrontend(stream, tty=True), text_interval=0)
    run = a_run(steps=3)
    view.update(run)
    view.close(run)
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().endswith("\n")


def test_a_log_gets_plain_lines_now_and_then_and_the_final_state():
    stream = io.StringIO()
    clock = Clock()
    front = ConsoleFrontend(stream, tty=False, log_interval=60, clock=clock)
    view = LiveView(front, text_interval=0, clock=clock)
    run = a_run(steps=3)
    for _ in range(20):
        view.update(run)
        clock.now += 1
    run.add([Record(0, 3, time.time(), "loss", 0.125)])
    view.close(run)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 2  # the first, and the last
    assert "loss 0.8333" in lines[0] and "loss 0.7292" in lines[1]  # mean of ranks latest


def test_a_saved_panel(tmp_path):
    run = a_run()
    LiveView(Recorder(), save_png=str(tmp_path / "final.png")).close(run)
    assert (tmp_path / "final.png").read_bytes()[:4] == b"\x89PNG"


def test_the_display_side_imports_no_torch():
    code = (
        "import sys, nbaccel.display as d, nbaccel.metrics as m, nbaccel.run as r\n"
        "run = r.Run(); run.add([m.Record(0, 0, 0.0, 'loss', 1.0)]); d.png(run)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
