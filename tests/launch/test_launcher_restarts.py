"""notebook_launcher's torch elastic arguments: max_restarts, monitor_interval, rdzv_backend.

The workers here use ``torch.distributed`` directly, not the Accelerator, so that what is tested
is the launcher's rendezvous: a restarted attempt must form a working process group at a new
store. Whether an attempt fails is decided by a marker file the test owns, never by the clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from nbaccel import LaunchError, Run, notebook_launcher
from nbaccel.cli import main
from nbaccel.commands.launch import torchrun_command
from nbaccel.env import find_free_port

from .test_launcher import HANG, port_is_free

pytestmark = pytest.mark.multiprocess


def flaky(marker: str, fail_every_attempt: bool = False):
    """Rank 1 raises on the first attempt only (it leaves ``marker`` behind), or on every one."""

    def work():
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env://: the attempt's own MASTER_PORT
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        if dist.get_rank() == 1 and (fail_every_attempt or not os.path.exists(marker)):
            open(marker, "a").close()
            # no destroy_process_group() first: rank 0 would see its peer leave and fail
            # before this error reached the launcher
            raise ValueError(f"rank 1 fails attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        dist.barrier()  # rank 0 waits here while rank 1 fails: it is stopped, not finished
        dist.destroy_process_group()
        return os.environ["TORCHELASTIC_RESTART_COUNT"], total.item()

    return work


def test_a_failed_attempt_is_restarted_and_the_next_ones_value_returned(tmp_path, capfd):
    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) raised ValueError") as info:
        notebook_launcher(flaky(str(tmp_path / "a")), num_processes=2, timeout=HANG)
    assert str(info.value).startswith("rank 1")  # max_restarts=0: the error as it always was
    capfd.readouterr()

    run = Run()
    values = notebook_launcher(
        flaky(str(tmp_path / "b")),
        num_processes=2,
        max_restarts=1,
        monitor_interval=0.05,
        rdzv_backend="static",
        return_all=True,
        run=run,
        timeout=HANG,
    )
    assert values == [("1", 3.0), ("1", 3.0)]  # the second attempt's, with a working group
    assert run.results == {0: ("1", 3.0), 1: ("1", 3.0)} and run.failures == []
    err = capfd.readouterr().err
    assert "nbaccel: attempt 1 of 2 failed: rank 1" in err
    assert "raised ValueError: rank 1 fails attempt 0. Restarting all 2 workers, attempt 2" in err


def test_every_attempt_failing_is_one_error_that_names_each_attempt(tmp_path):
    port = find_free_port()  # a fixed master_port: every attempt binds it afresh
    work = flaky(str(tmp_path / "marker"), fail_every_attempt=True)
    with pytest.raises(LaunchError, match=r"^all 2 attempts failed \(max_restarts=1\)") as info:
        notebook_launcher(work, num_processes=2, max_restarts=1, master_port=port, timeout=HANG)
    text = str(info.value)
    assert "  attempt 1: rank 1 (pid " in text and "fails attempt 0" in text
    assert "attempt 2: rank 1 (pid " in text and "ValueError: rank 1 fails attempt 1" in text
    assert "Traceback on rank 1" in text  # the last attempt's own traceback
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert port_is_free(port)


def test_a_timeout_is_not_restarted(tmp_path, capfd):
    starts = tmp_path / "starts"

    def hangs():
        with open(starts, "a") as f:  # one line per worker start
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\n")
        time.sleep(HANG)

    with pytest.raises(
        LaunchError, match=r"^attempt 1 of up to 3 ended in a timeout, which is not restarted"
    ):
        notebook_launcher(hangs, num_processes=2, max_restarts=2, timeout=2)
    assert "Restarting" not in capfd.readouterr().err
    # only attempt 0 ever started (how far it got before the stop is the scheduler's business:
    # the file may not exist, be empty, or hold a 0 from each rank)
    assert not starts.exists() or set(starts.read_text().split()) <= {"0"}  # no second attempt


def test_a_stop_from_the_user_is_not_restarted(tmp_path):
    import io

    from nbaccel.observe.live.view import ConsoleFrontend, LiveView

    class Interrupts(LiveView):
        """Ctrl-C (or the kernel's interrupt) while the launcher redraws the view."""

        def update(self, run, final=False):
            if not final and not getattr(self, "interrupted", False):
                self.interrupted = True
                raise KeyboardInterrupt

    starts = tmp_path / "starts"

    def sleeps():
        with open(starts, "a") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\n")
        time.sleep(HANG)

    view = Interrupts(ConsoleFrontend(io.StringIO()))
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleeps, num_processes=2, max_restarts=2, live=view, timeout=HANG)
    assert view.interrupted and view.closed
    # only attempt 0 ever started (how far it got before the stop is the scheduler's business:
    # the file may not exist, be empty, or hold a 0 from each rank)
    assert not starts.exists() or set(starts.read_text().split()) <= {"0"}


