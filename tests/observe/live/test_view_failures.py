"""A live view that cannot draw: it says so once on stderr, keeps what still works, and never
raises into the launch (``LiveView._contained``)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from nbaccel.observe.live import view as view_module
from nbaccel.observe.live.view import ConsoleFrontend, LiveView

from .test_view import Clock, FakeFrontend, a_run, feed

MISSING = (
    "nbaccel: the live panel needs matplotlib, which this environment lacks; showing the "
    "progress line only (pip install 'nbaccel[notebook]' draws it).\n"
)


def a_view(front: FakeFrontend, clock: Clock, **kwargs) -> LiveView:
    """A view that draws a panel every quarter second of ``clock``, the line at every update."""
    return LiveView(front, text_interval=0, image_interval=0.25, clock=clock, **kwargs)


def drive(front: FakeFrontend) -> int:
    """A view over ``front`` (whose clock it shares), fed two seconds of a run, then closed;
    returns how many lines ``front`` had after the first second (three panels were due)."""
    clock = front.clock
    view = a_view(front, clock)
    run = a_run(steps=1)
    feed(view, run, clock, 1.0)
    lines = len(front.texts)
    feed(view, run, clock, 1.0)
    view.close(run)
    return lines


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` fails, as in a base install (matplotlib is in the notebook extra)."""
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_the_line_goes_on_and_the_note_is_said_once(no_matplotlib, capsys):
    front = FakeFrontend(Clock())
    lines = drive(front)
    assert capsys.readouterr().err == MISSING
    assert front.images == [] and front.closed
    assert len(front.texts) > lines + 100  # the progress line kept moving, to the end
    assert front.texts[-1] != front.texts[lines - 1]


def test_without_matplotlib_a_saved_panel_is_named_in_the_note(no_matplotlib, capsys, tmp_path):
    saved = tmp_path / "final.png"
    stream = io.StringIO()
    view = LiveView(ConsoleFrontend(stream, tty=True), save_png=str(saved))
    view.close(a_run())
    note = MISSING.replace("line only", f"line only, not saving {saved}")
    assert capsys.readouterr().err == note
    assert not saved.exists()
    assert stream.getvalue().startswith("\rstep 20 |")  # the line was still drawn


class FailingImage(FakeFrontend):
    def image(self, png):
        super().image(png)
        raise RuntimeError("the frontend\nhas no display")


def test_a_panel_that_fails_is_off_for_the_rest_of_the_view(capsys, caplog):
    front = FailingImage(Clock())
    with caplog.at_level(logging.DEBUG, logger=view_module.__name__):
        lines = drive(front)
    assert capsys.readouterr().err == (
        "nbaccel: the live panel failed (RuntimeError: the frontend has no display) and is off "
        "for the rest of this run; the training goes on.\n"
    )
    assert len(front.images) == 1  # tried once, not again at every due panel, nor at close
    assert len(front.texts) > lines + 100 and front.closed
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and "the frontend\nhas no display" in str(logged[0].exc_info[1])


def test_a_panel_whose_code_raises_is_contained_too(monkeypatch, capsys):
    class Broken:
        def png(self, run, total):
            raise ValueError("a bug in the panel")

    monkeypatch.setattr(view_module, "Panel", Broken)
    front = FakeFrontend(Clock())
    drive(front)
    assert capsys.readouterr().err.count("nbaccel: the live panel failed (ValueError: a bug") == 1
    assert front.images == [] and front.closed


class FailingText(FakeFrontend):
    def text(self, line):
        super().text(line)
        raise OSError("the stream is closed")


def test_a_line_that_fails_turns_the_view_off_and_says_so_once(capsys):
    front = FailingText(Clock())
    drive(front)
    assert capsys.readouterr().err == (
        "nbaccel: the live view failed (OSError: the stream is closed); the training goes on "
        "without it.\n"
    )
    assert len(front.texts) == 1 and front.images == []  # nothing more was drawn
    assert front.closed  # but the front end was still closed


def test_a_front_end_that_fails_to_close_is_said_once(capsys):
    class FailingClose(FakeFrontend):
        def close(self):
            raise OSError("gone")

    view = a_view(FailingClose(), Clock())
    view.close(a_run())
    view.close(a_run())
    assert capsys.readouterr().err.count("the live view failed (OSError: gone)") == 1


def test_an_interrupt_while_drawing_is_not_contained():
    class Interrupted(FakeFrontend):
        def text(self, line):
            raise KeyboardInterrupt("the stop button")

    front = Interrupted()
    view = a_view(front, Clock())
    with pytest.raises(KeyboardInterrupt, match="the stop button"):
        view.close(a_run())
    assert front.closed  # the front end is closed all the same
