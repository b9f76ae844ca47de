"""The ``nbaccel`` console script, driven as a user drives it: in a subprocess.

Each test points ``NBACCEL_CONFIG`` at a file under its own ``tmp_path`` through the child's
environment, so no test reads or writes the real config and ``os.environ`` here stays as it was.
Timeouts catch hangs, not slowness: a loaded 2-core box takes seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import psutil
import pytest
import torch

from nbaccel.cli import main
from nbaccel.commands import UsageError
from nbaccel.commands import test as sanity
from nbaccel.commands.launch import check_gpus, torchrun_command
from nbaccel.env import find_free_port
from nbaccel.errors import NbaccelError
from nbaccel.launch.torchrun import RunOutcome

TIMEOUT = 180
NBACCEL = [sys.executable, "-m", "nbaccel"]  # as the lessons call it: no PATH needed

ALL_REDUCE = """
import sys
import torch
from nbaccel import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([accelerator.rank + 1.0]))
print(f"rank {accelerator.rank} of {accelerator.num_processes}: sum {total.item():.0f}, "
      f"{accelerator.mixed_precision} on {accelerator.device}, args {sys.argv[1:]}", flush=True)
import os  # what Hugging Face Accelerate's Accelerator would read, were it built here
print(f"rank {accelerator.rank}: accelerate cpu={os.environ.get('ACCELERATE_USE_CPU')} "
      f"precision={os.environ.get('ACCELERATE_MIXED_PRECISION')}", flush=True)
accelerator.end_training()
"""
RANK_1_RAISES = """
import os, time
if os.environ["RANK"] == "1":
    raise RuntimeError("rank 1 broke on purpose")
time.sleep(120)  # rank 0 waits until torchrun stops it
"""
WAITS = """
import os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
(folder / f".{os.environ['RANK']}").write_text(str(os.getpid()))
os.replace(folder / f".{os.environ['RANK']}", folder / os.environ["RANK"])  # appears whole
time.sleep(120)
"""
HANGS = """
import time, torch
import torch.distributed as dist
from nbaccel import PartialState

def wait_for_the_moon():
    time.sleep(120)

state = PartialState()  # under nbaccel launch, it also listens for "where are you?"
if state.process_index == 1:
    wait_for_the_moon()
dist.all_reduce(torch.ones(1))
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tmp_path / "config" / "nbaccel.json"


def nbaccel(config: Path, *args: str, stdin: str = "", command=NBACCEL, env=None):
    env = {**os.environ, "NBACCEL_CONFIG": str(config), **(env or {})}
    return subprocess.run(
        [*command, *args], env=env, input=stdin, capture_output=True, text=True, timeout=TIMEOUT
    )


