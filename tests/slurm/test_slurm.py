"""notebook_launcher(cluster=SlurmCluster(...)) on a real two-node SLURM cluster (``cluster.py``).

Oracle: DDP over 2 nodes equals one process on the same global batch. Verdicts come from what
the job returned, raised and left in the queue, never from a clock; the timeouts catch hangs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from nbaccel import LaunchError, NbaccelError, SlurmCluster, notebook_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

STEPS, BATCH, LR = 3, 8, 0.1


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, BATCH, 4, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def train_ddp():
    """Each rank trains on its slice of every global batch; returns weights, node and rank."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = DDP(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = data()
    per = BATCH // world
    for step in range(STEPS):
        part = slice(rank * per, (rank + 1) * per)
        loss = torch.nn.functional.mse_loss(net(x[step, part]), y[step, part])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = [p.detach().clone() for p in net.module.parameters()]
    dist.destroy_process_group()
    print(f"trained on {os.environ['SLURMD_NODENAME']}")
    return weights, os.environ["SLURMD_NODENAME"], rank


def one_process():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = data()
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(net(x[step]), y[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("per_node", [1, 2])
def test_ddp_on_two_nodes_equals_one_process(empty_queue, tmp_path, capfd, per_node):
    cluster = SlurmCluster(time=10, folder=tmp_path)
    values = notebook_launcher(
        train_ddp, num_nodes=2, num_processes=per_node, cluster=cluster, return_all=True,
        timeout=240,
    )  # fmt: skip
    world = 2 * per_node
    assert [rank for _, _, rank in values] == list(range(world))
    assert sorted({node for _, node, _ in values}) == ["n1", "n2"]
    expected = one_process()
    for weights, _, _ in values:
        for got, want in zip(weights, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    out = capfd.readouterr().out
    for rank in range(world):  # every rank's output, with its prefix
        assert f"[rank {rank}] trained on n" in out
    assert (
        notebook_launcher(  # rank 0's value alone without return_all
            train_ddp, num_nodes=2, cluster=cluster, timeout=240
        )[2]
        == 0
    )


def fails_on_the_second_node():
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["SLURMD_NODENAME"] == "n2":
        raise ValueError("bad shard on the second node")
    dist.barrier()  # rank 0 waits for the rank that failed
    dist.destroy_process_group()


def test_an_error_on_the_second_node_names_its_rank_and_node(empty_queue, tmp_path):
    cluster = SlurmCluster(time=10, folder=tmp_path)
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(fails_on_the_second_node, num_nodes=2, cluster=cluster, timeout=240)
    error = caught.value
    assert isinstance(error, ChildFailedError)
    assert error.rank == 1 and error.root_cause.node == "n2"
    text = str(error)
    assert text.startswith("rank 1 (pid ") and "on node n2 raised ValueError" in text
    assert "bad shard on the second node" in text
    assert 'raise ValueError("bad shard on the second node")' in text  # its own traceback


def sleeps():
    import time

    time.sleep(600)


def test_a_time_limit_kill_says_to_ask_for_more_time(empty_queue, tmp_path):
    cluster = SlurmCluster(time=1, folder=tmp_path)  # SLURM's smallest limit: a minute
    with pytest.raises(LaunchError, match=r"at its time limit .*SlurmCluster\(time=\.\.\.\)"):
        notebook_launcher(sleeps, num_nodes=1, cluster=cluster, timeout=280)


def test_a_timeout_cancels_the_job(empty_queue, tmp_path):
    cluster = SlurmCluster(time=10, folder=tmp_path)
    with pytest.raises(LaunchError, match="did not finish within timeout=20 s and was cancel"):
        notebook_launcher(sleeps, num_nodes=2, cluster=cluster, timeout=20)


def test_an_unknown_partition_is_named_with_the_ones_there_are(empty_queue, tmp_path):
    cluster = SlurmCluster(partition="gpu-large", folder=tmp_path)
    with pytest.raises(NbaccelError, match=r"no partition 'gpu-large'; this cluster's: debug"):
        notebook_launcher(sleeps, num_nodes=2, cluster=cluster)


def test_the_batch_script_can_be_read_before_it_is_submitted(tmp_path):
    script = SlurmCluster(
        partition="gpu", time="2:00:00", account="lab", gpus_per_node=4, cpus_per_task=32,
        folder=tmp_path, mem="64G",
    ).batch_script(num_nodes=2)  # fmt: skip
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=2:00:00",
        "#SBATCH --mem=64G",
    ):
        assert line in script.splitlines(), line
    assert "srun" in script and f"{tmp_path}/%j" in script


def test_each_launch_gets_a_job_folder_of_its_own_even_if_a_job_id_recurs(tmp_path):
    # A cluster whose state was reset hands out job IDs again: a folder named by the ID alone
    # held an older job's rendezvous file and results (the second node joined a dead port and
    # the launch hung). Each launch's folder carries a tag of its own.
    cluster = SlurmCluster(folder=tmp_path)
    first, second = cluster.job_folder(), cluster.job_folder()
    assert first != second and first.parent == second.parent == tmp_path
    assert first.name.startswith("%j-") and second.name.startswith("%j-")
    assert str(first).replace("%j", "16") != str(second).replace("%j", "16")


def test_without_slurm_the_error_says_where_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(NbaccelError, match="no SLURM commands on PATH"):
        notebook_launcher(sleeps, num_nodes=2, cluster=SlurmCluster(folder=tmp_path))


def logs_a_loss():
    """A hand-written loop with the Recorder, as lessons 1-3 write it; and a second recorder
    that nobody closes, whose number the node still sends (``rank_recorder.close_all``)."""
    import torch.distributed as dist

    from nbaccel import Recorder

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recorder = Recorder(total_steps=5)
    for step in range(5):
        recorder.log({"loss": 10.0 * rank + step}, samples=4)
    recorder.close()
    Recorder().log({"unclosed": 1.0 + rank})  # gone when the function returns
    dist.destroy_process_group()


def test_every_nodes_records_reach_the_run(empty_queue, tmp_path):
    from nbaccel import Run

    run = Run()
    cluster = SlurmCluster(time=10, folder=tmp_path)
    notebook_launcher(logs_a_loss, num_nodes=2, cluster=cluster, run=run, timeout=240)
    series = run.series("loss")
    assert sorted(series) == [0, 1]
    assert series[0][1] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert series[1][1] == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert run.latest("nbaccel/samples") == {0: 20, 1: 20} and run.world_size == 2
    assert run.latest("unclosed") == {0: 1.0, 1: 2.0}
    timing = run.timing()  # the launch's own clock: started, first and last record, finished
    assert timing.startup > 0 and timing.startup + timing.training <= timing.wall


def test_the_cluster_defaults_come_from_nbaccel_config(tmp_path, monkeypatch):
    from nbaccel.cli import main

    monkeypatch.setenv("NBACCEL_CONFIG", str(tmp_path / "config.json"))
    flags = ["--slurm-partition", "gpu", "--slurm-account", "lab", "--slurm-time", "1:30:00"]
    assert main(["config", *flags]) == 0
    saved = SlurmCluster(folder=tmp_path)
    assert (saved.partition, saved.account, saved.time) == ("gpu", "lab", "1:30:00")
    given = SlurmCluster(partition="debug", time=5, account="other", folder=tmp_path)
    assert (given.partition, given.account, given.time) == ("debug", "other", 5)  # arguments win
    assert main(["config", "--slurm-time", "none", "--slurm-partition", "none"]) == 0
    assert SlurmCluster(folder=tmp_path).time == 60 and SlurmCluster().partition is None
    with pytest.raises(SystemExit):  # argparse's usage error: not minutes
        main(["config", "--slurm-time", "soon"])


def test_a_folder_the_nodes_cannot_see_is_named_with_the_fix(empty_queue, tmp_path):
    """The notebook's folder is a tmpfs mounted in a mount namespace of its own (unshare), as a
    login node's local disk is: the job's nodes (this machine's slurmd, outside it) cannot see
    what the notebook writes there."""
    folder = tmp_path / "local-only"
    folder.mkdir()
    code = (
        "from nbaccel import SlurmCluster, LaunchError, notebook_launcher\n"
        "try:\n"
        f"    notebook_launcher(sorted, args=([2, 1],), num_nodes=2, timeout=240,\n"
        f"                      cluster=SlurmCluster(time=10, folder={str(folder)!r}))\n"
        "except LaunchError as error:\n"
        "    print(error)\n"
    )
    mount = f'mount -t tmpfs tmpfs {folder} && exec {sys.executable} -c "$0"'
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, code],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert "the nodes cannot see that folder" in done.stdout, done.stdout + done.stderr
    assert "SlurmCluster(folder=...)" in done.stdout


def test_slurms_own_kills_are_each_said_with_the_option_to_change(tmp_path):
    """The test cluster enforces no memory limit (no cgroup plugin), so the memory kill's words
    are checked on the state SLURM reports, as the time limit's are on a real kill above."""
    from types import SimpleNamespace

    from nbaccel.launch.slurm.watch import Watch

    (tmp_path / "5_0_log.out").write_text("")  # the nodes did see the folder
    job = SimpleNamespace(job_id="5", task=lambda i: SimpleNamespace(
        paths=SimpleNamespace(stdout=tmp_path / f"5_{i}_log.out")))  # fmt: skip
    watch = Watch(job, tmp_path, b"k" * 32)
    said = watch.ended_by_slurm("OUT_OF_MEMORY", {}, missing=True)
    assert "more memory than it asked for" in said and "SlurmCluster(mem='32G')" in said
    said = watch.ended_by_slurm("TIMEOUT", {"TimeLimit": "00:01:00"}, missing=True)
    assert "at its time limit (00:01:00)" in said and "SlurmCluster(time=...)" in said
