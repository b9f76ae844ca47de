"""Project data-parallel scaling beyond the machine you have: an explicit, small model.

One optimizer step of DDP on ``N`` workers costs the compute of one worker (measured on one
process) plus a ring all-reduce of the gradients::

    allreduce(N) = 2 (N - 1) / N * bytes / bandwidth  +  2 (N - 1) * latency

``bandwidth`` is one link's bandwidth in one direction, ``latency`` the fixed cost of one of
the ring's ``2 (N - 1)`` steps. Without overlap the all-reduce follows the backward pass; with
DDP's buckets it runs during the backward pass, so only what outlasts the backward pass is
added (the backward pass is taken as 2/3 of the compute: twice the forward's work). That
needs the all-reduce to run beside the backward pass, as NCCL does on its own CUDA stream; gloo
on a CPU whose cores the backward pass already uses gains nothing from it (crediting overlap
projected a step of 2 CPU workers 30-44% shorter than measured;
``benchmarks/results/projection-cpu.md``), so a link measured there is made with
``overlaps=False``. With gradient accumulation over ``K`` micro-batches, one all-reduce serves
``K`` micro-batches.

Presets give each interconnect's bandwidth from its published specification, per direction:

* PCIe 4.0 x16: 16 GT/s per lane, 128b/130b coding: 31.5 GB/s (PCI-SIG, PCI Express Base
  Specification 4.0; NVIDIA's A100 PCIe datasheet lists "PCIe Gen4: 64 GB/s" both ways).
* PCIe 5.0 x16: 63 GB/s (PCI Express Base Specification 5.0; H100 PCIe datasheet: 128 GB/s
  both ways).
* NVLink 3 (A100 SXM): 600 GB/s per GPU both ways, 300 GB/s each way (NVIDIA A100 datasheet).
* NVLink 4 (H100 SXM): 900 GB/s per GPU both ways, 450 GB/s each way (NVIDIA H100 datasheet).
* 100 Gb Ethernet: 100 Gb/s = 12.5 GB/s each way (IEEE 802.3).
* InfiniBand NDR: 400 Gb/s per port = 50 GB/s each way (NVIDIA ConnectX-7 / Quantum-2).

Latencies are orders of magnitude for one step of a library's ring all-reduce, software
included (NCCL's small-message latency inside an NVLink node is about 5-10 us end to end; a
switch hop of NDR InfiniBand about 1 us, Ethernet with TCP tens of us), not datasheet figures:
they matter only for small gradients and many workers. "This machine's loopback" is measured,
never a preset (``Interconnect.measured`` from two all-reduces, ``Interconnect.fit`` from
several).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward pass does twice the forward's work


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # s per ring step
    source: str = ""
    overlaps: bool = True  # can the all-reduce run during backward? (not gloo on a busy CPU)

    def allreduce_seconds(self, nbytes: float, workers: int) -> float:
        """A ring all-reduce of ``nbytes`` on each of ``workers`` processes."""
        if workers <= 1:
            return 0.0
        n = workers
        return 2 * (n - 1) / n * nbytes / self.bandwidth + 2 * (n - 1) * self.latency

    @classmethod
    def measured(
        cls,
        small_seconds: float,
        large_seconds: float,
        large_bytes: float,
        workers: int = 2,
        name: str = "this machine's loopback (measured)",
        overlaps: bool = True,
    ) -> Interconnect:
        """This machine's link, from two timed all-reduces on ``workers`` processes: a tiny
        one (its time is the latency term alone) and a large one (the rest is bandwidth)."""
        if workers < 2:
            raise ValueError("an all-reduce needs at least 2 workers to measure a link")
        steps = 2 * (workers - 1)
        latency = small_seconds / steps
        moving = large_seconds - small_seconds
        if moving <= 0:
            raise ValueError(
                f"the large all-reduce ({large_seconds:.2e} s) was not slower than the tiny one "
                f"({small_seconds:.2e} s): use more bytes"
            )
        bandwidth = (workers - 1) / workers * 2 * large_bytes / moving
        return cls(name, bandwidth, latency, "measured", overlaps)

    @classmethod
    def fit(
        cls,
        sizes: list[float],
        seconds: list[float],
        workers: int = 2,
        name: str = "this machine's loopback (measured)",
        overlaps: bool = True,
    ) -> Interconnect:
        """This machine's link, fitted to all-reduces of several sizes (bytes) on ``workers``
        processes: latency and bandwidth minimising the squared *relative* error, so that a
        0.1 MB call counts as much as a 20 MB one. Use it when sizes span decades: a 4-byte
        call can be far cheaper than any real gradient's (gloo's small messages, a busy
        scheduler), which ``measured`` would take for the latency."""
        if workers < 2 or len(sizes) < 2 or len(set(sizes)) < 2 or len(sizes) != len(seconds):
            raise ValueError("fit a link to all-reduces of at least 2 sizes on 2+ workers")
        steps, share = 2 * (workers - 1), 2 * (workers - 1) / workers
        # seconds = steps * latency + share * bytes / bandwidth = a * u + b * v, each term / t
        u = [steps / t for t in seconds]
        v = [share * n / t for n, t in zip(sizes, seconds, strict=True)]
        uu, vv, uv = (
            sum(x * x for x in u),
            sum(x * x for x in v),
            sum(x * y for x, y in zip(u, v, strict=True)),
        )
        a = (sum(u) * vv - sum(v) * uv) / (uu * vv - uv * uv)
        if a < 0:  # the data say no fixed cost: fit the bandwidth alone
            a = 0.0
        b = (sum(v) - a * uv) / vv
        if b <= 0:
            raise ValueError("the larger all-reduces were not slower: no bandwidth to fit")
        return cls(name, 1 / b, a, "measured", overlaps)


GB = 1e9
PRESETS = {
    p.name: p
    for p in (
        Interconnect("PCIe 4.0 x16", 31.5 * GB, 10e-6, "PCI-SIG PCIe 4.0; A100 PCIe datasheet"),
        Interconnect("PCIe 5.0 x16", 63 * GB, 10e-6, "PCI-SIG PCIe 5.0; H100 PCIe datasheet"),
        Interconnect("NVLink 3 (A100)", 300 * GB, 5e-6, "NVIDIA A100 datasheet"),
        Interconnect("NVLink 4 (H100)", 450 * GB, 5e-6, "NVIDIA H100 datasheet"),
        Interconnect("100 Gb Ethernet", 12.5 * GB, 30e-6, "IEEE 802.3"),
        Interconnect("InfiniBand NDR", 50 * GB, 5e-6, "NVIDIA ConnectX-7 / Quantum-2"),
    )
}


@dataclass(frozen=True)
class Projection:
    workers: int
    step_seconds: float  # one optimizer step: K micro-batches and one all-reduce
    samples_per_s: float  # all workers together
    efficiency: float  # samples_per_s / (workers * one worker's samples_per_s)
    allreduce_seconds: float


def project(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    link: Interconnect,
    workers: int,
    overlap: bool = True,
    accumulation: int = 1,
) -> Projection:
    """Step time, throughput and efficiency of ``workers`` data-parallel processes, each
    spending ``compute_seconds`` on one micro-batch of ``batch_size`` samples (forward, backward
    and optimizer step, measured on one process) and all-reducing ``gradient_bytes`` once per
    ``accumulation`` micro-batches."""
    if compute_seconds <= 0 or batch_size <= 0 or workers < 1 or accumulation < 1:
        raise ValueError("compute_seconds, batch_size, workers and accumulation must be positive")
    comm = link.allreduce_seconds(gradient_bytes, workers)
    hidden = BACKWARD_SHARE * compute_seconds if overlap and link.overlaps else 0.0
    exposed = max(0.0, comm - hidden)
    step = accumulation * compute_seconds + exposed  # only the last micro-batch overlaps
    samples = workers * accumulation * batch_size / step
    alone = batch_size / compute_seconds
    return Projection(workers, step, samples, samples / (workers * alone), comm)


def curve(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    link: Interconnect,
    counts=(1, 2, 4, 8, 16, 32, 64),
    overlap: bool = True,
    accumulation: int = 1,
) -> list[Projection]:
    return [
        project(compute_seconds, gradient_bytes, batch_size, link, n, overlap, accumulation)
        for n in counts
    ]


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

    from .accelerator import Accelerator

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


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured (seconds, medians) and the link it measured from it."""

    compute: float  # one step of the model alone, every worker computing at once
    ddp: float  # one DDP step: the thing the projection must predict
    allreduce_small: float  # 4 bytes
    allreduce_large: float  # the gradients' size
    gradient_bytes: int
    batch_size: int
    workers: int
    link: Interconnect

    def projected(self, overlap: bool) -> Projection:
        return project(
            self.compute, self.gradient_bytes, self.batch_size, self.link, self.workers, overlap
        )

    def error(self, overlap: bool) -> float:
        """Projected over measured step time, minus 1: negative when the model is too fast."""
        return self.projected(overlap).step_seconds / self.ddp - 1

    def __str__(self) -> str:
        ms = 1e3
        return (
            f"{self.workers} workers, {self.gradient_bytes / 1e6:.1f} MB of gradients: compute "
            f"{self.compute * ms:.1f} ms, all-reduce {self.allreduce_large * ms:.1f} ms "
            f"({self.link.bandwidth / 1e9:.2f} GB/s, {self.link.latency * 1e6:.0f} us a ring step)"
            f"; DDP step measured {self.ddp * ms:.1f} ms, projected "
            f"{self.projected(False).step_seconds * ms:.1f} ms ({self.error(False):+.0%}) "
            f"without overlap, {self.projected(True).step_seconds * ms:.1f} ms "
            f"({self.error(True):+.0%}) with it"
        )


