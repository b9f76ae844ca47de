"""The live view with an injected front end: what is drawn, how often, and without torch."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
from matplotlib.colors import to_rgb

from nbaccel.observe.channel import (
    BREAKDOWN,
    MEMORY,
    RSS,
    SAMPLES,
    STEPS,
    TIME_COMMUNICATION,
    TIME_COMPUTE,
    TIME_DATA,
    TIME_LOOP,
    Record,
)
from nbaccel.observe.live.line import progress
from nbaccel.observe.live.panel import NO_MEMORY, Panel, _speed_title, figure, png
from nbaccel.observe.live.view import ConsoleFrontend, LiveView
from nbaccel.observe.records import Run


class Clock:
    """A clock that moves only when told: no verdict here depends on the machine's speed.
    Steps are binary fractions, so sums of them are exact."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeFrontend:
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
    front = FakeFrontend()
    front.draws = False
    view = LiveView(front, text_interval=0.25, clock=clock)
    feed(view, a_run(steps=1), clock, 1.5)  # 192 updates
    assert len(front.texts) == 6  # at 0, 0.25, ..., 1.25 s: not one per update


def test_the_panel_is_throttled_and_the_end_is_always_drawn():
    clock = Clock()
    front = FakeFrontend(clock, draw_cost=0.125)  # a panel takes 0.1-0.3 s of a core here
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
    import nbaccel.observe.live.view

    front = FakeFrontend()
    LiveView(front)  # matplotlib is warmed once a process, not once a launch
    made = []
    monkeypatch.setattr(nbaccel.observe.live.view, "Panel", lambda: made.append(1) or Panel())
    view = LiveView(front)
    view.close(Run())
    assert front.texts == [] and front.images == []
    assert made == []  # a launch that logs nothing builds no figure (it costs 0.2 s)


def test_the_panel_plots_each_rank_faint_and_the_mean_bold():
    fig = figure(a_run())
    loss_ax, speed_ax, memory_ax = fig.axes
    assert len(memory_ax.lines) == 0  # no rank recorded its CPU memory
    assert [line.get_label() for line in loss_ax.lines] == ["rank 0", "rank 1", "mean"]
    assert loss_ax.lines[-1].get_linewidth() > loss_ax.lines[0].get_linewidth()
    assert [line.get_label() for line in speed_ax.lines] == ["rank 0", "rank 1", "total"]
    total = speed_ax.lines[-1].get_ydata()
    assert abs(max(total) - 2 * 320.0) < 0.01  # 32 samples per 0.1 s on each of two ranks


def with_memory(run: Run) -> Run:
    """``run`` with each rank's CPU memory recorded every quarter second: rank r at
    1,000 * (r + 1) MiB, growing by 10 MiB a record."""
    for rank in range(run.world_size):
        run.add(
            [
                Record(rank, i, run.started + 0.25 * i, RSS, 1000.0 * (rank + 1) + 10 * i)
                for i in range(8)
            ]
        )
    return run


def test_the_panel_draws_each_rank_cpu_memory_against_time_or_says_why_not():
    panel = Panel()
    panel.update(a_run(start=5000.0), now=5002.0)
    texts = [t.get_text() for t in panel.memory_ax.texts]
    assert NO_MEMORY in texts and "no CPU memory recorded" in NO_MEMORY
    assert len(panel.memory_ax.lines) == 0
    assert panel.memory_ax.get_title() == "CPU memory (RSS)"
    panel.update(with_memory(a_run(start=5000.0)), now=5002.0)
    assert all(t.get_text() == "" for t in panel.memory_ax.texts)
    rank0, rank1 = panel.memory_ax.lines
    assert (rank0.get_label(), rank1.get_label()) == ("rank 0", "rank 1")
    assert list(rank1.get_xdata()) == [0.25 * i for i in range(8)]  # seconds since the launch
    assert list(rank1.get_ydata()) == [2000.0 + 10 * i for i in range(8)]
    assert panel.memory_ax.get_ylim()[0] == 0


def test_a_rate_over_a_pause_says_how_long_it_spans():
    """Counters are recorded only when they moved, so the first record after a pause reaches
    back to the last one before it: the rate spans the pause, and the line says so."""
    run = a_run(start=5000.0)  # 32 samples every 0.1 s on each rank, to 5001.9
    assert run.live_span() == pytest.approx(1.9) and "(last 2 s)" in progress(run, now=5002.0)
    for rank in (0, 1):  # 10 s later, one more batch on each rank
        run.add([Record(rank, 20, 5011.9, SAMPLES, 32.0 * 20)])
    assert run.live_span() == pytest.approx(10.0)
    assert run.live_samples_per_s() == pytest.approx(2 * 32 / 10.0)
    assert " | 6 samples/s (last 10 s) | " in progress(run, now=5012.0)


