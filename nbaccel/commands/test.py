"""``nbaccel test``: two workers, one all-reduce, one DDP step; is this machine ready?

Runs through ``notebook_launcher`` exactly as a notebook would: on 2 GPUs with NCCL where there
are two, else on 2 CPU processes with gloo. After the DDP step both ranks must hold the same
weights even though each saw a different batch: that is what DDP's gradient all-reduce is for.
"""

from __future__ import annotations

import argparse
import time
from itertools import pairwise

from ..env import visible_gpus
from ..errors import NbaccelError


def test_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "test",
        help="check that 2 workers can start, all-reduce and train one DDP step",
        description="Start 2 workers with notebook_launcher (GPUs if there are 2, else the "
        "CPU), all-reduce a tensor and take one DDP step; print OK or FAILED.",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before the check gives up"
    )
    parser.set_defaults(func=test_command)
    return parser


def test_command(args: argparse.Namespace) -> int:
    from .. import notebook_launcher

    cpu = visible_gpus() < 2
    where = "2 CPU processes (gloo)" if cpu else "2 GPUs (NCCL)"
    start = time.perf_counter()
    try:
        timings = notebook_launcher(
            check_one_step,
            num_processes=2,
            mixed_precision="no",
            cpu=cpu,
            start_method="spawn",
            timeout=args.timeout,
        )
    except (NbaccelError, ValueError) as err:  # LaunchError, or an invalid config file
        print(f"FAILED: {where}: {err}")
        return 1
    total = time.perf_counter() - start
    steps = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in timings.items())
    print(f"OK: {where} agree after an all-reduce and a DDP step ({steps}; total {total:.1f} s)")
    return 0


def check_one_step() -> dict[str, float]:
    """Runs on each worker; raises if the ranks disagree. Returns what each part took."""
    import torch

    from .. import Accelerator, set_seed

    clock = [time.perf_counter()]
    accelerator = Accelerator()
    clock.append(time.perf_counter())

    total = accelerator.reduce(torch.tensor([accelerator.rank + 1.0], device=accelerator.device))
    check_sum(total.item(), accelerator.num_processes)
    clock.append(time.perf_counter())

    set_seed(0)
    model = torch.nn.Linear(4, 1)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    clock.append(time.perf_counter())  # the first DDP wrap imports torch._dynamo: seconds
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(accelerator.rank))
    accelerator.backward(model(batch.to(accelerator.device)).pow(2).mean())
    optimizer.step()
    after = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    check_weights(accelerator.gather(after[None]).cpu(), before)  # one row per rank
    clock.append(time.perf_counter())
    accelerator.end_training()
    names = ("join", "all-reduce", "DDP wrap", "DDP step")
    return {name: b - a for name, (a, b) in zip(names, pairwise(clock), strict=True)}


def check_sum(total: float, world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    if total != expected:
        raise NbaccelError(f"the all-reduce of rank+1 gave {total}, expected {expected}")


def check_weights(every_rank, before) -> None:
    """``every_rank``: one row of weights per rank after the step; ``before``: rank 0's start."""
    gap = (every_rank - every_rank[0]).abs().max().item()
    if gap > 1e-6:
        raise NbaccelError(f"after one DDP step the ranks' weights differ by up to {gap:.2e}")
    if (every_rank[0] == before).all():
        raise NbaccelError("the optimizer step did not change the weights")
