"""A ranks session through its Python API (``Ranks``): state across cells, collectives against
one process, errors, hangs, deaths, timeouts and restarts. The magics and the stop button, from
a real kernel, are in ``test_ranks_notebook.py``.

Every test stops its ranks; the autouse fixture then checks that nothing is left running."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from nbaccel import CellError, NbaccelError, Ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def ranks():
    with Ranks(2, cpu=True, live=False) as session:
        yield session
    assert not session.ranks


def pids(session: Ranks) -> list[int]:
    return [row["pid"] for row in session.status()]


def test_state_stays_across_cells_and_an_all_reduce_matches_one_process(ranks):
    before = pids(ranks)
    ranks.run("g = torch.Generator().manual_seed(rank)\nx = torch.randn(5, generator=g)")
    local = ranks.pull("x")
    ranks.run("dist.all_reduce(x)")
    oracle = sum(torch.randn(5, generator=torch.Generator().manual_seed(r)) for r in range(2))
    for value, mine in zip(ranks.pull("x"), local, strict=True):
        assert torch.allclose(value, oracle, atol=1e-6)  # a sum of two floats: one rounding
        assert not torch.equal(value, mine)
    assert pids(ranks) == before  # the same processes, cell after cell


def test_each_line_is_labelled_with_its_rank_and_a_cell_can_show_rank_0_alone(ranks, capsys):
    ranks.run("print(f'hello from {rank}')\nrank * 10")
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank}" in out
        assert f"[rank {rank}] {rank * 10}" in out  # the last expression's value, shown
    ranks.run("print(f'only {rank}')", output="main")
    out = capsys.readouterr().out
    assert "[rank 0] only 0" in out and "only 1" not in out


def test_an_error_on_one_rank_fails_the_cell_with_its_traceback_and_the_state_stays(ranks):
    ranks.run("x = torch.tensor([rank + 1.0])")
    with pytest.raises(CellError) as caught:
        ranks.run("y = 1\nraise ValueError(f'bad batch on rank {rank}')", ranks=1)
    error = caught.value
    assert error.rank == 1 and error.exc_type == "ValueError"
    assert "rank 1" in str(error) and "bad batch on rank 1" in str(error)
    assert "raise ValueError(f'bad batch on rank {rank}')" in str(error)  # the cell's line
    assert "keep their state" in str(error)
    assert [float(v) for v in ranks.pull("x")] == [1.0, 2.0]  # what the earlier cell made
    ranks.run("dist.all_reduce(x)")  # the group still works
    assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_every_failing_rank_is_said_the_first_cause_first(ranks):
    with pytest.raises(CellError) as caught:
        ranks.run("raise (KeyError if rank == 0 else ZeroDivisionError)(f'on {rank}')")
    failures = caught.value.failures
    assert sorted(f.rank for f in failures) == [0, 1]
    assert {f.exc_type for f in failures} == {"KeyError", "ZeroDivisionError"}
    assert "Other ranks:" in str(caught.value)


def test_an_accelerator_made_in_one_cell_works_in_the_next(ranks):
    ranks.run("from nbaccel import Accelerator\naccelerator = Accelerator()")
    ranks.run("n = accelerator.num_processes\nt = accelerator.reduce(torch.tensor([rank + 1.0]))")
    assert ranks.pull("n") == [2, 2]
    assert [float(v) for v in ranks.pull("t")] == [3.0, 3.0]
    ranks.run("accelerator.end_training()")  # the session's group is not the Accelerator's
    ranks.run("z = torch.ones(1)\ndist.all_reduce(z)")
    assert [float(v) for v in ranks.pull("z")] == [2.0, 2.0]


def test_push_puts_values_into_every_rank_and_pull_names_a_missing_one(ranks):
    ranks.push(lr=0.5, sizes=[1, 2])
    ranks.run("scaled = [lr * s * (rank + 1) for s in sizes]")
    assert ranks.pull("scaled") == [[0.5, 1.0], [1.0, 2.0]]
    ranks.push(ranks=1, only=7)
    with pytest.raises(CellError, match=r"rank 0.*NameError.*'only'"):
        ranks.pull("only")
    assert ranks.pull("only", ranks=1) == [7]


def test_bad_arguments_say_what_to_give():
    with pytest.raises(NbaccelError, match="output='every'"):
        Ranks(2, cpu=True, output="every")
    with pytest.raises(NbaccelError, match="on_hang"):
        Ranks(2, cpu=True, on_hang="wait")


def test_ranks_outside_the_session_are_refused(ranks):
    for bad in (2, [0, 0], [], [-1]):
        with pytest.raises(NbaccelError, match="between 0 and 1"):
            ranks.run("pass", ranks=bad)


def test_a_rank_alone_in_a_collective_is_reported_and_its_peer_can_free_it():
    with Ranks(2, cpu=True, live=False, stall_timeout=2) as ranks:
        ranks.run("x = torch.tensor([rank + 1.0])")
        with pytest.raises(CellError) as caught:
            ranks.run("dist.all_reduce(x)", ranks=0)
        error = caught.value
        assert error.hung and "rank 0 waits in `all_reduce`" in str(error)
        assert "Where each rank was" in str(error) and error.stacks[0] is not None
        assert ranks.status()[0]["state"].startswith("busy")
        with pytest.raises(NbaccelError, match="rank 0 is still in cell"):
            ranks.run("pass")  # every rank: rank 0 cannot take it
        ranks.run("dist.all_reduce(x)", ranks=1)  # the collective rank 0 waits in
        idle(ranks, 0)  # its late report arrives once its all_reduce returns
        ranks.run("pass")
        assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_on_hang_restart_gives_fresh_ranks_after_the_report():
    with Ranks(2, cpu=True, live=False, stall_timeout=2, on_hang="restart") as ranks:
        before = pids(ranks)
        with pytest.raises(CellError, match="were restarted"):
            ranks.run("dist.barrier()", ranks=1)
        assert set(pids(ranks)).isdisjoint(before)
        ranks.run("x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
        assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_a_cell_past_its_timeout_is_interrupted_and_the_ranks_stay():
    with Ranks(2, cpu=True, live=False, timeout=1) as ranks:
        before = pids(ranks)
        ranks.run("x = rank")
        with pytest.raises(CellError, match="past its timeout"):
            ranks.run("import time\ntime.sleep(60)")
        assert pids(ranks) == before and ranks.pull("x") == [0, 1]


def test_a_killed_rank_is_named_the_others_stopped_and_restart_gives_a_new_group(ranks):
    old = pids(ranks)
    cell = "import time\nif rank == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(60)"
    with pytest.raises(CellError) as caught:
        ranks.run("import os")
        ranks.run(cell)
    assert caught.value.rank == 1 and "killed by SIGKILL" in str(caught.value)
    assert "restart" in str(caught.value)
    assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in old)  # rank 0 stopped
    with pytest.raises(NbaccelError, match="restart"):
        ranks.run("pass")
    ranks.restart()
    assert set(pids(ranks)).isdisjoint(old)
    ranks.run("x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
    assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_a_rank_that_died_between_cells_is_said_by_the_next_cell(ranks):
    victim = psutil.Process(pids(ranks)[1])
    os.kill(victim.pid, signal.SIGKILL)  # a rank this test's session started
    victim.wait(timeout=30)
    with pytest.raises(NbaccelError, match=r"rank 1 .*killed by SIGKILL between cells"):
        ranks.run("pass")


def test_stop_ends_every_rank():
    session = Ranks(2, cpu=True, live=False)
    processes = [psutil.Process(pid) for pid in pids(session)]
    session.stop()
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive and session.status() == []
    with pytest.raises(NbaccelError, match="no ranks are running"):
        session.run("pass")


def idle(session: Ranks, rank: int) -> None:
    """Wait until ``rank`` has reported its cell (a hang guard: it ends in milliseconds)."""
    deadline = time.monotonic() + 60
    while session.status()[rank]["state"] != "idle":
        assert time.monotonic() < deadline, f"rank {rank} never reported its cell"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_stop_button_on_a_rank_stuck_in_a_collective_reports_it_and_keeps_it():
    """The press is sent from a thread once the session counts presses and rank 0 is seen
    waiting in its collective (its own stack says so): no timing decides the verdict."""
    from nbaccel.observe.hang import where
    from nbaccel.observe.stacks import collect, socket_path

    with Ranks(2, cpu=True, live=False, stall_timeout=None) as ranks:
        ranks.run("x = torch.tensor([rank + 1.0])")

        def press_once_stuck() -> None:
            path = socket_path(ranks.stacks_dir, 0)
            while True:
                counting = getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_press"
                stack = collect({0: path}).get(0)
                if counting and stack is not None and where(stack).collective:
                    os.kill(os.getpid(), signal.SIGINT)  # the stop button, at this process
                    return
                time.sleep(0.05)

        presser = threading.Thread(target=press_once_stuck, daemon=True)
        presser.start()
        with pytest.raises(CellError) as caught:
            ranks.run("dist.all_reduce(x)", ranks=0)
        presser.join(timeout=60)
        assert caught.value.hung and "stop button" in str(caught.value)
        assert "rank 0 waits in `all_reduce`" in str(caught.value)
        ranks.run("dist.all_reduce(x)", ranks=1)  # frees rank 0, whose cell then stops
        idle(ranks, 0)
        ranks.run("pass")
        assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_a_syntax_error_is_said_once_before_any_rank_runs_the_cell(ranks):
    with pytest.raises(SyntaxError):
        ranks.run("x = = 1")
    ranks.run("y = 2")
    assert ranks.pull("y") == [2, 2]


def test_a_fork_server_that_died_is_said_and_restart_starts_a_new_one(ranks):
    server = psutil.Process(ranks.server.process.pid)  # the server this session holds
    server.kill()
    server.wait(timeout=30)
    psutil.wait_procs([psutil.Process(p) for p in pids(ranks) if psutil.pid_exists(p)], timeout=30)
    with pytest.raises(NbaccelError, match=r"fork server .* stopped between cells"):
        ranks.run("pass")
    ranks.restart()
    ranks.run("x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)")
    assert [float(v) for v in ranks.pull("x")] == [3.0, 3.0]


def test_the_launch_defaults_reach_an_accelerator_made_in_a_cell():
    with Ranks(2, cpu=True, live=False, fsdp=True, mixed_precision="bf16") as ranks:
        ranks.run("from nbaccel import Accelerator\na = Accelerator()")
        ranks.run("kind, precision = a.distributed_type.value, a.mixed_precision")
        assert ranks.pull("kind") == ["FSDP", "FSDP"]
        assert ranks.pull("precision") == ["bf16", "bf16"]
