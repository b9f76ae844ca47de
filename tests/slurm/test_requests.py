"""What a launch asks of SLURM (``launch/slurm/cluster.py``): the time limit in SLURM's forms,
the request held against the partition before anything is submitted, the warning for a job
folder on a machine's own disk, and Ctrl-C on ``nbaccel launch --slurm``.

The parsers read the commands' real output: the lines below were printed by the test cluster's
SLURM 22.05 (``debug``, and a partition ``small`` created on it with limits); the GPU nodes' lines
are written as sinfo prints GRES. The cluster tests run on the two-node test cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from nbaccel import NbaccelError, SlurmCluster, notebook_launcher
from nbaccel.launch.slurm.cluster import check_slurm, default_partition, folder_warning
from nbaccel.launch.slurm.limits import (
    check_request,
    gres_gpus,
    memory_mb,
    minutes,
    read_nodes,
    read_partition,
)

SLURM = [pytest.mark.slurm, pytest.mark.multiprocess]

# `scontrol show partition debug -o` (the test cluster's only partition, its default)
DEBUG = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL "
    "Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 "
    "Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED "
    "Nodes=n[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO "
    "OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=4 TotalNodes=2 "
    "SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED "
    "MaxMemPerNode=UNLIMITED TRES=cpu=4,mem=8000M,node=2,billing=4\n"
)
# `scontrol create PartitionName=small Nodes=n1 MaxTime=1-12:00:00 MaxNodes=1 MaxCPUsPerNode=1
# State=DRAIN`, then `scontrol show partition small -o`
SMALL = (
    "PartitionName=small AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL "
    "Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 "
    "Hidden=NO MaxNodes=1 MaxTime=1-12:00:00 MinNodes=1 LLN=NO MaxCPUsPerNode=1 Nodes=n1 "
    "PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO "
    "OverTimeLimit=NONE PreemptMode=OFF State=DRAIN TotalCPUs=2 TotalNodes=1 "
    "SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED "
    "MaxMemPerNode=UNLIMITED TRES=cpu=2,mem=4000M,node=1,billing=2\n"
)
# `sinfo -h -N -p debug -o "%N|%c|%m|%G"`
NODES = "n1|2|4000|(null)\nn2|2|4000|(null)\n"
# the same for a GPU partition, GRES as sinfo prints it (types, sockets, other GRES beside)
GPU_NODES = (
    "g1|64|512000|gpu:a100:4(S:0-1)\n"
    "g2|64|512000|gpu:a100:4(S:0-1)\n"
    "g3|32|256000|gpu:a100:2(S:0)\n"
    "g4|32|256000|gpu:4,mps:400\n"
    "g5|64|512000|(null)\n"
)
GPU = DEBUG.replace("=debug", "=gpu").replace("TotalNodes=2", "TotalNodes=5")


@pytest.fixture(autouse=True)
def no_saved_defaults(tmp_path, monkeypatch):
    """SlurmCluster() reads `nbaccel config`'s defaults: none here, whatever this machine has."""
    monkeypatch.setenv("NBACCEL_CONFIG", str(tmp_path / "no-config.json"))


def check(num_nodes=1, partition=DEBUG, nodes=NODES, **request) -> None:
    cluster = SlurmCluster(folder="/scratch/jobs", **request)
    check_request(cluster, num_nodes, read_partition(partition), read_nodes(nodes))


# The time limit


@pytest.mark.parametrize(
    "time, expected",
    [
        (45, 45), ("30", 30), ("90:30", 90.5), ("1:30:00", 90), ("2-0", 2880),
        ("2-0:30", 2910), ("1-02:30:00", 1590), ("UNLIMITED", None), ("infinite", None),
    ],
)  # fmt: skip
def test_a_time_limit_is_read_in_each_of_slurms_forms(time, expected):
    assert minutes(time) == expected


@pytest.mark.parametrize("time", ["abc", "", "1:2:3:4", "1.5", "-5", "2-", "1-2:3:4:5", -1])
def test_a_time_in_none_of_slurms_forms_is_refused_by_the_parser(time):
    with pytest.raises(ValueError, match=r"is not a SLURM time limit; SLURM's forms: \"minutes\""):
        minutes(time)


