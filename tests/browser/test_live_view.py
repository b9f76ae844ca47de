"""The live view in the real front ends: the flagship lesson run in JupyterLab and in
Notebook 7, in Debian's Chromium driven by Playwright (no browser download: the system one).
And the scaling lesson's what-if panel: its ipywidgets must render as widgets and redraw.

Kernel-level tests prove the panel is sent; this proves a learner sees it move. Screenshots
of the finished runs go to ``artifacts/browser/`` (ignored by git).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# Each run starts a server, a browser, a kernel and the lesson's workers: on a loaded 2-core
# machine one front end has taken 3.5 min. The limits catch a hang, not slowness.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LESSON = "04_accelerate.ipynb"
LAUNCH_CELL = "two = notebook_launcher("  # the first launch: its live panel must move
# The panel's first three redraws come one a second after a second of data: training must last
# over 3 s. The lesson's headline launch trains 3 * EPOCHS for its own panel's rate curve (about
# 8 s on 2 idle cores), so the copy under test runs it as it is; WATCHED is what that relies on.
WATCHED = 'kwargs={"epochs": 3 * EPOCHS, "library": "nbaccel"}'
LONGER = WATCHED
PROGRESS = re.compile(r"step (\d+)/(\d+)")  # the progress line: steps done of the total
READ_CELL = """cell => [cell.querySelector('.jp-InputPrompt').textContent,
                        cell.querySelector('.jp-OutputArea')?.innerText ?? '',
                        Array.from(cell.querySelectorAll('.jp-OutputArea img')).map(i => i.src)]"""
# Installed on the launch cell before Run All: the browser calls it on every change under the
# cell, as it makes the change, so no panel is missed however slow a poll from here would be.
# A queued cell shows [*] as a running one does, and its outputs were cleared: what shows under
# the launch cell while it shows [*] was drawn while it ran. The progress line above the panel
# says whether the workers were still training (step 120/750) or had finished (750/750).
WATCH_CELL = (
    """cell => {
  const read = """
    + READ_CELL
    + """;
  const seen = window.nbaccelSeen = {panels: [], started: null, ended: null};
  const look = () => {
    const [prompt, text, images] = read(cell);
    const now = performance.now() / 1000;
    if (prompt.includes('*')) {
      seen.started = seen.started ?? now;
    } else if (seen.started !== null && /\\d/.test(prompt)) {
      seen.ended = seen.ended ?? now;
    }
    if (!prompt.includes('*')) return;
    const count = text.match(/step (\\d+)\\/(\\d+)/);
    const training = !!count && Number(count[1]) < Number(count[2]);
    for (const src of images) {
      const last = seen.panels[seen.panels.length - 1];
      if (!last || last.src !== src) seen.panels.push({src, training, at: now});
    }
  };
  new MutationObserver(look).observe(
    cell, {subtree: true, childList: true, attributes: true, characterData: true});
  return performance.now() / 1000;
}"""
)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "artifacts" / "browser"
RUN_TIMEOUT = 600  # s for the whole notebook, from Run All
# ipywidgets shown as their text fallback instead of as widgets, or not at all
WIDGET_TEXT = re.compile(
    r"\b(interactive|HBox|VBox|IntProgress|FloatProgress|IntSlider|FloatSlider|Dropdown|Label|Button|Output)\("
    r"|Error displaying widget|Loading widget\.\.\."
)
SETTINGS = {  # JupyterLab's user settings for the test's server
    # every cell in the page, not only those scrolled into view; the notebook's kernel started
    # without asking (a loaded run met "Select Kernel" after the first cell had run)
    "@jupyterlab/notebook-extension/tracker": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    # no "get notified about Jupyter news?" toast over the screenshot
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
}


def _require_browser() -> None:
    if Path(CHROMIUM).exists():
        return
    message = (
        f"Debian's chromium is not installed ({CHROMIUM}); `make test` installs it as root "
        "(apt-get install chromium)"
    )
    if os.environ.get("NBACCEL_BROWSER") == "required":  # set by make where it installed it
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def server(tmp_path_factory):
    """JupyterLab on a copy of the lesson's start (through its first launch) with its outputs
    cleared, and on the what-if notebook (``lab_server``)."""
    _require_browser()
    home = tmp_path_factory.mktemp("lab")
    root = home / "notebooks"  # what the file browser shows: the lesson alone
    root.mkdir()
    notebook = json.loads((ROOT / "notebooks" / LESSON).read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            source = "".join(cell["source"])
            if LAUNCH_CELL in source:
                assert WATCHED in source, "the watched launch changed: update WATCHED"
                cell["source"] = source.replace(WATCHED, LONGER)
    # The lesson up to its first launch and the code cell after it: what the browser must show
    # happens there, and the whole lesson runs under nbval (each front end ran all 90 cells,
    # about three minutes each, for the same panel).
    cells = notebook["cells"]
    launch = next(i for i, c in enumerate(cells) if LAUNCH_CELL in "".join(c["source"]))
    after = next(i for i in range(launch + 1, len(cells)) if cells[i]["cell_type"] == "code")
    notebook["cells"] = [PROBE_CELL, *cells[: after + 1]]
    (root / LESSON).write_text(json.dumps(notebook))
    (root / WHATIF).write_text(json.dumps(whatif_notebook()))
    with lab_server(home, root) as url:
        yield url, root


@contextlib.contextmanager
def lab_server(home: Path, root: Path):
    """JupyterLab (which also serves Notebook 7) on 127.0.0.1, a free port, no token, showing
    ``root``, its state under ``home``; yields its URL, and stops it with its kernels at the
    end."""
    for name, value in SETTINGS.items():
        path = home / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        "--ServerApp.port=0",  # a free port, chosen by the kernel
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",
    ]
    if os.geteuid() == 0:  # CI runs as root; Jupyter refuses root unless told
        command.append("--allow-root")
    log = (home / "server.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        info = home / "runtime" / f"jpserver-{process.pid}.json"
        deadline = time.monotonic() + 90
        while not (url := _server_url(info)):  # the file appears before it is filled in
            assert process.poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "JupyterLab did not start in 90 s"
            time.sleep(0.2)
        yield url
    finally:
        _stop(process)
        log.close()


def _server_url(info: Path) -> str | None:
    try:
        return json.loads(info.read_text()).get("url")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _stop(process: subprocess.Popen) -> None:
    """Stop the server, then whatever it started that is still running (kernels, their
    workers), by PID."""
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    process.terminate()  # the server shuts its kernels down
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(family, timeout=15)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


# Run All began: a cell after the probe (which ran before) is queued, running or done
ANY_PROMPT_RAN = """() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
                             .slice(1).some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""


