"""``%load_ext nbaccel``, ``%ranks`` and ``%%ranks`` in a real Jupyter kernel: the session as a
learner steps through it, the stop button, figures, a killed rank, and nothing left behind.

Each kernel's end is checked: no rank and no fork server outlives it."""

from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from ..kernel import Kernel, kernel_with, no_workers_left

pytestmark = pytest.mark.multiprocess

PIDS = re.compile(r"\[rank (\d)\] pid (\d+)")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    cwd = str(tmp_path_factory.mktemp("ranks"))
    with kernel_with(cwd, "%load_ext nbaccel") as kernel:
        yield kernel
        kernel.run("%ranks stop")
        no_workers_left(kernel)


@pytest.fixture(autouse=True)
def _stopped_after(request):
    yield
    if "kernel" in request.fixturenames:
        kernel = request.getfixturevalue("kernel")
        assert kernel.run("%ranks stop").error is None
        no_workers_left(kernel)


def started(kernel: Kernel) -> dict[int, int]:
    """Start 2 ranks (stopping any left by an earlier test) and return {rank: pid}."""
    kernel.run("%ranks stop")
    out = kernel.run("%ranks start 2 --cpu")
    assert out.error is None, out.error
    assert "2 ranks ready" in out.stdout
    return pid_of(kernel)


def pid_of(kernel: Kernel) -> dict[int, int]:
    out = kernel.run("%%ranks\nimport os\nprint('pid', os.getpid())")
    assert out.error is None, out.error
    return {int(rank): int(pid) for rank, pid in PIDS.findall(out.stdout)}


def test_a_learner_steps_through_a_session_cell_by_cell(kernel):
    pids = started(kernel)
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2
    assert kernel.run("%%ranks\nx = torch.tensor([rank + 1.0])").error is None
    out = kernel.run("%%ranks\ndist.all_reduce(x)\nprint(x.item())")
    assert out.error is None, out.error
    assert "[rank 0] 3.0" in out.stdout and "[rank 1] 3.0" in out.stdout
    assert pid_of(kernel) == pids  # the same processes held x

    out = kernel.run("%%ranks 1\nraise ValueError('bad batch')")
    assert out.error is not None and out.error["ename"] == "CellError"
    shown = "\n".join(out.error["traceback"])
    assert "rank 1" in shown and "ValueError: bad batch" in shown
    assert "raise ValueError('bad batch')" in shown  # the cell's own line
    assert "nbaccel/launch" not in shown  # no frame of ours
    out = kernel.run("%%ranks\nprint('still', x.item())")
    assert "[rank 0] still 3.0" in out.stdout and "[rank 1] still 3.0" in out.stdout

    out = kernel.run("%%ranks\nfrom nbaccel import Accelerator\nprint(Accelerator().num_processes)")
    assert "[rank 0] 2" in out.stdout and "[rank 1] 2" in out.stdout
    out = kernel.run("values = %ranks pull x\n[float(v) for v in values]")
    assert out.value == "[3.0, 3.0]"
    number = kernel.run("%%ranks\npass").number  # the cell as the notebook numbers it
    out = kernel.run("%ranks status")
    for rank, pid in pids.items():
        row = rf"^\s+{rank}\s+{pid}\s+yes\s+idle\s+{number}$"
        assert re.search(row, out.stdout, re.M), out.stdout
    processes = [psutil.Process(p) for p in pids.values()]
    assert kernel.run("%ranks stop").error is None
    _, alive = psutil.wait_procs(processes, timeout=15)
    assert not alive
    no_workers_left(kernel)