@pytest.mark.parametrize("time", ["abc", "1:2:3:4", 0, "0", -5, True])
def test_a_cluster_with_a_time_in_none_of_slurms_forms_is_refused_when_built(time):
    with pytest.raises(
        NbaccelError,
        match=rf"SlurmCluster\(time={time!r}\) is not a SLURM time limit: give minutes as an int "
        r"> 0 \(time=30\) or a string in one of SLURM's forms: \"minutes\", .*\"days-hours:"
        r"minutes:seconds\", or \"UNLIMITED\"",
    ):
        SlurmCluster(time=time)


def test_each_of_slurms_time_forms_builds_a_cluster():
    for time in (30, "30", "30:00", "1:30:00", "2-0", "2-0:30", "2-00:30:00", "unlimited"):
        assert SlurmCluster(time=time).time == time


# Reading what SLURM shows


def test_the_default_partition_is_the_one_sinfo_marks():
    assert default_partition("debug*\n") == "debug"  # the test cluster's
    assert default_partition("gpu\ncpu*\nlong\n") == "cpu"
    assert default_partition("gpu\n") is None and default_partition("") is None


def test_a_partition_is_read_from_scontrols_line():
    debug, small = read_partition(DEBUG), read_partition(SMALL)
    assert (debug.name, debug.state, debug.total_nodes) == ("debug", "UP", 2)
    assert debug.max_nodes is debug.max_time is debug.max_cpus_per_node is None  # UNLIMITED
    assert (small.state, small.total_nodes, small.max_nodes) == ("DRAIN", 1, 1)
    assert (small.max_time, small.max_cpus_per_node) == ("1-12:00:00", 1)
    assert read_partition("") is None  # scontrol failed: its stdout is empty
    partial = read_partition("PartitionName=hidden State=UP\n")  # a cluster that shows little
    assert (partial.total_nodes, partial.max_nodes, partial.max_time) == (None, None, None)


def test_nodes_are_read_from_sinfos_lines():
    assert [(n.name, n.cpus, n.memory_mb, n.gpus) for n in read_nodes(NODES)] == [
        ("n1", 2, 4000, 0),
        ("n2", 2, 4000, 0),
    ]
    assert [n.gpus for n in read_nodes(GPU_NODES)] == [4, 4, 2, 4, 0]
    assert read_nodes("") is None  # sinfo failed
    assert read_nodes("n1|2+|4000|(null)\n") is None  # not one node's count
    assert read_nodes("n1|2|4000\n") is None  # a field missing


@pytest.mark.parametrize(
    "gres, gpus",
    [
        ("(null)", 0), ("gpu:4", 4), ("gpu:a100:4", 4), ("gpu:a100:4(S:0-1)", 4),
        ("gpu:a100:2(S:0),gpu:v100:2(S:1)", 4), ("gpu:4,mps:400", 4), ("mps:400", 0),
        ("gpu:a100", None), ("gpu", None),
    ],
)  # fmt: skip
def test_the_gpus_are_read_from_a_nodes_gres(gres, gpus):
    assert gres_gpus(gres) == gpus


@pytest.mark.parametrize(
    "mem, mb",
    [
        ("100G", 102400), ("4000M", 4000), ("4000", 4000), (4000, 4000), ("1T", 1024**2),
        ("2048K", 2), ("16g", 16384), ("0", None), ("lots", None), (None, None),
    ],
)  # fmt: skip
def test_mem_is_read_in_slurms_units(mem, mb):
    assert memory_mb(mem) == mb


# What can never start is refused before it is submitted


def test_more_nodes_than_the_partition_has_are_refused():
    with pytest.raises(
        NbaccelError,
        match=r"SLURM partition 'debug' has 2 nodes; num_nodes=3 can never start: ask for at "
        r"most 2 \(num_nodes=2\), or choose another partition with SlurmCluster\(partition=",
    ):
        check(num_nodes=3)


def test_more_nodes_than_maxnodes_are_refused():
    one = DEBUG.replace("MaxNodes=UNLIMITED", "MaxNodes=1")
    with pytest.raises(
        NbaccelError,
        match=r"'debug' allows 1 node per job \(MaxNodes\); num_nodes=2 can never start: ask "
        r"for at most 1 \(num_nodes=1\)",
    ):
        check(num_nodes=2, partition=one)


def test_more_cpus_than_any_node_has_are_refused():
    with pytest.raises(
        NbaccelError,
        match=r"the nodes of SLURM partition 'debug' have at most 2 CPUs; cpus_per_task=3 can "
        r"never start: ask for at most 2 CPUs \(SlurmCluster\(cpus_per_task=2\)\), or choose",
    ):
        check(cpus_per_task=3)


