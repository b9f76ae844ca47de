"""LaunchConfig: one resolution of the launch options, one check each, the same for the API and
the CLI, and a round trip through the workers' environment."""

from __future__ import annotations

import json

import pytest

from nbaccel import notebook_launcher
from nbaccel.cli import main
from nbaccel.config import FLAGS, KEYWORDS, Defaults, LaunchConfig, load_config
from nbaccel.env import CPU_VAR, DEEPSPEED_VAR, FSDP_VAR, MIXED_PRECISION_VAR


def resolve(defaults: Defaults | None = None, gpus: int = 0, **arguments) -> LaunchConfig:
    return LaunchConfig.from_arguments(defaults=defaults, gpus=gpus, **arguments)


def test_an_argument_wins_then_the_config_file_then_the_built_in_default():
    saved = Defaults(num_processes=3, mixed_precision="bf16", cpu=True, zero_stage=1)
    assert resolve() == LaunchConfig(num_processes=1, mixed_precision="no", cpu=False)
    from_file = resolve(saved, gpus=2)
    assert (from_file.num_processes, from_file.mixed_precision) == (3, "bf16")
    assert (from_file.cpu, from_file.gpus, from_file.zero_stage) == (True, 0, 1)  # cpu: no GPUs
    given = resolve(saved, num_processes=2, mixed_precision="fp16", cpu=False, fsdp=True)
    assert (given.num_processes, given.mixed_precision, given.cpu) == (2, "fp16", False)
    assert (given.fsdp, given.zero_stage) == (True, None)  # FSDP turns the file's ZeRO off


def test_the_gpus_decide_the_default_number_of_processes():
    assert resolve(gpus=4).num_processes == 4
    assert resolve(gpus=4, cpu=True).num_processes == 1  # on the CPU the GPUs do not count
    assert resolve(Defaults(num_processes=2), gpus=4).num_processes == 2


def test_the_config_file_is_read_into_the_same_resolution(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_processes": 2, "fsdp": True}))
    config = resolve(load_config(path))
    assert (config.num_processes, config.fsdp, config.zero_stage) == (2, True, None)
    path.write_text(json.dumps({"zero_stage": 9}))
    with pytest.raises(ValueError, match=r"config file .* is invalid: zero_stage=9 must be 0, 1"):
        load_config(path)


# Each check is written once; only how it names the option depends on who asked.
BAD = [
    ({"num_processes": 0}, ValueError, "num_processes=0 must be at least 1", "--num-processes 0"),
    ({"num_nodes": "2"}, TypeError, "num_nodes='2' must be an int", "--num-nodes 2 must be"),
    ({"num_processes": 3, "gpus": 2}, ValueError, r"num_processes=3 but this machine has 2 "
     r"visible GPU\(s\).*cpu=True to run 3", r"--num-processes 3 but .*--cpu to run 3"),
    ({"num_nodes": 2, "node_rank": 2, "master_port": 1}, ValueError,
     "node_rank=2 must be an int in 0..1", "--node-rank 2 must be in 0..1 for --num-nodes 2"),
    ({"num_nodes": 2, "master_addr": "10.0.0.1"}, ValueError, "pass the same master_addr",
     r"pass --master-addr \(node 0's address\) and --master-port"),
    ({"master_port": 70000}, ValueError, "master_port=70000 is not a port",
     "--master-port 70000 is not a port"),
    ({"max_restarts": -1}, ValueError, r"max_restarts=-1 must be 0 \(no restarts\)",
     r"--max-restarts -1 must be 0 \(no restarts\)"),
    ({"mixed_precision": "fp32"}, ValueError, "mixed_precision='fp32' is not one of", None),
    ({"fsdp": True, "zero_stage": 2}, ValueError,
     r"fsdp=True and DeepSpeed \(zero_stage=2\) .*choose one way to shard",
     r"--fsdp and DeepSpeed \(--zero-stage 2\)"),
    ({"deepspeed": False, "zero_stage": 1}, ValueError, "zero_stage=1 asks for DeepSpeed, but "
     "deepspeed=False", "--zero-stage 1 asks for DeepSpeed, but --no-deepspeed"),
]  # fmt: skip


@pytest.mark.parametrize("arguments, error, keyword, flag", BAD, ids=[b[2][:30] for b in BAD])
def test_each_check_speaks_the_language_of_whoever_asked(arguments, error, keyword, flag):
    arguments = {"gpus": 0, **arguments}
    with pytest.raises(error, match=keyword):
        LaunchConfig.from_arguments(spelling=KEYWORDS, **arguments)
    if flag is not None:  # (argparse refuses a bad --mixed-precision itself)
        with pytest.raises(error, match=flag):
            LaunchConfig.from_arguments(spelling=FLAGS, **arguments)


def test_notebook_launcher_and_nbaccel_launch_share_the_gpu_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NBACCEL_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setattr("nbaccel.config.visible_gpus", lambda: 1)  # a one-GPU machine
    with pytest.raises(ValueError, match=r"num_processes=2 but this machine has 1 visible GPU"):
        notebook_launcher(print, num_processes=2)
    with pytest.raises(SystemExit) as exit:
        main(["launch", "-n", "2", "x.py"])
    assert exit.value.code == 2
    assert "--num-processes 2 but this machine has 1 visible GPU(s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config",
    [
        LaunchConfig(mixed_precision="bf16", cpu=True),
        LaunchConfig(mixed_precision="no", cpu=False, fsdp=True),
        LaunchConfig(zero_stage=0),
        LaunchConfig(zero_stage=3, mixed_precision="fp16"),
        LaunchConfig(),  # nothing said: nothing read back
    ],
    ids=repr,
)
def test_to_environ_then_from_environ_gives_the_workers_the_same_choices(config):
    seen = LaunchConfig.from_environ(config.to_environ({}))
    chosen = ("mixed_precision", "cpu", "fsdp", "zero_stage")
    assert [getattr(seen, k) for k in chosen] == [getattr(config, k) for k in chosen]


