"""The output relay (nbaccel/launch/relay.py), driven with the chunks a pipe could give.

``screen`` plays the written text as a terminal (and Jupyter's output area) shows it, so the
tests can say both what was written and what a reader sees.
"""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.relay import Relay

OUT0, ERR0, OUT1, ERR1 = 10, 11, 20, 21  # pipe read ends: rank 0's, then rank 1's
HANG = 120  # seconds: a launch that takes this long is hung, not slow


def relay(output="all"):
    out, err = io.StringIO(), io.StringIO()
    r = Relay(output, streams={"out": out, "err": err})
    for fd, rank, kind in ((OUT0, 0, "out"), (ERR0, 0, "err"), (OUT1, 1, "out"), (ERR1, 1, "err")):
        r.add(fd, rank, kind)
    return r, out, err


def screen(text: str) -> list[str]:
    """The lines a terminal shows after ``text``: ``\\r`` goes back to the line's start and
    what follows overwrites; trailing blanks are invisible."""
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col : col + 1] = [ch]
            col += 1
    if "".join(line).strip():
        lines.append("".join(line).rstrip())
    return lines


def feed(r: Relay, fd: int, *chunks: bytes) -> None:
    for chunk in chunks:
        r.feed(fd, chunk)


def test_whole_lines_wait_for_their_newline_and_carry_the_rank():
    r, out, err = relay()
    feed(r, OUT0, b"hel", b"lo\nwor")
    assert out.getvalue() == "[rank 0] hello\n"
    feed(r, OUT1, b"x\n")
    feed(r, OUT0, b"ld\n", b"tail", b"")
    assert out.getvalue() == "[rank 0] hello\n[rank 1] x\n[rank 0] world\n[rank 0] tail\n"
    assert err.getvalue() == ""


def test_deepspeeds_op_built_line_is_dropped_and_only_it():
    r, out, err = relay()
    feed(r, OUT0, b"DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n")
    feed(r, ERR1, b"DeepSpeed cpu_adam built successfully\n", b"my op built successfully\n")
    feed(r, OUT1, b"DeepSpeed op built successfully, then failed\n")
    assert out.getvalue() == "[rank 1] DeepSpeed op built successfully, then failed\n"
    assert err.getvalue() == "[rank 1] my op built successfully\n"


def test_a_bar_is_shown_as_it_comes_and_its_final_state_once():
    r, _, err = relay()
    feed(r, ERR0, b"\r  0%|     |")
    assert err.getvalue() == "\r[rank 0]   0%|     |"
    feed(r, ERR0, b"\r 50%|##", b"###|")  # one redraw split across two reads
    assert screen(err.getvalue()) == ["[rank 0]  50%|#####|"]
    feed(r, ERR0, b"\r100%|#####|\n")  # tqdm's close: the last redraw, then the newline
    assert screen(err.getvalue()) == ["[rank 0] 100%|#####|"]
    assert err.getvalue().count("100%") == 1 and err.getvalue().endswith("100%|#####|\n")
    feed(r, ERR0, b"\r 99%|####|", b"\n")  # the newline alone: the state already shown
    assert err.getvalue().endswith("\r[rank 0]  99%|####|\n")


def test_several_ranks_drawing_show_one_bar_and_each_final_state():
    r, _, err = relay()
    for i in range(100):
        feed(r, ERR0, f"\r{i:3d}%".encode())
        feed(r, ERR1, f"\r{i:3d}%".encode())
    assert "[rank 1]" not in err.getvalue()  # held while rank 0's bar is live
    feed(r, ERR1, b"\r100%\n")  # rank 1 ends first: printed above rank 0's bar
    assert screen(err.getvalue()) == ["[rank 1] 100%", "[rank 0]  99%"]
    feed(r, ERR0, b"\r100%\n")
    assert screen(err.getvalue()) == ["[rank 1] 100%", "[rank 0] 100%"]
    assert err.getvalue().count("[rank 1]") == 1


def test_the_line_goes_to_the_lowest_rank_waiting_when_the_bar_ends():
    r, _, err = relay()
    feed(r, ERR1, b"\r 10%")  # rank 1 drew first: the line is its until its bar ends
    feed(r, ERR0, b"\r 20%")
    assert screen(err.getvalue()) == ["[rank 1]  10%"]
    feed(r, ERR1, b"\r 30%\n\r  0%")  # rank 1's next bar waits behind rank 0's
    assert screen(err.getvalue()) == ["[rank 1]  30%", "[rank 0]  20%"]


def test_a_line_on_the_bars_stream_goes_above_the_bar():
    r, _, err = relay()
    feed(r, ERR0, b"\r 50%|#####     | 5/10")
    feed(r, ERR1, b"warn", b"ing\n")
    assert screen(err.getvalue()) == ["[rank 1] warning", "[rank 0]  50%|#####     | 5/10"]
    feed(r, ERR0, b"\r 60%|######    | 6/10")
    assert screen(err.getvalue())[-1] == "[rank 0]  60%|######    | 6/10"