def test_more_cpus_than_maxcpuspernode_are_refused():
    capped = DEBUG.replace("MaxCPUsPerNode=UNLIMITED", "MaxCPUsPerNode=1")
    with pytest.raises(NbaccelError, match=r"at most 1 CPUs; cpus_per_task=2 can never start"):
        check(cpus_per_task=2, partition=capped)


def test_more_memory_than_any_node_has_is_refused():
    with pytest.raises(
        NbaccelError,
        match=r"the nodes of SLURM partition 'debug' have at most 4000 MB of memory; "
        r"mem='100G' can never start: ask for at most 4000 MB of memory "
        r"\(SlurmCluster\(mem='4000M'\)\)",
    ):
        check(mem="100G")


def test_more_gpus_than_any_node_has_are_refused():
    with pytest.raises(NbaccelError, match=r"at most 4 GPUs; gpus_per_node=8 can never start"):
        check(partition=GPU, nodes=GPU_NODES, gpus_per_node=8)
    with pytest.raises(
        NbaccelError,
        match=r"'debug' have at most 0 GPUs; gpus_per_node=1 can never start: choose another "
        r"partition with SlurmCluster\(partition=\.\.\.\)",
    ):
        check(gpus_per_node=1)


def test_fewer_nodes_with_enough_of_a_resource_than_num_nodes_are_refused():
    with pytest.raises(
        NbaccelError,
        match=r"only 3 of the nodes of SLURM partition 'gpu' have 4 GPUs; num_nodes=4 with "
        r"gpus_per_node=4 can never start: ask for at most 3 nodes \(num_nodes=3\), or for at "
        r"most 2 GPUs each \(SlurmCluster\(gpus_per_node=2\)\)",
    ):
        check(num_nodes=4, partition=GPU, nodes=GPU_NODES, gpus_per_node=4)


def test_fewer_nodes_with_every_resource_at_once_than_num_nodes_are_refused():
    # 64 CPUs: g1, g2, g5; 4 GPUs: g1, g2, g4; both: g1 and g2 alone.
    with pytest.raises(
        NbaccelError,
        match=r"only 2 of the nodes of SLURM partition 'gpu' have 64 CPUs and 4 GPUs at once; "
        r"num_nodes=3 can never start: ask for at most 2 nodes \(num_nodes=2\), or for less",
    ):
        check(num_nodes=3, partition=GPU, nodes=GPU_NODES, cpus_per_task=64, gpus_per_node=4)
    with pytest.raises(
        NbaccelError,
        match=r"only 0 of the nodes .* at once; .* ask for less on each node, or choose",
    ):
        check(num_nodes=1, partition=GPU, nodes="a|64|9|(null)\nb|2|9|gpu:4\n", cpus_per_task=64,
              gpus_per_node=4)  # fmt: skip
    check(num_nodes=2, partition=GPU, nodes=GPU_NODES, cpus_per_task=64, gpus_per_node=4)


def test_a_time_longer_than_maxtime_is_refused():
    up = SMALL.replace("State=DRAIN", "State=UP")
    with pytest.raises(
        NbaccelError,
        match=r"'small' runs a job for at most 1-12:00:00 \(MaxTime\); time='2-00:00:00' can "
        r"never start: ask for at most that, SlurmCluster\(time='1-12:00:00'\)",
    ):
        check(partition=up, time="2-00:00:00")
    check(partition=up, time="1-12:00:00")
    check(partition=up, time=2160)
    check(time="30-00:00:00")  # debug: MaxTime=UNLIMITED


@pytest.mark.parametrize(
    "state, why",
    [
        ("DRAIN", "it takes no new jobs"),
        ("DOWN", "it queues jobs but starts none until an administrator sets it UP"),
        ("INACTIVE", "it neither takes nor starts jobs"),
    ],
)
def test_a_partition_that_is_not_up_is_refused(state, why):
    with pytest.raises(
        NbaccelError,
        match=rf"SLURM partition 'small' is {state} \({why}\): choose another partition with "
        r"SlurmCluster\(partition=\.\.\.\)",
    ):
        check(partition=SMALL.replace("State=DRAIN", f"State={state}"))


