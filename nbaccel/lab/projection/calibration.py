"""The micro-benchmark that checks the projection model against real workers.

``calibrate`` launches ``calibration_worker`` on 2+ processes; each times one step of a small
MLP alone, one DDP step of the same model, and all-reduces of 4 bytes and of the gradients'
size. From the two all-reduces comes this machine's link (``Interconnect.measured``), and the
``Calibration`` says how far the model's projected DDP step is from the measured one. Torch is
imported inside the worker, never by the model.
"""

from __future__ import annotations

from .model import Calibration, Interconnect


def calibration_worker(hidden: int = 1024, layers: int = 4, batch_size: int = 32, rounds: int = 15):
    """Run in each of 2+ launched workers (``notebook_launcher``): time, in interleaved rounds,
    one step of the model alone (the compute), one DDP step, and all-reduces of 4 bytes and of
    the gradients' size, on the accelerator's device. Returns medians in seconds, the gradient
    bytes and the batch size (rank 0's; every rank measures the same things at once)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ...accelerator.accelerator import Accelerator

    accelerator = Accelerator(live=False)
    device = accelerator.device

    def build():
        torch.manual_seed(0)
        blocks = [torch.nn.Linear(hidden, hidden) for _ in range(layers)]
        return torch.nn.Sequential(*[m for b in blocks for m in (b, torch.nn.ReLU())])

    plain, wrapped = build().to(device), build()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    wrapped, wrapped_opt = accelerator.prepare(
        wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    )
    x = torch.randn(batch_size, hidden, device=device)
    y = torch.randint(0, hidden, (batch_size,), device=device)
    nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    tiny, big = torch.zeros(1, device=device), torch.zeros(nbytes // 4, device=device)

    def plain_step():
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def ddp_step():
        accelerator.backward(F.cross_entropy(wrapped(x), y))
        wrapped_opt.step()
        wrapped_opt.zero_grad()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    timed = {"compute": plain_step, "ddp": ddp_step}
    timed["allreduce_small"] = lambda: dist.all_reduce(tiny)
    timed["allreduce_large"] = lambda: dist.all_reduce(big)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for round_ in range(rounds + 2):  # the first two rounds warm up
        for name, fn in timed.items():
            sync()
            dist.barrier()  # every rank starts each measurement together
            start = time.perf_counter()
            fn()
            sync()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update(gradient_bytes=nbytes, batch_size=batch_size, workers=accelerator.num_processes)
    accelerator.end_training()
    return result


def calibrate(hidden: int = 1024, num_processes: int = 2, cpu: bool = True, timeout: float = 600):
    """Launch ``calibration_worker`` and measure the link from its two all-reduces."""
    from ...launch.launcher import notebook_launcher

    r = notebook_launcher(
        calibration_worker,
        kwargs=dict(hidden=hidden),
        num_processes=num_processes,
        cpu=cpu,
        live=False,
        timeout=timeout,
    )
    link = Interconnect.measured(
        r["allreduce_small"], r["allreduce_large"], r["gradient_bytes"], r["workers"]
    )
    return Calibration(**r, link=link)