def test_the_stop_button_interrupts_every_rank_and_keeps_them(kernel):
    pids = started(kernel)
    kernel.run("%%ranks\nkept = rank * 2")
    cell = kernel.start("%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    kernel.wait_for_output("[rank 0] sleeping", "[rank 1] sleeping")
    kernel.manager.interrupt_kernel()
    out = kernel.finish(cell, timeout=10)  # "within 10 s", as the issue asks
    assert out.error is not None and out.error["ename"] == "KeyboardInterrupt"
    assert "interrupted" in out.stderr and "keep their state" in out.stderr
    assert pid_of(kernel) == pids
    out = kernel.run("%%ranks\nprint('kept', kept)")
    assert "[rank 0] kept 0" in out.stdout and "[rank 1] kept 2" in out.stdout


def test_rank_0s_figure_and_display_appear_in_the_cell(kernel):
    started(kernel)
    cell = (
        "%%ranks 0\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3])\nplt.show()\n"
        "class Note:\n    def _repr_html_(self):\n        return '<b>from rank 0</b>'\n"
        "display(Note())"
    )
    out = kernel.run(cell)
    assert out.error is None, out.error
    assert len(out.images) == 1  # a real PNG, not "Figure(640x480)"
    assert "Figure(" not in out.stdout


def test_a_killed_rank_is_named_and_restart_gives_new_ranks(kernel):
    pids = started(kernel)
    cell = kernel.start("%%ranks\nimport time\nprint('waiting', flush=True)\ntime.sleep(600)")
    kernel.wait_for_output("[rank 1] waiting")
    os.kill(pids[1], signal.SIGKILL)  # a rank this test started
    out = kernel.finish(cell, timeout=60)
    shown = "\n".join(out.error["traceback"])
    assert out.error["ename"] == "CellError"
    assert f"rank 1 (pid {pids[1]})" in shown and "SIGKILL" in shown
    out = kernel.run("%%ranks\nprint('next')")
    assert out.error is not None and "%ranks restart" in out.error["evalue"]
    assert kernel.run("%ranks restart").error is None
    fresh = pid_of(kernel)
    assert set(fresh.values()).isdisjoint(pids.values())
    out = kernel.run("%%ranks\ny = torch.tensor([rank + 1.0])\ndist.all_reduce(y)\ny.item()")
    assert "[rank 0] 3.0" in out.stdout and "[rank 1] 3.0" in out.stdout


def test_a_kernel_shut_down_or_killed_takes_its_ranks(tmp_path):
    for how in ("shutdown", "kill"):
        kernel = Kernel(cwd=str(tmp_path))
        try:
            kernel.run("%load_ext nbaccel")
            pids = started(kernel)
            below = kernel.workers() + kernel.servers()
            assert {p.pid for p in below} >= set(pids.values())
        finally:
            if how == "kill":
                os.kill(kernel.pid, signal.SIGKILL)  # the kernel this test started
            kernel.shutdown()
        _, alive = psutil.wait_procs(below, timeout=30)
        assert not alive, f"left after the kernel's {how}: {alive}"


def test_the_magics_say_how_to_use_them(kernel):
    out = kernel.run("%%ranks\nprint(1)")
    assert out.error is not None and "%ranks start N" in out.error["evalue"]
    out = kernel.run("%ranks status")
    assert out.error is None and "no ranks are running" in out.stdout
    out = kernel.run("%ranks start 2 --cpu --bogus")
    assert "unrecognized arguments: --bogus" in out.error["evalue"]
    out = kernel.run("%ranks launch")
    assert "use start N, stop, restart, status" in out.error["evalue"]
    started(kernel)
    out = kernel.run("%%ranks one\nprint(1)")
    assert "give ranks as 1, 0,1 or 0-3" in out.error["evalue"]
    out = kernel.run("%%ranks 0-1\nprint('both', rank)")
    assert "[rank 0] both 0" in out.stdout and "[rank 1] both 1" in out.stdout
    out = kernel.run("%ranks start 2 --cpu")
    assert "running already" in out.error["evalue"]


def test_a_cell_that_trains_draws_the_live_panel(kernel):
    started(kernel)
    cell = (
        "%%ranks\nimport time\nfrom nbaccel import Accelerator\n"
        "acc = Accelerator()\nstart = time.monotonic()\nstep = 0\n"
        "while time.monotonic() - start < 3:\n"
        "    acc.log({'loss': 1.0 / (step + 1)}, step=step)\n    step += 1\n    time.sleep(0.05)\n"
    )
    out = kernel.run(cell)
    assert out.error is None, out.error
    assert out.images or any("loss" in text for text in out.texts), out


def test_the_stop_button_while_the_ranks_start_leaves_nothing_and_the_next_start_works(tmp_path):
    """A kernel without a prestarted server: the start takes seconds (the kernel and the server
    import torch), and the press lands somewhere in it; wherever it lands, the cell ends with
    KeyboardInterrupt and nothing of the start is left."""
    with kernel_with(str(tmp_path), "%load_ext nbaccel", env={"NBACCEL_PRESTART": "0"}) as kernel:
        # The press must find the cell's code running: ipykernel ignores it before that.
        cell = kernel.start("print('starting', flush=True)\n%ranks start 2 --cpu")
        kernel.wait_for_output("starting")
        kernel.manager.interrupt_kernel()
        out = kernel.finish(cell, timeout=60)
        assert out.error is not None and out.error["ename"] == "KeyboardInterrupt"
        no_workers_left(kernel)
        pids = started(kernel)
        assert len(pids) == 2
        kernel.run("%ranks stop")
        no_workers_left(kernel)


def test_a_magic_line_may_end_with_a_comment(kernel):
    started(kernel)
    kernel.run("lr = 0.5")
    out = kernel.run("%ranks push lr  # the learning rate, into every rank")
    assert out.error is None, out.error
    out = kernel.run("%%ranks 1  # one rank\nprint('lr', lr)")
    assert "[rank 1] lr 0.5" in out.stdout and "[rank 0]" not in out.stdout


def test_a_collective_on_one_rank_is_reported_with_its_cell_and_freed_by_the_other(kernel):
    kernel.run("%ranks stop")
    assert kernel.run("%ranks start 2 --cpu --stall-timeout 2").error is None
    out = kernel.run("%%ranks 0\ny = torch.ones(1)\ndist.all_reduce(y)")
    shown = "\n".join(out.error["traceback"])
    assert out.error["ename"] == "CellError"
    assert (
        f"rank 0 waits in `all_reduce` called from `<module>` (cell {out.number}, line 3)" in shown
    )
    assert f"rank 0 stays in cell {out.number}" in shown and "%%ranks 1" in shown
    assert kernel.run("%%ranks 1\ny = torch.ones(1)\ndist.all_reduce(y)").error is None
    out = kernel.run("%%ranks 0\nprint('rank 0 holds', y.item())")  # its late report is read first
    assert out.error is None, out.error
    assert "[rank 0] rank 0 holds 2.0" in out.stdout