IDLE = '.jp-Notebook-ExecutionIndicator[data-status="idle"]'  # the toolbar's kernel status
# The first cell of each notebook under test: a widget, which the front end draws once its
# widget manager is connected to the kernel. On a loaded machine a notebook run the moment its
# kernel is up has shown "Error displaying widget: model not found" under a later cell (the
# manager missed the widget's opening message); a learner reruns that cell. The tests run this
# one until it draws, then every cell once, so the cells under test run once and must pass.
PROBE = "widgets connected"
PROBE_CELL = {
    "cell_type": "code", "id": "probe", "metadata": {}, "outputs": [], "execution_count": None,
    "source": f"import ipywidgets\nipywidgets.Label({PROBE!r})",
}  # fmt: skip
# the probe cell's prompt ("[3]:") and what its output shows: "drawn", "failed" or null
PROBE_STATE = f"""() => {{
  const cell = document.querySelector('.jp-CodeCell');
  const prompt = cell.querySelector('.jp-InputPrompt').textContent.trim();
  const out = cell.querySelector('.jp-OutputArea');
  const labels = Array.from(out?.querySelectorAll('.widget-label') ?? []);
  if (labels.some(label => label.textContent === {PROBE!r})) return [prompt, 'drawn'];
  const failed = /model not found|Error displaying widget/.test(out?.innerText ?? '');
  return [prompt, failed ? 'failed' : null];
}}"""


def run_all(page, started) -> None:
    """Run > Run All Cells once the kernel is idle, until ``started()`` returns. The menu item
    is disabled until the kernel connects; a kernel slow to start (a loaded machine) may first
    bring up JupyterLab's "Select Kernel" dialog, answered with its default as a user would."""
    dialogs: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT
    while not page.locator(IDLE).count():
        dialogs += _accept_any_dialog(page)
        assert time.monotonic() < deadline, f"the kernel never became idle; dialogs: {dialogs}"
        time.sleep(0.5)
    connect_widgets(page)
    for _ in range(5):
        dialogs += _accept_any_dialog(page)
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            started()
            return
        except Exception:
            page.keyboard.press("Escape")  # close the menu if it is still open; try again
    raise AssertionError(f"Run > Run All Cells did not start the notebook; dialogs: {dialogs}")


RUN_CELL = '[data-command="notebook:run-cell-and-select-next"]'  # the toolbar's run button


