"""The worker server started ahead in a Jupyter kernel (``client.prestart``): at the launcher's
import, only in a kernel, never when opted out; one per kernel, asleep when idle; a dead one is
said and replaced; none is left after the kernel, shut down or restarted. Every verdict reads
process state (the kernel's children, a server's context switches), never a clock."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..kernel import kernel_with, no_workers_left

pytestmark = pytest.mark.multiprocess

IMPORT = "from nbaccel import notebook_launcher\nimport os"
TWO = "notebook_launcher(lambda: os.getpid(), num_processes=2, cpu=True, live=False) > 0"


def test_importing_the_launcher_in_a_kernel_starts_the_server_the_first_launch_uses(tmp_path):
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        servers = kernel.servers()  # the import cell has returned: the server is there already
        assert len(servers) == 1, servers
        out = kernel.run(TWO)
        assert out.error is None, out.error
        assert out.value == "True"
        assert kernel.servers() == servers  # the launch used it: no second server
        no_workers_left(kernel)


def test_importing_the_package_starts_the_server_once_the_notebook_holds_it(tmp_path):
    """``import nbaccel`` puts ``nbaccel.notebook_launcher`` one attribute away: the server starts
    after that cell, as the launcher's import would start it. ``from nbaccel import Accelerator``
    alone starts nothing, until a later cell holds the package."""
    with kernel_with(str(tmp_path), "import nbaccel\nimport os") as kernel:
        servers = kernel.servers()
        assert len(servers) == 1, servers
        out = kernel.run(f"nbaccel.{TWO}")
        assert out.error is None, out.error
        assert out.value == "True"
        assert kernel.servers() == servers  # the launch used it
        no_workers_left(kernel)
    hooked = (
        "import IPython\n"
        "any(getattr(f, '__name__', '') == '_prestart_once_bound'"
        " for f in IPython.get_ipython().events.callbacks['post_run_cell'])"
    )
    with kernel_with(str(tmp_path), "from nbaccel import Accelerator", "x = 1") as kernel:
        assert kernel.servers() == []
        assert kernel.run(hooked).value == "True"  # still watching the cells
        kernel.run("import nbaccel as nb")
        assert len(kernel.servers()) == 1
        assert kernel.run(hooked).value == "False"  # its work done: no scan after every cell


# Whether the kernel's idle warm-up ran (``client.warm_kernel``, on the kernel's main thread once
# the import cell has ended): the panel's flag, set by the warm-up; and no thread of nbaccel's.
WARMED = "import sys, threading\nfrom nbaccel.observe.live import panel\npanel._warmed"
NO_THREAD = (
    "import threading\n[t.name for t in threading.enumerate() if t.name.startswith('nbaccel')]"
)


def warmed(kernel) -> bool:
    """The warm-up runs when the kernel's loop next has control with no cell running: after the
    import cell, or at the latest after the next one (``client._when_idle``). Ask after each of
    a few cells; the verdict is the flag, not how long anything took."""
    return any(kernel.run(WARMED).value == "True" for _ in range(3))


def test_the_kernel_imports_what_the_launch_needs_on_its_own_thread_after_the_cell(tmp_path):
    """The launch hosts the workers' store with ``torch.distributed``, and draws its panel with
    matplotlib: a notebook whose cells imported neither would wait for them at its first launch.
    The kernel imports both after the import cell, on the thread that runs the cells, never in
    a thread of its own (an import there races the cell's own: issue 65's dead kernels)."""
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        assert kernel.run(NO_THREAD).value == "[]"
        assert warmed(kernel)
        out = kernel.run(
            "'torch.distributed' in sys.modules and 'matplotlib.figure' in sys.modules"
        )
        assert out.value == "True", out
        assert kernel.run(NO_THREAD).value == "[]"


@pytest.mark.parametrize("how", ["variable", "config file"])
def test_opting_out_starts_nothing_until_the_first_launch(tmp_path, how):
    env = {"NBACCEL_PRESTART": "0"}
    if how == "config file":
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"prestart": False}))
        env = {"NBACCEL_CONFIG": str(config)}
    with kernel_with(str(tmp_path), IMPORT, env=env) as kernel:
        assert kernel.servers() == []
        unwarmed = "import sys\nfrom nbaccel.observe.live import panel\n"
        unwarmed += "not panel._warmed and 'matplotlib' not in sys.modules"
        assert kernel.run(unwarmed).value == "True"  # no warm-up either
        assert kernel.run("import sys\n'torch' in sys.modules").value == "False"  # nor torch
        assert kernel.run(TWO).value == "True"  # the launch starts it, as before
        assert len(kernel.servers()) == 1


def test_a_killed_server_is_said_and_the_next_launch_works(tmp_path):
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        (server,) = kernel.servers()
        server.kill()  # the kernel's own child, by its pid
        gone(server)
        out = kernel.run(TWO)
        assert out.error is None, out.error
        assert out.value == "True"
        assert f"the worker server (pid {server.pid}) was killed by SIGKILL" in out.stderr
        assert "starting a fresh one" in out.stderr
        assert len(kernel.servers()) == 1 and kernel.servers()[0].pid != server.pid


def test_a_dead_servers_end_is_said_as_it_is_known():
    """How the message names a server's end (``client._ended``): a signal by name, a code as it
    is, and a 0 as an end only: the server never exits by itself while the kernel holds its
    socket, and Popen reports 0 when something else (a user's psutil ``wait``) reaped it."""
    from nbaccel.launch.client import _ended

    assert _ended(-9) == "was killed by SIGKILL"
    assert _ended(3) == "exited with code 3"
    assert _ended(0) == "ended"


def test_the_kernel_takes_its_prestarted_server_along_when_it_shuts_down(tmp_path):
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        (server,) = kernel.servers()
    gone(server)  # kernel_with checked it too


@pytest.mark.parametrize("now", [False, True], ids=["restart", "restart now (SIGKILL)"])
def test_a_kernel_restart_takes_the_server_along_and_the_new_kernel_starts_its_own(tmp_path, now):
    """Jupyter's restart asks the kernel to shut down (``now=False``) or kills it outright
    (``now=True``, as when a kernel hangs): either way its server goes with it, and the
    restarted kernel's import starts a server of its own that its launch uses."""
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        (server,) = kernel.servers()
        kernel.manager.restart_kernel(now=now)
        try:
            gone(server)
        finally:  # no longer the kernel's child: if it outlived the kernel, ended here
            with contextlib.suppress(psutil.NoSuchProcess):
                server.kill()  # psutil checks it is still the process it was
        kernel.client.wait_for_ready(timeout=120)
        assert kernel.servers() == []  # a restarted kernel is a fresh one: nothing imported
        kernel.run(IMPORT)
        (fresh,) = kernel.servers()
        assert fresh.pid != server.pid
        out = kernel.run(TWO)
        assert out.error is None, out.error
        assert out.value == "True"
        assert "worker server" not in out.stderr  # nothing to say: no server died under it
        no_workers_left(kernel)


PARENT = "notebook_launcher(lambda: os.getppid(), num_processes=2, cpu=True, live=False)"


def test_two_kernels_never_share_a_server(tmp_path):
    """Each kernel's import starts its own server, and each kernel's workers are its own
    server's children (a worker's parent is the server that forked it)."""
    with kernel_with(str(tmp_path), IMPORT) as one, kernel_with(str(tmp_path), IMPORT) as two:
        (first,), (second,) = one.servers(), two.servers()
        assert first.pid != second.pid
        assert first.ppid() == one.pid and second.ppid() == two.pid
        assert two.run(PARENT).value == str(second.pid)
        assert one.run(PARENT).value == str(first.pid)
        assert one.servers() == [first] and two.servers() == [second]


def test_an_idle_server_makes_no_context_switch(tmp_path):
    """Started, the server sleeps on its socket until a launch writes to it: it costs no CPU,
    read in its threads' context switches, which any poll or timer would add. The launch
    first shows that its start is over (it waited for it); a server never used waits in the
    same call. Then its last wake (the workers' reaping) has to end: the counts still for a
    second, then still for two more."""
    with kernel_with(str(tmp_path), IMPORT) as kernel:
        (server,) = kernel.servers()
        assert kernel.run(TWO).value == "True"
        no_workers_left(kernel)
        before, deadline = switches(server), time.monotonic() + 60  # the deadline: a hang's
        while True:
            time.sleep(1)
            now = switches(server)
            if now == before:
                break
            assert time.monotonic() < deadline, f"the idle server keeps waking: {now}"
            before = now  # a poll never stills
        time.sleep(2)  # not a verdict's clock: a longer wait only catches slower polls
        assert switches(server) == before
        assert kernel.servers() == [server]


def switches(process: psutil.Process) -> dict[int, tuple[int, int]]:
    """Each thread's voluntary and involuntary context switches, by thread id."""
    counts = {}
    for thread in process.threads():
        status = Path(f"/proc/{process.pid}/task/{thread.id}/status").read_text()
        fields = dict(line.split(":\t") for line in status.splitlines() if ":\t" in line)
        counts[thread.id] = (
            int(fields["voluntary_ctxt_switches"]),
            int(fields["nonvoluntary_ctxt_switches"]),
        )
    return counts


def gone(process: psutil.Process, timeout: float = 30) -> None:
    """Wait until ``process`` has exited (a zombie its parent has not reaped yet counts): the
    timeout only catches a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"{process} is still running")


def test_outside_a_kernel_the_import_starts_nothing():
    code = (
        "import psutil\n"
        "from nbaccel import notebook_launcher\n"
        "import nbaccel.launch.launcher\n"
        "print(len(psutil.Process().children(recursive=True)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out