def test_an_empty_environment_says_nothing():
    seen = LaunchConfig.from_environ({})
    assert (seen.mixed_precision, seen.cpu, seen.fsdp, seen.zero_stage) == (None, None, False, None)


def test_the_workers_environment_keeps_the_users_own_choices():
    config = resolve(num_processes=2, mixed_precision="bf16")
    chosen = config.to_environ({"OMP_NUM_THREADS": "3", "ACCELERATE_USE_CPU": "0"})
    assert chosen["OMP_NUM_THREADS"] == "3" and chosen["ACCELERATE_USE_CPU"] == "0"
    assert chosen[MIXED_PRECISION_VAR] == chosen["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert chosen[CPU_VAR] == "0" and chosen[FSDP_VAR] == "0" and chosen[DEEPSPEED_VAR] == ""
    # on CPUs DeepSpeed (which HF Accelerate imports) is told its device instead of guessing
    cpu = resolve(num_processes=2, cpu=True)
    assert cpu.to_environ({})["DS_ACCELERATOR"] == "cpu"
    assert cpu.to_environ({"DS_ACCELERATOR": "mine"})["DS_ACCELERATOR"] == "mine"


@pytest.mark.parametrize(
    "environ, match",
    [
        ({DEEPSPEED_VAR: "x"}, r"NBACCEL_DEEPSPEED='x' must be a ZeRO stage, 0, 1, 2 or 3"),
        ({CPU_VAR: "yes"}, r"NBACCEL_CPU='yes' must be 1, 0 or unset"),
        ({FSDP_VAR: "true"}, r"NBACCEL_FSDP='true' must be 1, 0 or unset"),
        ({MIXED_PRECISION_VAR: "fp32"}, r"NBACCEL_MIXED_PRECISION='fp32' is not one of"),
        ({FSDP_VAR: "1", DEEPSPEED_VAR: "2"}, r"NBACCEL_FSDP and NBACCEL_DEEPSPEED disagree"),
    ],
)
def test_a_bad_launch_environment_names_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig.from_environ(environ)