def connect_widgets(page) -> None:
    """Run the probe cell (the first) until its widget is drawn. A click on run that the page
    has not taken in 30 s (no prompt change: a loaded run once dropped it) is repeated, and a
    run of the cell is given two minutes to draw its output; the limits catch a hang."""
    unstarted = failed = 0
    while unstarted < 10 and failed < 5:
        before, _ = page.evaluate(PROBE_STATE)
        page.locator(".jp-CodeCell").first.locator(".jp-InputPrompt").click()  # select it
        page.locator(RUN_CELL).first.click()
        changed = f"() => ({PROBE_STATE})()[0] !== {before!r}"
        if not wait_until(page, changed, "the probe cell started", 30, fail=False):
            unstarted += 1
            continue
        ran = f"""() => {{ const [prompt, state] = ({PROBE_STATE})();
                          return /\\d/.test(prompt) && !!state; }}"""
        wait_until(page, ran, "the probe cell ran", 120)
        if page.evaluate(PROBE_STATE)[1] == "drawn":
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            with (ARTIFACTS / "probe-reruns.txt").open("a") as log:  # how often each hit
                log.write(f"clicks not taken {unstarted}, widget not drawn {failed}\n")
            return
        failed += 1
    raise AssertionError(
        f"the probe widget was not drawn: {unstarted} clicks on run not taken, {failed} runs "
        "that drew no widget"
    )


def _accept_any_dialog(page) -> list[str]:
    """A dialog over the page (JupyterLab asks for a kernel when one is slow to start) takes
    every click: answer it with its default, as a user would, and say what it asked."""
    dialog = page.locator(".jp-Dialog")
    if not dialog.count() or not dialog.first.is_visible():
        return []
    text = dialog.first.inner_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dialog.png"))
    dialog.first.locator(".jp-mod-accept").first.click()
    return [text]


PROMPTS = """() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
                       .map(p => p.textContent.trim())"""


def wait_until(
    page, condition: str, what: str, timeout: float = RUN_TIMEOUT, fail: bool = True
) -> bool:
    """Wait for the page's ``condition`` (a JavaScript function) to hold, answering any dialog
    that comes up meanwhile (JupyterLab's "Select Kernel" has come up after a cell ran). At
    the limit (a hang, not slowness) fail with what the page showed: its dialogs, the cells'
    prompts and the end of their outputs, and a screenshot; or with ``fail=False`` return
    False."""
    dialogs: list[str] = []
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):
        dialogs += _accept_any_dialog(page)
        if time.monotonic() > deadline:
            if not fail:
                return False
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "stuck.png"))
            outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            raise AssertionError(
                f"{what}: not after {timeout:.0f} s; dialogs answered {dialogs}; prompts "
                f"{page.evaluate(PROMPTS)}; outputs end {outputs[-1500:]!r}; the page: "
                f"{ARTIFACTS / 'stuck.png'}"
            )
        time.sleep(0.5)
    return True


def run_all_and_watch(page, url: str) -> dict:
    """Open the lesson, run every cell from the Run menu, and watch the first launch's panel
    while that cell runs. Returns what was seen."""
    page.goto(url)
    launch = page.locator(".jp-CodeCell", has_text=LAUNCH_CELL).first
    launch.wait_for(timeout=90_000)  # the notebook is rendered (a kernel starts meanwhile)
    clock = launch.evaluate(WATCH_CELL)  # the browser's clock, in seconds, at Run All
    deadline = time.monotonic() + RUN_TIMEOUT
    run_all(page, lambda: page.wait_for_function(ANY_PROMPT_RAN, timeout=60_000))
    wait_until(page, "() => window.nbaccelSeen.ended !== null", "the launch cell ended")
    seen = page.evaluate("() => window.nbaccelSeen")
    panels = [  # each distinct panel: when (s after Run All), drawn during training?
        {
            "digest": hashlib.sha1(panel["src"].encode()).hexdigest(),
            "s": round(panel["at"] - clock, 1),
            "training": panel["training"],
        }
        for panel in seen["panels"]
    ]
    ended = round(seen["ended"] - clock, 1)
    # then the rest of the notebook: no cell left queued or running (hidden inputs show no
    # prompt, so look for the pending ones)
    wait_until(
        page,
        """() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
                     .every(p => !/\\[( |\\*)\\]/.test(p.textContent))""",
        "every cell ran",
        max(deadline - time.monotonic(), 1),
    )
    outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    _, text, images = launch.evaluate(READ_CELL)
    count = PROGRESS.search(text)
    final = {
        "finished": bool(count) and count[1] == count[2],  # the progress line says 750/750
        "digests": [hashlib.sha1(source.encode()).hexdigest() for source in images],
    }
    launch.scroll_into_view_if_needed()
    return {"panels": panels, "ended": ended, "outputs": outputs, "final": final}


FRONT_ENDS = [("jupyterlab", "lab/tree"), ("notebook7", "notebooks")]  # and their URL paths