def test_the_panel_says_the_seconds_its_points_span():
    """The throughput curve's title says what its points' rates span, as the line says its own:
    fewer seconds than the window early in a run, the pause once a point crossed one."""
    panel = Panel()
    run = a_run(start=5000.0)  # 32 samples every 0.1 s on each rank, to 5001.9
    panel.update(run, now=5002.0)
    assert run.rate_spans() == (pytest.approx(1.0), pytest.approx(1.9))
    assert panel.speed_ax.get_title() == "throughput (each point: the last 1-2 s)"
    run.add([Record(rank, 20, 5011.9, SAMPLES, 32.0 * 20) for rank in (0, 1)])  # 10 s later
    panel.update(run, now=5012.0)
    assert run.rate_spans()[1] == pytest.approx(10.0) == run.live_span()
    assert panel.speed_ax.get_title() == "throughput (each point: the last 1-10 s)"
    assert _speed_title((2.9, 3.2)) == "throughput (each point: the last 3 s)"  # one figure
    assert Run().rate_spans() is None and _speed_title(None) == "throughput"


def test_the_line_says_which_memory_it_shows_in_mib():
    run = a_run(start=5000.0)
    assert "MiB" not in progress(run, now=5002.0)  # nothing recorded, nothing said
    line = progress(with_memory(run), now=5002.0)
    assert " | CPU RSS max 2,070 MiB | " in line  # the largest rank's latest
    run.add([Record(0, 19, 5001.9, MEMORY, 512.0), Record(1, 19, 5001.9, MEMORY, 640.0)])
    line = progress(run, now=5002.0)
    assert " | GPU peak 640 MiB | CPU RSS max 2,070 MiB | " in line
    assert " MB" not in line


def test_progress_reads_like_a_sentence():
    run = a_run(steps=20, start=5000.0)
    line = progress(run, total_steps=40, now=5002.0)
    # 20 log calls (the loss axis's 20 points), 640 samples/s over its 1.9 s of records
    assert line.startswith("step 20/40 | 2 ranks | 640 samples/s (last 2 s) | 100 ms/step | ")
    assert line.endswith(" | 2 s, ETA 2 s")  # 20 steps in 2 s, 20 to go
    run.device = "CPU"  # a launch says what its ranks train on
    assert progress(run, total_steps=40, now=5002.0).startswith("step 20/40 | 2 ranks on CPU |")


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


def test_a_log_makes_only_the_lines_it_writes(monkeypatch):
    """In a loop run in this process the view's work is in the training's time: a line the log
    would not write is not made (nor the panel's test for a curve, with no panel to draw)."""
    from nbaccel.observe.live import view as view_module

    made = []
    monkeypatch.setattr(view_module, "progress", lambda *a: made.append(a) or "a line")
    monkeypatch.setattr(view_module, "has_a_curve", lambda run: made.append(run) or True)
    clock = Clock()
    front = ConsoleFrontend(io.StringIO(), tty=False, log_interval=10, clock=clock)
    view = LiveView(front, text_interval=0.25, clock=clock)
    run = a_run(steps=3)
    for _ in range(80):  # 20 s of updates, 4 a second
        view.update(run)
        clock.now += 0.25
    assert len(made) == 2  # at 0 s and 10 s: the log's lines
    view.close(run)
    assert len(made) == 3 and front.stream.getvalue().count("a line") == 3


