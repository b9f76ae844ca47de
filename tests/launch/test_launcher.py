"""notebook_launcher from a Python process; tests/launch/test_launcher_notebook.py covers a real
kernel.

Functions are defined inside the tests on purpose: like notebook cells, they cannot be imported
by name, so they must travel by value.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from nbaccel import LaunchError, NbaccelError, notebook_launcher
from nbaccel.env import find_free_port

pytestmark = pytest.mark.multiprocess
HANG = 120  # seconds: a launch that takes this long is hung, not slow


def test_returns_rank_zeros_value_and_every_ranks_on_request():
    offset = 10  # a closure: the function is sent by value

    def work(scale):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        total = accelerator.reduce(torch.tensor([accelerator.rank + 1.0]))
        return {
            "rank": accelerator.rank,
            "value": scale * total + offset,
            "n": accelerator.num_processes,
        }

    assert notebook_launcher(work, args=(2.0,), num_processes=2, timeout=HANG)["rank"] == 0
    values = notebook_launcher(work, args=(2.0,), num_processes=2, return_all=True, timeout=HANG)
    assert [v["rank"] for v in values] == [0, 1] and values[1]["n"] == 2
    assert torch.equal(values[0]["value"], torch.tensor([16.0]))
    assert values[0]["value"].device.type == "cpu"


def test_workers_leave_what_the_server_loaded_to_its_frozen_generation():
    """The fork server froze what it imported (torch, nbaccel): a worker's garbage collections
    skip those objects, so they do not write to (and copy) the pages it shares with the server.
    Measured in benchmarks/launch.py; here, the workers' own view of the frozen objects."""

    def frozen():
        import gc

        gc.collect()  # a full collection: it must leave the frozen generation where it is
        return gc.get_freeze_count()

    counts = notebook_launcher(frozen, num_processes=2, return_all=True, timeout=HANG)
    assert all(count > 10_000 for count in counts), counts  # torch's import alone is ~100,000


