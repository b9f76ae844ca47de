"""The first cell never kills the kernel: many fresh kernels, each importing nbaccel and torch in
one cell while another core is kept busy, and each answering the next cell.

Issue 65: with one other core busy, 10 of 40 fresh kernels died (SIGABRT in torch's
``_c10d_init``) or deadlocked on torch's import locks, because the import started threads that
imported ``torch.distributed`` and matplotlib while the cell imported torch. Now nothing of
nbaccel's imports anything in a thread of the kernel (``launch/client.py``): this test is what
would have caught it, from real kernels.

How many kernels: a defect that kills a fraction ``p`` of kernels escapes ``n`` independent
kernels with probability ``(1 - p) ** n``. With ``n = KERNELS = 60`` a 5% failure rate escapes
with probability 0.95 ** 60 = 4.6% (and issue 65's 25% with 0.75 ** 60 = 3e-8); 90 kernels would
bring the first to 1% at half as much again of the suite's time (about 5 s a kernel here).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from ..kernel import Kernel

pytestmark = pytest.mark.multiprocess

KERNELS = 60
AT_ONCE = 2  # kernels starting together: more load on the free core, and half the suite's time
FIRST_CELL = "from nbaccel import notebook_launcher, Accelerator\nimport time, os, sys, torch"
BUSY = "import os, time\nwhile os.getppid() == {parent}: pass"  # ends with its parent, if missed


@pytest.fixture
def busy_core():
    """One core kept busy, as on a learner's laptop or a shared Binder: a child of this test,
    ended by its pid."""
    code = BUSY.format(parent=psutil.Process().pid)
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def first_cell(cwd: str) -> str | None:
    """A fresh kernel runs the first cell and the next one; None if both answered, else what
    went wrong. Its fork server is ended by pid with it (a server still importing torch would
    otherwise finish its import before it saw its kernel go)."""
    kernel = Kernel(cwd=cwd)
    servers: list[psutil.Process] = []
    try:
        out = kernel.run(FIRST_CELL, timeout=120)
        servers = kernel.servers()
        if out.error is not None:
            return f"the first cell raised {out.error['ename']}: {out.error['evalue']}"
        answer = kernel.run("1 + 1", timeout=120).value
        return None if answer == "2" else f"the next cell answered {answer!r}"
    except Exception as err:  # a dead kernel: no reply, jupyter_client times out or says so
        return f"{type(err).__name__}: {err}"
    finally:
        kernel.client.stop_channels()
        kernel.manager.shutdown_kernel(now=True)
        for server in servers:
            try:
                server.kill()  # psutil checks it is still the process it was
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(servers, timeout=30)


@pytest.mark.timeout(1800)  # a hang's bound: 60 kernels take about 5 minutes on 2 busy cores
def test_sixty_fresh_kernels_with_a_core_busy_all_survive_their_first_cell(busy_core):
    with tempfile.TemporaryDirectory() as cwd, ThreadPoolExecutor(AT_ONCE) as pool:
        outcomes = list(pool.map(first_cell, [cwd] * KERNELS))
    failures = {i: why for i, why in enumerate(outcomes) if why is not None}
    assert not failures, f"{len(failures)} of {KERNELS} kernels failed: {failures}"