@pytest.mark.parametrize("front_end, path", FRONT_ENDS)
def test_the_live_panel_moves_in_the_browser(server, browser, front_end, path):
    url, _ = server
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        seen = run_all_and_watch(page, f"{url}{path}/{LESSON}")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{front_end}.png"))
        page.locator(".jp-CodeCell", has_text=LAUNCH_CELL).first.screenshot(
            path=str(ARTIFACTS / f"{front_end}-launch-cell.png")  # the README's picture
        )
        timings = {"panels": seen["panels"], "cell_ended_s": seen["ended"]}
        (ARTIFACTS / f"{front_end}.json").write_text(json.dumps(timings, indent=1) + "\n")
    finally:
        page.close()
    # the panel appeared while the workers were training, then changed at least twice
    during = [panel["s"] for panel in seen["panels"] if panel["training"]]
    assert len(during) >= 3, (
        f"panels during training at {during} s after Run All, all panels at "
        f"{[panel['s'] for panel in seen['panels']]} s; the cell ended at {seen['ended']} s"
    )
    # one panel stays, drawn after training: none of those drawn while it ran
    final = seen["final"]
    assert final["finished"], "the progress line does not show the finished count"
    assert len(final["digests"]) == 1, f"{len(final['digests'])} panels under the launch cell"
    training = {panel["digest"] for panel in seen["panels"] if panel["training"]}
    assert final["digests"][0] not in training, "the final panel is one drawn during training"
    errors = [text for text in seen["outputs"] if "Traceback (most recent call last)" in text]
    assert not errors, errors[0][-2000:]
    fallback = [text for text in seen["outputs"] if WIDGET_TEXT.search(text)]
    assert not fallback, f"widgets shown as text: {fallback[0][:300]}"


WHATIF = "whatif.ipynb"
# Lesson 5's inputs, stood in for: its what-if cell needs section 3's, 5's and 7's results
WHATIF_INPUTS = """from nbaccel import projection
compute, grad_bytes, BATCH, measured = 0.0032, 340_000, 32, {1: 10_000.0, 2: 15_000.0}
here = projection.Interconnect("this machine (test)", 1e9, 200e-6, overlaps=False)
check = projection.check(compute, grad_bytes, BATCH, here, measured)"""


def whatif_notebook() -> dict:
    """Lesson 5's what-if cell, as it is in the lesson, after a cell of stand-in inputs."""
    lesson = json.loads((ROOT / "notebooks" / "05_scaling_lab.ipynb").read_text())
    (panel,) = [
        "".join(c["source"])
        for c in lesson["cells"]
        if c["cell_type"] == "code" and "projection.whatif(" in "".join(c["source"])
    ]
    cells = [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "outputs": [], "source": source,
         "execution_count": None}
        for i, source in enumerate([WHATIF_INPUTS, panel])
    ]  # fmt: skip
    return {**lesson, "cells": [PROBE_CELL, *cells]}


# the panel's figure: a plain image output (display id) that the controls update in place
PANEL_IMAGE = ".jp-RenderedImage img"


def panel_image(page) -> str:
    return page.locator(PANEL_IMAGE).first.get_attribute("src", timeout=120_000)


@pytest.mark.parametrize("front_end, path", FRONT_ENDS)
def test_the_whatif_panel_is_a_widget_that_redraws(server, browser, front_end, path):
    url, _ = server
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        page.goto(f"{url}{path}/{WHATIF}")
        page.locator(".jp-CodeCell").first.wait_for(timeout=90_000)
        run_all(page, lambda: page.wait_for_function(ANY_PROMPT_RAN, timeout=60_000))
        wait_until(
            page,
            "() => document.querySelector('.widget-dropdown select') !== null",
            "the what-if panel's controls showed",
        )
        first = panel_image(page)
        for label in ("model size x", "compute faster x", "accumulation", "workers up to"):
            assert page.locator(".widget-slider", has_text=label).count() == 1, label
        page.locator(".widget-dropdown select").select_option("100 Gb Ethernet")
        page.wait_for_function(
            f"src => document.querySelector('{PANEL_IMAGE}')?.src !== src",
            arg=first,
            timeout=60_000,
        )
        second = panel_image(page)
        page.locator(".widget-checkbox input").click()  # overlap off: a third figure
        page.wait_for_function(
            f"src => document.querySelector('{PANEL_IMAGE}')?.src !== src",
            arg=second,
            timeout=60_000,
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{front_end}-whatif.png"))
        outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    finally:
        page.close()
    assert not [text for text in outputs if "Traceback (most recent call last)" in text]
    fallback = [text for text in outputs if WIDGET_TEXT.search(text)]
    assert not fallback, f"widgets shown as text: {fallback[0][:300]}"
