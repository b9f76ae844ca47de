"""A ranks session on GPUs: one rank per visible GPU, NCCL, from a process that touched CUDA
first (as a notebook kernel that trained would have); values come back on the CPU."""

from __future__ import annotations

import torch

from nbaccel import Ranks

from .common import GPU

pytestmark = GPU


def test_ranks_on_gpus_join_nccl_once_and_keep_their_cuda_tensors():
    torch.zeros(1, device="cuda")  # this process holds a CUDA context: no rank is its fork
    with Ranks(live=False) as ranks:  # one rank per visible GPU, as notebook_launcher
        world = len(ranks.ranks)
        assert world == torch.cuda.device_count()
        ranks.run("x = torch.tensor([rank + 1.0], device=f'cuda:{local_rank}')")
        ranks.run("backend = dist.get_backend()\ndist.all_reduce(x)")
        ranks.run("from nbaccel import Accelerator\ndevice = str(Accelerator().device)")
        assert ranks.pull("backend") == ["nccl"] * world
        assert ranks.pull("device") == [f"cuda:{r}" for r in range(world)]
        values = ranks.pull("x")
        assert all(v.device.type == "cpu" for v in values)
        assert [float(v) for v in values] == [world * (world + 1) / 2] * world