def test_what_slurm_does_not_show_is_never_refused():
    check(num_nodes=99, partition="", cpus_per_task=99)  # scontrol failed
    check(num_nodes=99, partition="PartitionName=hidden State=UP", nodes="", mem="1T")
    check(gpus_per_node=8, nodes="n1|2|4000|gpu:a100\n")  # a GRES without a count
    check(mem="lots")  # sbatch says what is wrong with it
    check(num_nodes=2, cpus_per_task=2, mem="4000M", time=60)  # fits


# The job folder on a machine's own disk


@pytest.mark.parametrize(
    "folder, root",
    [("/tmp/jobs", "/tmp"), ("/var/tmp/me/jobs", "/var/tmp"), ("/dev/shm/j", "/dev/shm")],
)
def test_a_folder_on_a_machines_own_disk_is_warned_of_with_the_fix(folder, root):
    assert folder_warning(SlurmCluster(folder=folder), num_nodes=2) == (
        f"the job folder {folder} is under {root}, which on most clusters is each machine's own, "
        "so the job's 2 nodes may not see it: give SlurmCluster(folder=...) a folder on your "
        "home or the cluster's scratch, e.g. SlurmCluster(folder='~/nbaccel-jobs')"
    )


def test_a_folder_under_the_temporary_folder_python_uses_is_warned_of(monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/local/scratch/tmp")  # $TMPDIR, as Python reads it
    warning = folder_warning(SlurmCluster(folder="/local/scratch/tmp/jobs"), num_nodes=1)
    assert "is under /local/scratch/tmp" in warning and "the job's node may not" in warning


def test_a_shared_folder_gets_no_warning():
    assert folder_warning(SlurmCluster(folder="/home/me/nbaccel-jobs"), num_nodes=2) is None
    assert folder_warning(SlurmCluster(folder="/scratch/me/tmp/jobs"), num_nodes=2) is None


# On the test cluster: refused before anything is submitted


def sleeps():
    import time

    time.sleep(600)


@pytest.mark.parametrize(
    "num_nodes, request_, said",
    [
        (3, {}, r"SLURM partition 'debug' has 2 nodes; num_nodes=3 can never start"),
        (1, {"cpus_per_task": 3}, r"'debug' have at most 2 CPUs; cpus_per_task=3 can never"),
        (2, {"mem": "100G"}, r"'debug' have at most 4000 MB of memory; mem='100G' can never"),
    ],
)
@pytest.mark.slurm
@pytest.mark.multiprocess
def test_a_request_the_cluster_can_never_run_is_refused_unsubmitted(
    empty_queue, tmp_path, num_nodes, request_, said
):
    cluster = SlurmCluster(time=10, folder=tmp_path, **request_)
    with pytest.raises(NbaccelError, match=said):
        check_slurm(cluster, num_nodes)  # SLURM's own output, read here
    with pytest.raises(NbaccelError, match=said):
        notebook_launcher(sleeps, num_nodes=num_nodes, cluster=cluster, timeout=60)
    assert not list(tmp_path.iterdir())  # no job folder: nothing was submitted


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_a_request_that_fits_passes_the_check(slurm, tmp_path):
    check_slurm(SlurmCluster(time=10, folder=tmp_path, cpus_per_task=2, mem="4000M"), 2)


# Ctrl-C on `nbaccel launch --slurm`

SCRIPT = textwrap.dedent(
    """
    import time
    print("started", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_ctrl_c_on_launch_slurm_cancels_the_job_and_exits_130(empty_queue, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    command = [sys.executable, "-m", "nbaccel", "launch", "--slurm", "--num-nodes", "1"]
    command += ["-n", "1", "--folder", str(tmp_path / "jobs"), "--timeout", "240", "train.py"]
    with open(tmp_path / "stderr", "w+") as stderr:
        launch = subprocess.Popen(
            command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ},
        )  # fmt: skip
        try:
            seen = []
            for line in launch.stdout:  # ends when the launch does (--timeout, at worst)
                seen.append(line)
                if line.startswith("[rank 0] started"):
                    launch.send_signal(signal.SIGINT)
                    break
            launch.communicate(timeout=200)
        finally:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
        stderr.seek(0)
        err = stderr.read()
    assert "[rank 0] started\n" in seen, "".join(seen) + err
    assert launch.returncode == 130, err
    assert "nbaccel launch: stopped by SIGINT; the workers were ended." in err
    assert "Traceback" not in err
    said_gone = " was cancelled.\n" in err  # what the launch saw in the queue after its stop
    assert not said_gone or empty_queue.queue() == [], err