def calibrate(hidden: int = 1024, num_processes: int = 2, cpu: bool = True, timeout: float = 600):
    """Launch ``calibration_worker`` and measure the link from its two all-reduces."""
    from .launcher import notebook_launcher

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


def figure(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    links: list[Interconnect],
    measured: dict[int, float] | None = None,
    counts=(1, 2, 4, 8, 16, 32, 64),
    overlap: bool = True,
    accumulation: int = 1,
    title: str = "",
):
    """Throughput and efficiency against workers: one dashed curve per link, each labelled as a
    projection; ``measured`` (workers -> samples/s, all workers together) drawn as points."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), dpi=80)
    speed_ax, eff_ax = fig.subplots(1, 2)
    args = (compute_seconds, gradient_bytes, batch_size)
    for link in links:
        points = curve(*args, link, counts, overlap, accumulation)
        label = f"projection: {link.name}"
        speed_ax.plot(counts, [p.samples_per_s for p in points], "--", label=label)
        eff_ax.plot(counts, [p.efficiency for p in points], "--", label=label)
    if measured:
        alone = batch_size / compute_seconds  # the projection's one worker, for the efficiency
        xs = sorted(measured)
        speed_ax.plot(xs, [measured[n] for n in xs], "ko", label="measured here")
        eff_ax.plot(xs, [measured[n] / (n * alone) for n in xs], "ko", label="measured here")
    for ax in (speed_ax, eff_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("workers")
    speed_ax.set_yscale("log")
    speed_ax.set(ylabel="samples/s, all workers", title="throughput")
    eff_ax.set(ylabel="scaling efficiency", title="efficiency", ylim=(0, 1.1))
    # one legend, right of both panels: inside, it hid measured points
    fig.legend(*eff_ax.get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle(title or f"projections (dashed) unless marked measured; {_step(*args)}", size=9)
    fig.subplots_adjust(left=0.07, right=0.69, bottom=0.15, top=0.84, wspace=0.3)
    return fig


def _step(compute_seconds: float, gradient_bytes: float, batch_size: int) -> str:
    return (
        f"one worker: {compute_seconds * 1e3:.3g} ms a step of {batch_size} samples, "
        f"{gradient_bytes / 1e6:.3g} MB of gradients"
    )


def whatif(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    measured: dict[int, float] | None = None,
    loopback: Interconnect | None = None,
):
    """An interactive panel (ipywidgets): interconnect, model size, compute speed, accumulation
    steps, overlap and the largest worker count redraw the projection over the measured points.

    Model size multiplies the compute and the gradient bytes alike (an MLP's both grow with
    its parameters); "compute faster" divides the compute alone (a GPU's step against this
    machine's, say). Measured points belong to the model as measured: they are drawn at size
    x1 and speed x1 only. Without ipywidgets, or outside a notebook, it shows the static
    figure for every link and returns ``None``."""
    from IPython.display import Image, display

    from .display import to_png
    from .env import in_notebook

    links = {**({loopback.name: loopback} if loopback else {}), **PRESETS}

    def show(fig) -> None:
        display(Image(to_png(fig)))

    try:
        import ipywidgets as w
    except ImportError:
        w = None
    if w is None or not in_notebook():
        show(figure(compute_seconds, gradient_bytes, batch_size, list(links.values()), measured))
        return None

    def redraw(link, size, faster, accumulation, overlap, most):
        counts = tuple(2**i for i in range(int(math.log2(most)) + 1))
        chosen = [links[link]] + ([loopback] if loopback and link != loopback.name else [])
        as_measured = size == 1 and faster == 1
        fig = figure(
            compute_seconds * size / faster,
            gradient_bytes * size,
            batch_size,
            chosen,
            measured if as_measured else None,
            counts,
            overlap,
            accumulation,
        )
        show(fig)

    slider = dict(continuous_update=False, style={"description_width": "10em"})
    return w.interactive(
        redraw,
        link=w.Dropdown(options=list(links), description="interconnect", style=slider["style"]),
        size=w.FloatLogSlider(
            value=1, base=10, min=-1, max=3, description="model size x", **slider
        ),
        faster=w.FloatLogSlider(
            value=1, base=10, min=0, max=3, description="compute faster x", **slider
        ),
        accumulation=w.IntSlider(value=1, min=1, max=64, description="accumulation", **slider),
        overlap=w.Checkbox(value=True, description="overlap (DDP buckets)"),
        most=w.SelectionSlider(
            options=[2, 4, 8, 16, 32, 64], value=64, description="workers up to", **slider
        ),
    )