def test_a_line_on_the_other_stream_ends_the_bar_line_first():
    r, out, err = relay()
    feed(r, ERR0, b"\r 50%")
    feed(r, OUT1, b"loss 0.3\n")
    assert out.getvalue() == "[rank 1] loss 0.3\n"
    assert err.getvalue() == "\r[rank 0]  50%\n\r[rank 0]  50%"  # kept, then drawn again


def test_carriage_returns_inside_a_whole_line_show_what_a_terminal_shows():
    r, out, _ = relay()
    feed(r, OUT0, b"a\rb\n", b"abc\r\n", b"x\r\r\n", b"done\r\n")
    assert out.getvalue() == "[rank 0] b\n[rank 0] abc\n[rank 0] x\n[rank 0] done\n"


def test_a_cleared_bar_disappears():
    r, _, err = relay()
    feed(r, ERR0, b"\r 50%|##|", b"\r" + b" " * 9 + b"\r")  # tqdm's leave=False
    assert screen(err.getvalue()) == []
    feed(r, ERR0, b"done\n")
    assert screen(err.getvalue()) == ["[rank 0] done"]
    feed(r, ERR0, b"\r 10%", b"\r    \r", b"")  # cleared, then the pipe's end
    assert screen(err.getvalue()) == ["[rank 0] done"]


def test_at_the_pipes_end_a_pending_bar_is_printed_once():
    r, _, err = relay()
    feed(r, ERR0, b"\r 50%")
    feed(r, ERR1, b"\r 70%")
    feed(r, ERR1, b"")  # held: printed above the live bar
    assert screen(err.getvalue()) == ["[rank 1]  70%", "[rank 0]  50%"]
    feed(r, ERR0, b"")
    assert screen(err.getvalue()) == ["[rank 1]  70%", "[rank 0]  50%"]
    assert err.getvalue().endswith("\n") and err.getvalue().count("70%") == 1


def test_close_prints_what_is_left_and_ends_the_line():
    r, out, err = relay()
    feed(r, ERR0, b"\r 50%")
    feed(r, OUT1, b"no newline")
    r.close()
    assert out.getvalue() == "[rank 1] no newline\n"
    assert err.getvalue() == "\r[rank 0]  50%\n"
    r.close()  # nothing left: nothing more
    assert err.getvalue() == "\r[rank 0]  50%\n"


def test_main_shows_rank_zero_only():
    r, out, err = relay("main")
    feed(r, ERR1, b"\r 50%")
    feed(r, OUT1, b"one\n")
    feed(r, ERR0, b"\r 10%")
    feed(r, ERR1, b"\r 60%\n", b"")
    assert out.getvalue() == "" and err.getvalue() == "\r[rank 0]  10%"


def test_a_character_split_across_reads_is_never_replaced():
    r, out, err = relay()
    feed(r, ERR0, b"\r caf\xc3", b"\xa9 50%")
    assert screen(err.getvalue()) == ["[rank 0]  café 50%"]
    feed(r, OUT0, b"na\xc3", b"\xafve\n")
    assert "\ufffd" not in err.getvalue() + out.getvalue()
    assert out.getvalue() == "[rank 0] naïve\n"
    feed(r, OUT0, b"bad \xff\n")  # not UTF-8 at all: replaced, as before
    assert out.getvalue().endswith("[rank 0] bad \ufffd\n")


def test_a_long_lived_bar_keeps_only_its_latest_state():
    r, _, err = relay()
    for i in range(10_000):
        feed(r, ERR0, f"\r{i}".encode())
    assert len(r.partial[ERR0]) < 10
    feed(r, ERR0, b"\n")
    assert screen(err.getvalue()) == ["[rank 0] 9999"]


def test_by_default_it_writes_to_sys_stdout_and_stderr_and_flushes(capsys):
    r = Relay()
    r.add(OUT0, 0, "out")
    r.add(ERR0, 0, "err")
    feed(r, OUT0, b"hi\n")
    feed(r, ERR0, b"\r 5%")
    assert capsys.readouterr() == ("[rank 0] hi\n", "\r[rank 0]  5%")


class Watcher:
    """A cell's stderr that creates ``flag`` once a relayed ``50%`` reaches it."""

    def __init__(self, flag: str) -> None:
        self.flag, self.text = flag, ""

    def write(self, text: str) -> int:
        self.text += text
        if "50%" in self.text and not os.path.exists(self.flag):
            open(self.flag, "w").close()
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.multiprocess
def test_a_bar_reaches_the_cell_while_its_rank_runs(tmp_path, monkeypatch):
    def draw(flag):
        if os.environ["RANK"] == "0":
            sys.stderr.write("\r 50%")
            sys.stderr.flush()
            while not os.path.exists(flag):  # only the relayed bar creates it
                time.sleep(0.05)
            sys.stderr.write("\n")

    watcher = Watcher(str(tmp_path / "seen"))
    monkeypatch.setattr(sys, "stderr", watcher)
    notebook_launcher(draw, args=(watcher.flag,), num_processes=2, timeout=HANG)
    assert "[rank 0]  50%" in screen(watcher.text)
