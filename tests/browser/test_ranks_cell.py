"""A ranks session in JupyterLab, in Debian's Chromium driven by Playwright: ``%%ranks`` runs a
cell on two CPU ranks and the learner sees each rank's line, labelled, under that cell; shutting
the kernel down leaves none of its ranks running.

The kernel-level tests prove the lines are sent; this proves they reach the page. A screenshot
of the finished notebook goes to ``artifacts/browser/`` (ignored by git).
"""

from __future__ import annotations

import json
import re
import time

import psutil
import pytest

from . import test_live_view as lab

# A server, a browser, a kernel and two ranks on a loaded 2-core machine: each limit catches a
# hang, not slowness (the notebook itself runs in about 5 s on 2 idle cores, outside a browser).
pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

browser = lab.browser  # the same fixture: Debian's Chromium, headless

NOTEBOOK = "ranks.ipynb"
CELLS = [  # what a learner types: the extension, two ranks, one cell on both, the end
    "%load_ext nbaccel",
    "%ranks start 2 --cpu",
    "%%ranks\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\n"
    'print(f"rank {rank} holds {x.item()}")',
    "%ranks stop",
]
RANKS_CELL = 2
EXPECTED = {"[rank 0] rank 0 holds 3.0", "[rank 1] rank 1 holds 3.0"}  # 1 + 2 on each rank
CELL_TIMEOUT = 300  # s for one cell; %ranks start allows its ranks 120 s to join their group
EXIT_TIMEOUT = 60  # s for the kernel, then what it started, to exit once it is shut down


def ranks_notebook() -> dict:
    cells = [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "outputs": [], "source": source,
         "execution_count": None}
        for i, source in enumerate(CELLS)
    ]  # fmt: skip
    kernel = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    return {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def server(tmp_path_factory):
    """JupyterLab showing the ranks notebook alone (``lab_server``)."""
    lab._require_browser()
    home = tmp_path_factory.mktemp("lab")
    root = home / "notebooks"
    root.mkdir()
    (root / NOTEBOOK).write_text(json.dumps(ranks_notebook()))
    with lab.lab_server(home, root) as url:
        yield url


def prompt_of(index: int) -> str:
    """JavaScript: code cell ``index``'s prompt, "[ ]:", "[*]:" or "[3]:"."""
    return (
        f"() => document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')[{index}]"
        ".textContent.trim()"
    )


def run_cell(page, index: int) -> None:
    """Select code cell ``index`` and press the toolbar's run button, as a learner would, then
    wait for the cell to end. A click the page has not taken in 30 s (the prompt unchanged: a
    loaded run once dropped one) is repeated; a cell has ``CELL_TIMEOUT`` s to end."""
    prompt = prompt_of(index)
    before = page.evaluate(prompt)
    what = f"cell {index} ({CELLS[index].splitlines()[0]})"
    for _ in range(5):
        page.locator(".jp-CodeCell").nth(index).locator(".jp-InputPrompt").click()  # select it
        page.locator(lab.RUN_CELL).first.click()
        changed = f"() => ({prompt})() !== {before!r}"
        if lab.wait_until(page, changed, f"{what} started", 30, fail=False):
            break
    else:
        raise AssertionError(f"{what}: 5 clicks on run, none taken")
    lab.wait_until(page, f"() => /\\[\\d+\\]/.test(({prompt})())", f"{what} ended", CELL_TIMEOUT)


def the_kernel() -> psutil.Process:
    """The notebook's kernel: the one ipykernel under this test's server."""
    # the test's own tree: its browser, its server, and the kernel the server started
    kernels = [p for p in psutil.Process().children(recursive=True) if _is_kernel(p)]
    assert len(kernels) == 1, f"kernels under this test: {kernels}"
    return kernels[0]


def _is_kernel(process: psutil.Process) -> bool:
    try:
        return "ipykernel_launcher" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def _describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())}"
    except psutil.NoSuchProcess:
        return f"pid {process.pid} (exited since)"


def shut_down_kernel(page, kernel: psutil.Process) -> None:
    """Kernel > Shut Down Kernel, as a learner would; wait for the kernel process to exit."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Shut Down Kernel$")).click()
    deadline = time.monotonic() + EXIT_TIMEOUT
    while kernel.is_running() and time.monotonic() < deadline:
        lab._accept_any_dialog(page)
        time.sleep(0.5)
    assert not kernel.is_running(), f"the kernel (pid {kernel.pid}) ran on after its shutdown"


def test_a_ranks_cell_shows_each_ranks_line_and_leaves_no_rank(server, browser):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    started: dict[int, psutil.Process] = {}  # what the kernel started: its fork server, ranks
    ranks_seen: list[psutil.Process] = []
    try:
        page.goto(f"{server}lab/tree/{NOTEBOOK}")
        page.locator(".jp-CodeCell").nth(len(CELLS) - 1).wait_for(timeout=90_000)
        idle = f"() => document.querySelector('{lab.IDLE}') !== null"
        lab.wait_until(page, idle, "the kernel status showed idle", CELL_TIMEOUT)
        for index in range(len(CELLS)):
            run_cell(page, index)
            if index == 0:  # it ran, so the kernel is up (the status may say idle before it is)
                kernel = the_kernel()
            if index == RANKS_CELL:  # the ranks are up: note them, to look for them at the end
                ranks_seen = [p for p in kernel.children(recursive=True) if p.ppid() != kernel.pid]
            started |= {p.pid: p for p in kernel.children(recursive=True)}
        cells = page.locator(".jp-CodeCell")
        outputs = [cells.nth(i).locator(".jp-OutputArea").inner_text() for i in range(len(CELLS))]
        lab.ARTIFACTS.mkdir(parents=True, exist_ok=True)
        cells.nth(RANKS_CELL).scroll_into_view_if_needed()
        page.screenshot(path=str(lab.ARTIFACTS / "jupyterlab-ranks.png"))
        shut_down_kernel(page, kernel)
        psutil.wait_procs(list(started.values()), timeout=EXIT_TIMEOUT)
    finally:
        page.close()
        # what outlived its kernel: said below, and stopped by PID here (psutil refuses a PID
        # that was reused since)
        alive = [p for p in started.values() if p.is_running()]
        left = [_describe(p) for p in alive]
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=10)
    errors = [text for text in outputs if "Traceback" in text]
    assert not errors, errors[0][-2000:]
    assert "nbaccel: 2 ranks ready" in outputs[1], outputs[1]
    assert "nbaccel: stopped 2 ranks." in outputs[3], outputs[3]
    lines = outputs[RANKS_CELL].splitlines()
    assert sorted(line for line in lines if line in EXPECTED) == sorted(EXPECTED), (
        f"the ranks cell shows {outputs[RANKS_CELL]!r}; expected each of {sorted(EXPECTED)} once"
    )
    # The ranks are forked by the kernel's fork server: grandchildren of the kernel.
    assert len(ranks_seen) == 2, f"the kernel's grandchildren while the ranks ran: {ranks_seen}"
    assert not left, f"still running after the kernel was shut down: {left}"
