"""The live view with an injected front end: what is drawn, how often, and without torch."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from nbaccel.display import ConsoleFrontend, LiveView, Panel, figure, png, progress
from nbaccel.metrics import SAMPLES, STEPS, Record, Run


class Recorder:
    draws = True

    def __init__(self):
        self.texts, self.images, self.closed = [], [], False

    def text(self, line):
        self.texts.append(line)

    def image(self, png):
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


def feed(view: LiveView, run: Run, seconds: float) -> float:
    """Add a record and update the view every 5 ms for ``seconds``; return the time taken."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        run.add([Record(0, len(run.records), time.time(), "loss", 0.5)])
        view.update(run)
        time.sleep(0.005)
    return time.monotonic() - started


def test_the_progress_line_is_throttled_to_five_a_second():
    front = Recorder()
    front.draws = False
    view = LiveView(front, text_interval=0.2)
    elapsed = feed(view, a_run(steps=1), 1.5)
    assert 3 <= len(front.texts) <= elapsed / 0.2 + 1  # not one per update (~300 of them)


def test_the_panel_is_throttled_and_the_end_is_always_drawn():
    front = Recorder()
    view = LiveView(front, image_interval=0.25, first_panels=3)  # matplotlib loaded here
    run = a_run(steps=1)
    feed(view, run, 4.0)
    # three panels at the plain interval; then none for 100 times a panel's drawing time
    # (about 20 s: a panel takes 0.1-0.3 s), so that drawing costs 1% of a core at most
    assert len(front.images) == 3
    view.close(run)
    assert len(front.images) == 4 and front.closed  # the final state, once more
    assert front.images[-1][:8] == b"\x89PNG\r\n\x1a\n"


def test_a_panel_redrawn_as_the_run_grows_equals_one_drawn_afresh():
    records = a_run(steps=300).records
    panel = Panel()
    for cut in (10, 120, 250, len(records)):  # more steps, a wider time axis, new limits
        run = Run(world_size=2, started=records[0].time)
        run.add(records[:cut])
        redrawn = panel.png(run)
    assert redrawn == png(run)  # the same bytes as a figure built from the final records


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
    run = a_run(steps=20)
    line = progress(run, total_steps=40)
    assert line.startswith("step 19/40 | 2 ranks | 640 samples/s | 100 ms/step | loss ")
    assert "ETA" in line


def test_a_terminal_gets_one_line_rewritten_then_ended():
    stream = io.StringIO()
    view = LiveView(ConsoleFrontend(stream, tty=True), text_interval=0)
    run = a_run(steps=3)
    view.update(run)
    view.close(run)
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().endswith("\n")


def test_a_log_gets_plain_lines_now_and_then_and_the_final_state():
    stream = io.StringIO()
    view = LiveView(ConsoleFrontend(stream, tty=False, log_interval=60), text_interval=0)
    run = a_run(steps=3)
    for _ in range(20):
        view.update(run)
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
        "import sys, nbaccel.display as d, nbaccel.metrics as m\n"
        "run = m.Run(); run.add([m.Record(0, 0, 0.0, 'loss', 1.0)]); d.png(run)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