def test_workers_get_the_launch_environment(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def environment():
        from nbaccel import Accelerator

        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
        accelerator = Accelerator()
        return {k: os.environ[k] for k in keys} | {
            "mixed_precision": accelerator.mixed_precision,
            "threads": torch.get_num_threads(),
            "cwd": os.getcwd(),
        }

    env = notebook_launcher(environment, num_processes=2, mixed_precision="bf16", return_all=True)
    cores = len(os.sched_getaffinity(0))
    assert [e["RANK"] for e in env] == ["0", "1"] and env[1]["WORLD_SIZE"] == "2"
    assert env[0]["MASTER_ADDR"] == "127.0.0.1" and env[0]["mixed_precision"] == "bf16"
    assert env[0]["threads"] == max(cores // 2, 1) == int(env[0]["OMP_NUM_THREADS"])
    assert env[0]["cwd"] == os.getcwd()


def test_single_node_sockets_listen_on_loopback_only():
    def listening():
        from nbaccel import Accelerator

        accelerator = Accelerator()
        accelerator.reduce(torch.ones(1))  # gloo's connections are up
        sockets = psutil.Process().net_connections(kind="inet")
        accelerator.end_training()
        return [c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN]

    for addresses in notebook_launcher(listening, num_processes=2, return_all=True):
        assert addresses and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in addresses)


def test_prints_arrive_whole_and_prefixed_with_the_rank(capfd):
    def chatty():
        rank = int(os.environ["RANK"])
        for i in range(50):
            print(f"line {i} from rank {rank} " + "x" * 200)
        print(f"warning from rank {rank}", file=sys.stderr)

    notebook_launcher(chatty, num_processes=2, timeout=HANG)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert [line.split()[3] for line in lines] == [str(i) for i in range(50)]
        assert all(line.endswith("x" * 200) for line in lines)  # never split mid-line
        assert f"[rank {rank}] warning from rank {rank}" in err
    notebook_launcher(chatty, num_processes=2, output="main", timeout=HANG)
    out, _ = capfd.readouterr()
    assert "[rank 0] line 0" in out and "[rank 1]" not in out


def failing(mode: str, sleep: float = 0.0):
    """Rank 1 fails in the given way while rank 0 waits for it in an all-reduce."""

    def work():
        from nbaccel import Accelerator

        accelerator = Accelerator()
        if accelerator.rank == 1:
            time.sleep(sleep)
            if mode == "raise":
                raise ValueError("bad batch on rank 1")
            if mode == "exit":
                os._exit(3)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                time.sleep(HANG)
        accelerator.reduce(torch.ones(1))
        return accelerator.rank

    return work


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_rank_that_raises_is_the_error_with_its_own_traceback():
    port = find_free_port()
    with pytest.raises(
        LaunchError, match=r"rank 1 \(pid \d+\) raised ValueError: bad batch"
    ) as info:
        notebook_launcher(failing("raise", sleep=0.5), num_processes=2, master_port=port)
    error = info.value
    assert error.rank == 1 and error.exc_type == "ValueError"
    assert 'raise ValueError("bad batch on rank 1")' in str(error)  # the source line, here
    assert "Traceback on rank 1" in str(error) and "forkserver.py" not in str(error)
    assert error.failures[0].rank == 1  # the cause first, never rank 0's fallout
    assert error.failures[1].rank == 0 and error.failures[1].secondary  # stopped, or lost rank 1
    assert port_is_free(port)
    assert notebook_launcher(failing("none"), num_processes=2, timeout=HANG) == 0  # relaunch


@pytest.mark.parametrize(
    "mode, match",
    [("exit", r"rank 1 \(pid \d+\) exited with code 3"), ("kill", r"rank 1 .* killed by SIGKILL")],
)
def test_a_rank_that_dies_without_an_exception(mode, match):
    with pytest.raises(LaunchError, match=match) as info:  # not HANG's timeout error
        notebook_launcher(failing(mode), num_processes=2, timeout=HANG)
    assert info.value.rank == 1 and info.value.exc_type is None
    # rank 0, waiting for rank 1 in the all-reduce, was stopped by nbaccel or lost its peer:
    # it did not sit out the collective's 30-minute timeout
    assert [(f.rank, f.secondary) for f in info.value.failures] == [(1, False), (0, True)]


def test_a_hang_ends_at_the_timeout_naming_the_ranks():
    with pytest.raises(
        LaunchError, match=r"timeout: ranks \[0, 1\] had not finished after 3 s"
    ) as info:
        notebook_launcher(failing("hang"), num_processes=2, timeout=3)
    # both were stopped by nbaccel's signals (rank 1 would otherwise sleep for HANG seconds)
    stopped = {f.rank: f.exit_code for f in info.value.failures}
    assert stopped.keys() == {0, 1}
    assert set(stopped.values()) <= {-signal.SIGTERM, -signal.SIGKILL}, stopped


def test_after_the_parent_trained_on_all_cores(monkeypatch):
    """Forking a process with a live OpenMP pool can deadlock; workers must not inherit one."""
    torch.set_num_threads(2)
    model, x = torch.nn.Linear(256, 256), torch.randn(512, 256)
    for _ in range(20):
        model(x).sum().backward()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # more than one thread per worker

    def train():
        model, x = torch.nn.Linear(256, 256), torch.randn(512, 256)
        for _ in range(20):
            model(x).sum().backward()
        return torch.get_num_threads()

    assert notebook_launcher(train, num_processes=2, return_all=True, timeout=HANG) == [2, 2]


def test_spawn_leaves_nothing_running():
    assert notebook_launcher(failing("none"), num_processes=2, start_method="spawn") == 0


def test_one_process_runs_here_with_the_same_contract():
    def here():
        return os.getpid(), os.environ["WORLD_SIZE"]

    assert notebook_launcher(here, num_processes=1) == (os.getpid(), "1")
    with pytest.raises(LaunchError, match=r"rank 0 \(pid \d+\) raised KeyError") as info:
        notebook_launcher(lambda: {}["missing"], num_processes=1)
    assert isinstance(info.value.__cause__, KeyError)
    assert "WORLD_SIZE" not in os.environ  # restored


NODE = """
import sys, torch
from nbaccel import notebook_launcher
def work():
    from nbaccel import Accelerator
    a = Accelerator()
    return a.reduce(torch.tensor([float(a.rank)])).item(), a.rank, a.num_processes
print(notebook_launcher(work, num_processes=2, num_nodes=2, node_rank=int(sys.argv[1]),
                        master_port=int(sys.argv[2]), return_all=True, timeout=120))
"""


def test_two_nodes_over_loopback(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(NODE))
    port = find_free_port()
    command = [sys.executable, str(script)]
    node1 = subprocess.Popen([*command, "1", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run(
            [*command, "0", str(port)], capture_output=True, text=True, timeout=HANG
        )
        out1, _ = node1.communicate(timeout=HANG)
    finally:
        node1.kill()
        node1.wait()
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert "[(6.0, 0, 4), (6.0, 1, 4)]" in node0.stdout
    assert "[(6.0, 2, 4), (6.0, 3, 4)]" in out1


# -- preflight: each mistake gets its fix --------------------------------------------------------
def test_a_called_function_instead_of_the_function():
    with pytest.raises(TypeError, match=r"not notebook_launcher\(train\(...\)\)"):
        notebook_launcher(None)


@pytest.mark.parametrize("n, error", [(0, ValueError), ("2", TypeError), (True, TypeError)])
def test_num_processes_must_be_a_positive_int(n, error):
    with pytest.raises(error, match=r"num_processes="):
        notebook_launcher(print, num_processes=n)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match=r"mixed_precision='fp32' is not one of"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp32")
    with pytest.raises(ValueError, match=r"start_method='fork' is not one of"):
        notebook_launcher(print, num_processes=2, start_method="fork")
    with pytest.raises(ValueError, match=r"node_rank=2 must be an int in 0..1"):
        notebook_launcher(print, num_processes=2, num_nodes=2, node_rank=2, master_port=1)
    with pytest.raises(ValueError, match=r"pass the same master_addr"):
        notebook_launcher(print, num_processes=2, num_nodes=2)
    with pytest.raises(TypeError, match=r"use args=\(3,\) for a single argument"):
        notebook_launcher(print, args=3, num_processes=2)


def test_a_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(NbaccelError, match=rf"cannot listen on 127.0.0.1:{port}"):
            notebook_launcher(print, num_processes=2, master_port=port)


def test_an_unpicklable_argument_is_named():
    with pytest.raises(TypeError, match=r"cannot send 'print' and its arguments"):
        notebook_launcher(print, args=(threading.Lock(),), num_processes=2)


def test_a_process_group_alive_in_the_parent(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with pytest.raises(NbaccelError, match=r"process group is already alive in this kernel"):
            notebook_launcher(print, num_processes=2)
    finally:
        dist.destroy_process_group()


def test_a_dead_fork_server_is_replaced_or_named(monkeypatch):
    from nbaccel.launch import supervisor

    def work():
        return os.getppid()  # the worker's parent: the fork server

    first = notebook_launcher(work, num_processes=2)
    os.kill(first, signal.SIGKILL)  # died between launches: quietly replaced
    psutil.Process(first).wait(timeout=10)
    second = notebook_launcher(work, num_processes=2)
    assert second != first

    start = supervisor.ForkServer.start

    def dies_while_starting(self, *args):
        self.process.kill()
        self.process.wait()
        return start(self, *args)

    monkeypatch.setattr(supervisor.ForkServer, "start", dies_while_starting)
    with pytest.raises(LaunchError, match=r"fork server \(pid \d+\) stopped while starting"):
        notebook_launcher(work, num_processes=2)
    monkeypatch.undo()
    assert notebook_launcher(work, num_processes=2) not in (first, second)


@pytest.mark.parametrize("leave", ["sys.exit(3)", "finally", "os._exit(3)"])
def test_a_rank_that_leaves_while_its_peer_waits_in_a_collective_is_named(leave):
    """Rank 1 leaves while rank 0 waits in an all-reduce: the race between rank 0's lost
    connection and rank 1's own report is settled by content (test_culprit.py plays each order)."""

    def leaves(how):
        import sys

        from nbaccel import Accelerator

        accelerator = Accelerator()
        if accelerator.rank == 1:
            if how == "sys.exit(3)":
                sys.exit(3)
            if how == "os._exit(3)":
                os._exit(3)
            try:  # the group ends before the exception reaches nbaccel
                raise ValueError("bad batch")
            finally:
                accelerator.end_training()
        accelerator.reduce(torch.ones(1))
        return 0

    with pytest.raises(LaunchError) as caught:
        notebook_launcher(leaves, args=(leave,), num_processes=2, timeout=HANG)
    err = caught.value
    first = str(err).splitlines()[0]
    assert err.rank == 1, str(err)
    expected = "raised ValueError: bad batch" if leave == "finally" else "exited with code 3"
    assert first.startswith("rank 1 (pid ") and first.endswith(expected), first
    assert [f.rank for f in err.failures] == [1, 0]  # rank 0 lost it, or was stopped waiting
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    assert isinstance(err, ChildFailedError)  # what code written for torchrun catches


def test_ranks_that_run_different_numbers_of_steps_are_told_so():
    def uneven():
        from nbaccel import Accelerator

        accelerator = Accelerator()
        for _ in range(1 + accelerator.rank * 3):  # rank 1 wants three more all-reduces
            accelerator.reduce(torch.ones(1))
        return accelerator.rank

    with pytest.raises(LaunchError, match=r"Ranks \[0\] had already returned while rank 1 waited"):
        notebook_launcher(uneven, num_processes=2, timeout=HANG)