def script(tmp_path: Path, source: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(source)
    return str(path)


# -- launch ------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_launch_runs_two_ranks_with_config_defaults_and_flags(tmp_path, config):
    config.parent.mkdir()
    config.write_text(json.dumps({"num_processes": 2, "mixed_precision": "fp16", "cpu": True}))
    path = script(tmp_path, ALL_REDUCE)
    done = nbaccel(config, "launch", "--mixed-precision", "bf16", path, "--lr", "3", "-n", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # 2 from the config; bf16 from the flag; -n after SCRIPT is the script's
        line = f"rank {rank} of 2: sum 3, bf16 on cpu, args ['--lr', '3', '-n', '5']"
        assert line in done.stdout, done.stdout
        assert f"rank {rank}: accelerate cpu=1 precision=bf16" in done.stdout  # the same choices


@pytest.mark.multiprocess
def test_two_nodes_meet_at_the_master_address(tmp_path, config):
    path, port = script(tmp_path, ALL_REDUCE), str(find_free_port())
    env = {**os.environ, "NBACCEL_CONFIG": str(config)}

    def node(rank: str) -> subprocess.Popen:
        command = ["--num-nodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1"]
        command = [*NBACCEL, "launch", "--cpu", "-n", "1", *command, "--master-port", port, path]
        return subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    nodes = [node(rank) for rank in "01"]
    try:
        outputs = [node.communicate(timeout=TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for rank, (node, (out, err)) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, err[-3000:]
        assert f"rank {rank} of 2: sum 3, no on cpu" in out


@pytest.mark.multiprocess
def test_a_failed_rank_is_named_with_its_exit_code(tmp_path, config):
    done = nbaccel(config, "launch", "-n", "2", "--cpu", script(tmp_path, RANK_1_RAISES))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: rank 1 broke on purpose" in done.stderr  # torchrun's output shows
    summary = done.stderr.strip().splitlines()[-1]
    assert re.match(r"nbaccel launch: rank 1 on \S+ failed with exit code 1;", summary), summary


@pytest.mark.multiprocess
def test_a_timeout_names_where_each_rank_was_stuck(tmp_path, config):
    path = script(tmp_path, HANGS)
    env = {"TMPDIR": str(tmp_path)}  # the sockets' folder, to see that it is removed
    done = nbaccel(config, "launch", "-n", "2", "--cpu", "--timeout", "30", path, env=env)
    assert done.returncode == 124, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("nbaccel launch: timeout") :]
    assert report.startswith("nbaccel launch: timeout: the run had not finished after 30 s")
    assert "rank 1 is in `wait_for_the_moon` (script.py, line 7)" in report, report
    assert "rank 0 waits in `all_reduce` called from `<module>` (script.py, line 12)" in report
    assert "time.sleep(120)" in report  # the source, read on this side
    assert not list(tmp_path.glob("nbaccel-stacks-*"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["SIGTERM to nbaccel", "SIGINT to its whole group, no terminal"])
def test_a_signal_ends_torchrun_and_every_worker(tmp_path, config, how):
    command = [*NBACCEL, "launch", "-n", "2", "--cpu", script(tmp_path, WAITS), str(tmp_path)]
    env = {**os.environ, "NBACCEL_CONFIG": str(config)}
    launch = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True,  # its own group, as in a terminal
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / rank).exists() for rank in "01"):
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        workers = []
        for rank in "01":
            pid = int((tmp_path / rank).read_text())
            try:
                workers.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
        if sig == signal.SIGTERM:
            launch.send_signal(sig)
        else:
            os.killpg(launch.pid, sig)
        _, stderr = launch.communicate(timeout=TIMEOUT)
        assert launch.returncode == 128 + sig, stderr[-3000:]
        assert f"stopped by {sig.name}" in stderr
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {alive}"
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs util-linux's setsid --ctty")
def test_ctrl_c_in_a_terminal_reaches_torchrun_once(tmp_path, config):
    """A real terminal: Ctrl-C signals the whole foreground group, so nbaccel must not send
    torchrun a second SIGINT, which would interrupt torchrun while it stops its workers."""
    main_fd, terminal = os.openpty()
    command = ["setsid", "--ctty", *NBACCEL, "launch", "-n", "2", "--cpu"]
    launch = subprocess.Popen(
        [*command, script(tmp_path, WAITS), str(tmp_path)],
        env={**os.environ, "NBACCEL_CONFIG": str(config)},
        stdin=terminal, stdout=terminal, stderr=terminal,
    )  # fmt: skip
    os.close(terminal)
    output = bytearray()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / rank).exists() for rank in "01"):
            assert launch.poll() is None and time.monotonic() < deadline, output.decode()
            _read_some(main_fd, output)
        workers = [psutil.Process(int((tmp_path / rank).read_text())) for rank in "01"]
        os.write(main_fd, b"\x03")  # Ctrl-C, as typed
        while _read_some(main_fd, output) and time.monotonic() < deadline:
            pass
        assert launch.wait(timeout=TIMEOUT) == 128 + signal.SIGINT, output.decode()[-3000:]
        assert "stopped by SIGINT" in output.decode()
        # torchrun reports each signal it caught as "SignalException: Process N got signal: 2"
        assert output.decode().count("SignalException: Process") == 1, output.decode()[-3000:]
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {alive}"
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        os.close(main_fd)