def test_monitor_interval_paces_the_supervisors_checks(monkeypatch):
    import selectors

    from nbaccel.launch import supervisor

    waits = []

    class Recording(selectors.DefaultSelector):
        def select(self, timeout=None):
            waits.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(supervisor.selectors, "DefaultSelector", Recording)
    assert notebook_launcher(os.getpid, num_processes=1, start_method="forkserver",
                             monitor_interval=0.25) != os.getpid()  # fmt: skip
    assert waits and set(waits) == {0.25}


def test_c10d_as_accelerates_notebook_launcher_passes_it_meets_as_static_does():
    def world():
        import torch.distributed as dist

        from nbaccel import PartialState

        PartialState()
        return dist.get_world_size()

    assert notebook_launcher(world, num_processes=2, rdzv_backend="c10d", timeout=HANG) == 2


@pytest.mark.parametrize(
    "given, error, match",
    [
        ({"max_restarts": "1"}, TypeError, r"max_restarts='1' must be an int"),
        ({"max_restarts": True}, TypeError, r"max_restarts=True must be an int"),
        ({"max_restarts": -1}, ValueError, r"max_restarts=-1 must be 0 \(no restarts\) or more"),
        (
            {"max_restarts": 1, "num_nodes": 2, "master_port": 1},
            ValueError,
            r"every node together.*nbaccel launch --max-restarts 1 --num-nodes 2",
        ),
        ({"monitor_interval": "0.1"}, TypeError, r"monitor_interval='0.1' must be a number"),
        ({"monitor_interval": 0}, ValueError, r"monitor_interval=0 must be a positive, finite"),
        ({"monitor_interval": float("nan")}, ValueError, r"monitor_interval=nan must be"),
        ({"monitor_interval": float("inf")}, ValueError, r"monitor_interval=inf must be"),
        ({"rdzv_backend": "etcd"}, ValueError, r"fixed world size.*torchrun's.*nbaccel launch"),
        ({"rdzv_backend": None}, TypeError, r"rdzv_backend=None must be a string"),
    ],
)
def test_bad_elastic_arguments_are_refused_before_anything_starts(tmp_path, given, error, match):
    ran = tmp_path / "ran"
    with pytest.raises(error, match=match):
        notebook_launcher(ran.touch, num_processes=2, **given)
    with pytest.raises(error, match=match):  # the one-process path checks them too
        notebook_launcher(ran.touch, num_processes=1, **given)
    assert not ran.exists()


# -- nbaccel launch: torchrun restarts scripts -------------------------------------------------
FIRST_ATTEMPT_FAILS = """
import os, sys
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    raise SystemExit("the first attempt fails on purpose")
print("succeeded in attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
"""


def test_nbaccel_launch_passes_max_restarts_to_torchrun(tmp_path, capsys):
    args = Namespace(
        num_nodes=1, node_rank=0, master_addr=None, master_port=None, module=False,
        script="train.py", script_args=[], max_restarts=2,
    )  # fmt: skip
    assert torchrun_command(args, 2)[5:8] == ["--standalone", "--max-restarts", "2"]
    with pytest.raises(SystemExit) as exit:
        main(["launch", "--max-restarts", "-1", "train.py"])
    assert exit.value.code == 2
    assert "--max-restarts -1 must be 0 (no restarts) or more" in capsys.readouterr().err

    script = tmp_path / "script.py"
    script.write_text(FIRST_ATTEMPT_FAILS)
    env = {**os.environ, "NBACCEL_CONFIG": str(tmp_path / "nbaccel.json")}
    command = [sys.executable, "-m", "nbaccel", "launch", "-n", "1", "--cpu", "--max-restarts"]
    done = subprocess.run(
        [*command, "1", str(script), str(tmp_path / "marker")],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "succeeded in attempt 1" in done.stdout
