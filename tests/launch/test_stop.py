"""The stop button (Jupyter's interrupt) where it used to cost or lose something: pressed while
the fork server still imports torch, and pressed twice while a rank ignores SIGTERM.

Each verdict reads what the cell printed and which processes are left, never a clock; how long
a stop takes is measured in ``benchmarks/interrupt.py``.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from ..kernel import kernel_with, no_workers_left

pytestmark = pytest.mark.multiprocess

# The fork server stops before its imports until the test opens a gate (a file): a server
# that is still importing torch, for as long as the test needs. Only the server: the kernel and
# the workers never wait (the workers are forks of a server that passed it).
GATE = """
import os, sys, time
if "nbaccel.launch.forkserver" in sys.orig_argv:
    open({gate!r} + ".waiting", "w").close()  # its kernel is waiting for it by now
    for _ in range(6000):  # 10 minutes at most: a hang's bound
        if os.path.exists({gate!r}):
            break
        time.sleep(0.1)
"""

IMPORT = "import os, torch\nfrom nbaccel import notebook_launcher"
LAUNCH = "notebook_launcher(lambda: os.getpid(), num_processes=2, cpu=True, live=False)"


def test_stopping_while_the_server_imports_ends_it_and_the_next_launch_starts_afresh(tmp_path):
    """The first launch (no prestart) waits for a server that still imports torch; the stop
    button kills it instead of waiting for its imports to end (it reads its socket's end only
    after them), and the next launch starts a new server without calling the old one dead."""
    site, gate = tmp_path / "site", tmp_path / "gate"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GATE.format(gate=str(gate)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {"NBACCEL_PRESTART": "0", "PYTHONPATH": path}
    with kernel_with(str(tmp_path), IMPORT, env=env) as kernel:
        assert kernel.servers() == []
        msg_id = kernel.start(LAUNCH)
        # The server has started Python and reached the gate: the kernel, which only had to
        # hand it the workers' descriptors meanwhile, waits for its answer.
        waiting, deadline = tmp_path / "gate.waiting", time.monotonic() + 120  # a hang's bound
        while not waiting.exists():
            assert time.monotonic() < deadline, "the launch never started its server"
            time.sleep(0.05)
        (server,) = kernel.servers()
        kernel.manager.interrupt_kernel()  # Jupyter's stop button
        out = kernel.finish(msg_id, timeout=120)
        assert out.error["ename"] == "KeyboardInterrupt", out
        assert "interrupted while the workers started; they were stopped." in out.stderr
        assert not server.is_running()  # ended at the gate: it never finished its imports
        gate.touch()  # the next server may start
        out = kernel.run(f"{LAUNCH} > 0")
        assert out.error is None, out.error
        assert out.value == "True"
        assert "worker server" not in out.stderr  # nothing died under it: it was stopped
        no_workers_left(kernel)


IGNORES_TERM = """
import signal, time
import torch.distributed as dist
from nbaccel import PartialState

def stubborn():
    state = PartialState()
    if state.process_index == 1:
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("sleeping", flush=True)
        while True:
            time.sleep(1)
    dist.all_reduce(torch.ones(1))
"""


def test_pressing_stop_twice_keeps_the_report_of_where_each_rank_was(tmp_path):
    """The first press asks every rank where it is, then sends SIGTERM; a rank that ignores it
    has a grace before SIGKILL. A second press in that grace kills at once, and the report of
    where each rank was still comes: it was found before the second press."""
    with kernel_with(str(tmp_path), IMPORT, IGNORES_TERM) as kernel:
        msg_id = kernel.start("notebook_launcher(stubborn, num_processes=2, cpu=True)")
        kernel.wait_for_output("[rank 1] sleeping")
        kernel.manager.interrupt_kernel()  # the first press: ask, then SIGTERM
        kernel.wait_for_output("[rank 1] ignoring SIGTERM")  # in the grace, before SIGKILL
        kernel.manager.interrupt_kernel()  # the second press
        out = kernel.finish(msg_id, timeout=120)
        assert out.error["ename"] == "KeyboardInterrupt", out
        assert "nbaccel: interrupted; the workers were stopped." in out.stderr, out.stderr
        assert "Where each rank was" in out.stderr, out.stderr
        assert "rank 1 is in `stubborn`" in out.stderr, out.stderr
        # rank 0 is on its way into the all-reduce, or in it: either is where it was
        assert re.search(r"rank 0 (is in|waits in `all_reduce` called from) `stubborn`", out.stderr)
        no_workers_left(kernel)


# The kernel's own import of torch, held half-way (at torch.nn, after torch's C++ part has
# registered itself) until the test opens a gate: a notebook that never imported torch, whose
# first launch imports it for the store.
HALF_IMPORTED = """
import os, sys, time

class Gate:
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn" and not os.path.exists({mark!r}):
            open({mark!r}, "w").close()
            for _ in range(6000):  # 10 minutes at most: a hang's bound
                if os.path.exists({gate!r}):
                    break
                time.sleep(0.1)
        return None

sys.meta_path.insert(0, Gate())
from nbaccel import notebook_launcher
"""


def test_stopping_while_the_kernel_imports_torch_leaves_torch_whole(tmp_path):
    """The first launch of a notebook that never imported torch imports it in the kernel (the
    store's ``torch.distributed``). Pressed in the middle of that import, the stop used to cut
    it short, and torch stayed broken in the kernel until a restart ("partially initialized
    module 'torch'"). The stop now waits for the import to be whole, then stops the cell."""
    mark, gate = tmp_path / "importing", tmp_path / "gate"
    cell = HALF_IMPORTED.format(mark=str(mark), gate=str(gate))
    with kernel_with(str(tmp_path), cell, env={"NBACCEL_PRESTART": "0"}) as kernel:
        msg_id = kernel.start(LAUNCH)
        deadline = time.monotonic() + 120  # a hang's bound
        while not mark.exists():
            assert time.monotonic() < deadline, "the launch never imported torch"
            time.sleep(0.05)
        kernel.manager.interrupt_kernel()  # Jupyter's stop button, half-way through the import
        gate.touch()
        out = kernel.finish(msg_id, timeout=120)
        assert out.error["ename"] == "KeyboardInterrupt", out
        assert kernel.servers() == []  # stopped before anything started
        whole = kernel.run("import torch\n(torch.ones(1) + 1).item()")
        assert whole.error is None, whole.error
        assert whole.value == "2.0"
        out = kernel.run(f"{LAUNCH} > 0")
        assert out.error is None, out.error
        assert out.value == "True"
        no_workers_left(kernel)