def _read_some(fd: int, into: bytearray) -> bool:
    """Read what the terminal shows within 0.2 s; False once nothing holds it open any more."""
    if select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # Linux: EIO once every process closed the terminal
            return False
        into += chunk
        return bool(chunk)
    return True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mixed-precision", "fp32", "x.py"], "invalid choice: 'fp32'"),
        (["-n", "0", "x.py"], "0 must be at least 1"),
        (["-n", "two", "x.py"], "'two' is not a whole number"),
        (["--num-nodes", "2", "x.py"], "--master-addr (node 0's address) and --master-port"),
        (["--num-nodes", "2", "--master-port", "29500", "x.py"], "pass --master-addr (node 0"),
        (["--num-nodes", "2", "--node-rank", "2", "x.py"], "--node-rank 2 must be in 0..1"),
        (["--master-addr", "10.0.0.1", "x.py"], "--master-addr needs --master-port too"),
        (["--master-port", "70000", "x.py"], "--master-port 70000 is not a port"),
        (["missing.py"], "'missing.py' is not a file; for a module, add -m"),
        (["--timeout", "soon", "x.py"], "'soon' is not a number of seconds, e.g. 600"),
        (["--timeout", "0", "x.py"], "0 must be a positive number of seconds"),
    ],
)
def test_bad_launch_arguments_exit_2_and_name_the_value(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        main(["launch", *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.process
def test_the_console_script_exists_and_rejects_bad_input(config):
    console = Path(sys.executable).with_name("nbaccel")
    assert console.exists(), "reinstall nbaccel (`make test`, or pip install -e .)"
    done = nbaccel(config, "launch", "--mixed-precision", "fp32", "x.py", command=[str(console)])
    assert done.returncode == 2
    assert "nbaccel launch: error: argument --mixed-precision: invalid choice: 'fp32'" in (
        done.stderr
    )


BARE_PATH = "/usr/bin:/bin"  # what a kernel registered from a venv has: not the venv's bin


@pytest.mark.parametrize("args", [["--help"], ["env"], ["config", "show"]], ids=" ".join)
@pytest.mark.process
def test_python_m_nbaccel_works_with_a_bare_path(config, args):
    done = nbaccel(config, *args, env={"PATH": BARE_PATH})
    assert done.returncode == 0, done.stderr
    expected = {"--help": "usage: nbaccel", "env": "- torch: ", "config": "num_processes"}
    assert expected[args[0]] in done.stdout


def test_more_processes_than_gpus_says_use_fewer_or_cpu():
    with pytest.raises(UsageError, match=r"has 1 visible GPU\(s\).*or --cpu to run 2"):
        check_gpus(2, gpus=1)
    check_gpus(2, gpus=0)  # CPU processes: any number


def test_torchrun_command_line():
    args = Namespace(
        num_nodes=1, node_rank=0, master_addr=None, master_port=None, module=True,
        script="pkg.train", script_args=["--lr", "3"], max_restarts=0,
    )  # fmt: skip
    assert torchrun_command(args, 2)[1:] == [
        "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "pkg.train", "--lr", "3",
    ]  # fmt: skip
    args = Namespace(**{**vars(args), "num_nodes": 2, "node_rank": 1, "master_port": 29500})
    assert torchrun_command(args, 4)[5:13] == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "29500"
    ]  # fmt: skip


@pytest.mark.process
def test_an_invalid_config_file_stops_a_launch_with_the_fix(tmp_path, config):
    config.parent.mkdir()
    config.write_text('{"num_processes": 0}')
    done = nbaccel(config, "launch", script(tmp_path, ALL_REDUCE))
    assert done.returncode == 1
    assert "num_processes=0 must be a positive int" in done.stderr
    assert "nbaccel config --default" in done.stderr


ROOT_CAUSE = """
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node7
  rank      : 3 (local_rank: 1)
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
============================================================
"""


def test_the_summary_reads_torchruns_root_cause_block():
    failed = RunOutcome(1, "noise\n" + ROOT_CAUSE.format(code=7))
    assert failed.describe().startswith("rank 3 on node7 failed with exit code 7;")
    killed = RunOutcome(1, ROOT_CAUSE.format(code=-9))
    assert "rank 3 on node7 was killed by SIGKILL (exit code -9)" in killed.describe()
    assert RunOutcome(2, "no block").describe() == (
        "torchrun exited with code 2 (its output is above)."
    )
    assert (failed.exit_status, RunOutcome(-9).exit_status) == (1, 137)


# -- config ------------------------------------------------------------------------------------
@pytest.mark.process
def test_config_default_then_show(config):
    done = nbaccel(config, "config", "show")
    assert done.returncode == 0 and "no file yet" in done.stdout and str(config) in done.stdout
    assert nbaccel(config, "config", "--default").returncode == 0
    assert json.loads(config.read_text()) == {
        "num_processes": None,
        "mixed_precision": "no",
        "cpu": False,
        "fsdp": False,
        "zero_stage": None,
        "slurm_partition": None,
        "slurm_account": None,
        "slurm_time": None,
        "prestart": True,
    }
    assert nbaccel(config, "config", "--num-processes", "2", "--cpu").returncode == 0
    shown = nbaccel(config, "config", "show")
    assert shown.returncode == 0
    path, content = shown.stdout.split("\n", 1)
    assert path == str(config)
    assert json.loads(content) == {
        "num_processes": 2,
        "mixed_precision": "no",
        "cpu": True,
        "fsdp": False,
        "zero_stage": None,
        "slurm_partition": None,
        "slurm_account": None,
        "slurm_time": None,
        "prestart": True,
    }


@pytest.mark.process
def test_config_asks_again_until_the_answer_is_valid(config):
    done = nbaccel(config, "config", stdin="0\n3\nfp32\nbf16\nmaybe\nyes\nyes\n")
    assert done.returncode == 0, done.stderr
    assert "0 must be at least 1; try again" in done.stdout
    assert "'fp32' is not one of no, fp16, bf16; try again" in done.stdout
    assert "'maybe' is not yes or no; try again" in done.stdout
    assert json.loads(config.read_text()) == {
        "num_processes": 3,
        "mixed_precision": "bf16",
        "cpu": True,
        "fsdp": True,
        "zero_stage": None,
        "slurm_partition": None,
        "slurm_account": None,
        "slurm_time": None,
        "prestart": True,
    }
    again = nbaccel(config, "config", stdin="\n\nno\n\n")  # Enter keeps the current value
    assert json.loads(config.read_text())["num_processes"] == 3, again.stdout


@pytest.mark.process
def test_config_turns_the_prestarted_server_off_and_the_questions_keep_it_off(config):
    assert nbaccel(config, "config", "--no-prestart").returncode == 0
    assert json.loads(config.read_text())["prestart"] is False
    done = nbaccel(config, "config", stdin="\n\n\n\n\n")  # every question: keep the value
    assert done.returncode == 0, done.stderr
    assert json.loads(config.read_text())["prestart"] is False


@pytest.mark.process
def test_config_sets_one_way_to_shard(config):
    done = nbaccel(config, "config", stdin="\n\n\nno\n7\n3\n")  # no FSDP: which ZeRO stage?
    assert done.returncode == 0, done.stderr
    assert "'7' is not none, 0, 1, 2 or 3; try again" in done.stdout
    assert json.loads(config.read_text())["zero_stage"] == 3
    assert nbaccel(config, "config", "--fsdp").returncode == 0  # FSDP turns ZeRO off
    assert json.loads(config.read_text())["fsdp"] is True
    assert json.loads(config.read_text())["zero_stage"] is None
    assert nbaccel(config, "config", "--zero-stage", "1").returncode == 0  # and back
    assert json.loads(config.read_text())["fsdp"] is False
    assert json.loads(config.read_text())["zero_stage"] == 1
    assert nbaccel(config, "config", "--zero-stage", "none").returncode == 0
    assert json.loads(config.read_text())["zero_stage"] is None
    both = nbaccel(config, "config", "--fsdp", "--zero-stage", "2")
    assert both.returncode == 2 and "choose one way to shard" in both.stderr


@pytest.mark.process
def test_config_without_a_terminal_suggests_default(config):
    done = nbaccel(config, "config", stdin="")
    assert done.returncode == 1
    assert "no answer (stdin is closed or not a terminal)" in done.stderr
    assert "nbaccel config --default" in done.stderr
    assert not config.exists()


@pytest.mark.process
def test_config_show_of_an_invalid_file_prints_it_and_the_fix(config):
    config.parent.mkdir()
    config.write_text('{"mixed_precision": "fp32"}')
    done = nbaccel(config, "config", "show")
    assert done.returncode == 1
    assert '{"mixed_precision": "fp32"}' in done.stdout
    assert "mixed_precision='fp32' is not one of" in done.stderr


def test_config_show_takes_no_flags(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["config", "show", "--cpu"])
    assert exit.value.code == 2
    assert "`nbaccel config show` takes no other arguments" in capsys.readouterr().err


# -- env and test ------------------------------------------------------------------------------
@pytest.mark.process
def test_env_is_a_paste_ready_list(config):
    done = nbaccel(config, "env")
    assert done.returncode == 0, done.stderr
    assert f"- torch: {torch.__version__}" in done.stdout
    assert f"- Config: {config} (no file: built-in defaults)" in done.stdout
    assert "- gloo: available" in done.stdout


@pytest.mark.multiprocess
def test_test_passes_on_two_workers(config):
    done = nbaccel(config, "test")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("OK: 2 ")


@pytest.mark.process
def test_test_reports_failed_with_the_reason(config):
    config.parent.mkdir()
    config.write_text("not json")
    done = nbaccel(config, "test")
    assert done.returncode == 1
    assert done.stdout.startswith("FAILED: ") and "is invalid" in done.stdout


def test_the_sanity_checks_name_what_disagreed():
    sanity.check_sum(3.0, 2)
    with pytest.raises(NbaccelError, match=r"all-reduce of rank\+1 gave 4.0, expected 3.0"):
        sanity.check_sum(4.0, 2)
    before = torch.zeros(3)
    sanity.check_weights(torch.ones(2, 3), before)
    with pytest.raises(NbaccelError, match=r"weights differ by up to 1\.00e\+00"):
        sanity.check_weights(torch.tensor([[1.0, 1, 1], [1, 1, 2]]), before)
    with pytest.raises(NbaccelError, match="the optimizer step did not change the weights"):
        sanity.check_weights(torch.zeros(2, 3), before)


# -- build-ops ---------------------------------------------------------------------------------
def test_build_ops_builds_deepspeeds_op_through_the_library(monkeypatch, capsys):
    import nbaccel.accelerator.strategies.ds_config as ds_config

    built = []
    monkeypatch.setattr(ds_config, "build_ops", lambda: built.append(True))
    assert main(["build-ops"]) == 0
    assert built == [True]


def test_build_ops_without_deepspeed_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    assert main(["build-ops"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nbaccel build-ops: error: DeepSpeed is not installed.")
    assert "pip install -c constraints.txt 'nbaccel[deepspeed]'" in err
