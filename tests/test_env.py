from __future__ import annotations

import socket

import pytest
import torch

from nbaccel.env import DistEnv, backend_for, choose_device, find_free_port, in_notebook


def test_one_process_without_a_launcher():
    assert DistEnv.from_environ({}) == DistEnv(rank=0, local_rank=0, world_size=1)


def test_torchrun_variables():
    env = DistEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.is_distributed and env.master_port == 29400


def test_slurm_variables_are_the_fallback():
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "2",
            "MASTER_ADDR": "node1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size) == (1, 2)


def test_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"RANK=2 is outside 0..1"):
        DistEnv.from_environ(
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
        )


def test_a_variable_that_is_not_a_number():
    with pytest.raises(ValueError, match=r"RANK='zero' is not an integer"):
        DistEnv.from_environ({"RANK": "zero", "WORLD_SIZE": "2"})


def test_several_processes_need_a_rendezvous_address():
    with pytest.raises(ValueError, match=r"MASTER_ADDR/MASTER_PORT are not set"):
        DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})


def test_devices_and_backends():
    assert choose_device(cpu=True) == torch.device("cpu")
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


def test_a_free_port_can_be_bound():
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_pytest_is_not_a_notebook():
    assert in_notebook() is False