def test_a_saved_panel(tmp_path):
    run = a_run()
    LiveView(FakeFrontend(), save_png=str(tmp_path / "final.png")).close(run)
    assert (tmp_path / "final.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.process
def test_the_display_side_imports_no_torch():
    code = (
        "import sys, nbaccel.observe.live.panel as d, nbaccel.observe.channel as m\n"
        "import nbaccel.observe.records as r\n"
        "run = r.Run(); run.add([m.Record(0, 0, 0.0, 'loss', 1.0)]); d.png(run)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def timed_run(parts: dict[int, dict[str, float]], records: int = 8, start: float = 5000.0) -> Run:
    """A run whose ranks timed their loops: every ``TICK`` seconds each rank records the
    breakdown counters, growing evenly to ``parts`` (rank -> part -> seconds at the end)."""
    counters = {
        "data": TIME_DATA,
        "compute": TIME_COMPUTE,
        "communication": TIME_COMMUNICATION,
    }
    run = Run(world_size=len(parts), started=start)
    for i in range(1, records + 1):
        for rank, seconds in parts.items():
            share = i / records  # exact at the end, and half-way for an even count
            t = start + i / 4
            loop = share * sum(seconds.values())
            run.add([Record(rank, i, t, SAMPLES, 32.0 * i), Record(rank, i, t, TIME_LOOP, loop)])
            run.add([Record(rank, i, t, counters[p], share * seconds[p]) for p in counters])
    return run


SLOW_DATA = {  # rank 1 waits for its batches; rank 0 waits for rank 1 in the gradient sync
    0: {"data": 0.25, "compute": 4.0, "communication": 3.0, "other": 0.75},
    1: {"data": 3.25, "compute": 4.0, "communication": 0.0, "other": 0.75},
}


def bar_widths(ax) -> dict[str, list[float]]:
    """part -> each rank's bar width, rank 0 first, read from the axes' bar containers."""
    return {c.get_label(): [bar.get_width() for bar in c.patches] for c in ax.containers}


def test_the_breakdown_is_one_stacked_bar_per_rank():
    fig = figure(timed_run(SLOW_DATA))
    assert len(fig.axes) == 4
    ax = fig.axes[3]
    assert bar_widths(ax) == {part: [SLOW_DATA[r][part] for r in (0, 1)] for part in BREAKDOWN}
    for rank in (0, 1):  # stacked: each part starts where the one before it ends
        lefts = [c.patches[rank].get_x() for c in ax.containers]
        ends = [c.patches[rank].get_x() + c.patches[rank].get_width() for c in ax.containers]
        assert lefts == [0.0, *ends[:-1]] and ends[-1] == 8.0  # the rank's loop seconds
    assert [label.get_text() for label in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    # the key: each part's name in the colour of its bars
    key = [(word.get_text(), to_rgb(word.get_color())) for word in ax.texts]
    assert key == [(c.get_label(), to_rgb(c.patches[0].get_facecolor())) for c in ax.containers]


def test_a_loop_without_breakdown_counters_has_no_breakdown_axes():
    panel = Panel()
    panel.update(a_run())
    assert panel.breakdown is None and len(panel.fig.axes) == 3
    assert panel.fig.get_size_inches()[0] == 12  # the panel as before the breakdown


def test_the_bars_follow_the_run_and_a_rank_heard_late():
    records = timed_run(SLOW_DATA, records=8).records
    panel = Panel()
    run = Run(world_size=2, started=5000.0)
    run.add([r for r in records if r.rank == 1 and r.step <= 4])  # rank 0 not heard yet
    panel.update(run)
    ax = panel.breakdown.ax
    assert bar_widths(ax)["data"] == [3.25 / 2]  # half-way through rank 1's loop
    run.add([r for r in records if r not in run.records])
    panel.update(run)
    assert len(ax.containers) == len(BREAKDOWN) and len(ax.patches) == 2 * len(BREAKDOWN)
    assert bar_widths(ax)["data"] == [0.25, 3.25] and ax.get_xlim()[1] >= 8.0


def test_a_panel_with_the_breakdown_redrawn_equals_one_drawn_afresh():
    timed = timed_run(SLOW_DATA, records=40).records
    # the loop's counters start at the 7th record: the first 12 records are samples only
    records = [r for r in timed if r.step > 6 or not r.name.startswith("nbaccel/time/")]
    panel = Panel()
    for cut in (12, 60, len(records)):  # the breakdown's axes are added between these two
        run = Run(world_size=2, started=5000.0)
        run.add(records[:cut])
        redrawn = panel.png(run, now=5020.0)
        assert (panel.breakdown is None) == (cut == 12)
    assert redrawn == png(run, now=5020.0)


def test_the_progress_line_and_the_panel_name_the_straggler():
    run = timed_run(SLOW_DATA, records=40)
    straggler = run.straggler()
    assert straggler is not None and (straggler.rank, straggler.cause) == (1, "data")
    line = progress(run, now=5010.0)
    assert line.endswith(
        f" | 10 s | rank 1 is the straggler (data: others waited {straggler.waited:.1f} s)"
    )
    ax = figure(run).axes[3]
    rank0, rank1 = ax.get_yticklabels()
    assert rank1.get_fontweight() == "bold" and rank0.get_fontweight() == "normal"


def test_balanced_ranks_have_no_straggler():
    even = {"data": 0.25, "compute": 6.0, "communication": 1.0, "other": 0.75}
    run = timed_run({0: even, 1: even}, records=40)
    assert run.straggler() is None
    assert "straggler" not in progress(run, now=5010.0)
    ax = figure(run).axes[3]
    assert {label.get_fontweight() for label in ax.get_yticklabels()} == {"normal"}
