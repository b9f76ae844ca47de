"""The projection model: data-parallel scaling beyond the machine you have, in plain arithmetic.

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

A projection is a hypothesis until a measurement confirms it. ``check`` compares the projected
throughput at one measured worker count (2, on a laptop) with the measurement, against
``BOUND``, and says in a sentence why it is not believed when it is not; only a verified
projection is drawn as one without a warning (``view.figure``). ``coinciding`` names the links
whose curves would be drawn on top of each other, so that a figure draws each once.
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


# The bound on a projection's throughput error before it is believed. The calibration recorded
# in benchmarks/results/projection-cpu.md projected 2 gloo workers' DDP step 7-20% short on each
# repeat (three widths, three repeats): +9% to +25% in samples/s, since the model leaves out DDP's
# own work. 30% admits every recorded repeat with room for a shared machine's noise; an error
# past it is no longer the model's known omission but something it does not describe.
BOUND = 0.3

_ABOVE = (
    "the usual causes are costs the model leaves out: DDP's own work each step (autograd hooks, "
    "copies into buckets), data loading, logging and the live view, other programs on the cores"
)
_BELOW = (
    "the usual cause is an input measured slow, so that the run was faster than its inputs: "
    "one worker's compute, or the all-reduces, timed while the machine was loaded"
)


@dataclass(frozen=True)
class Check:
    """A projection against a measured point: is it believed on this machine?

    ``error`` is projected / measured throughput - 1: positive when the projection is faster
    than the run (the side this model errs on). ``verified`` when ``abs(error) <= bound`` and the
    measurement exists, is positive and was not flagged as spoiled; ``reason`` says why not."""

    compute_seconds: float
    gradient_bytes: float
    batch_size: int
    link: Interconnect
    overlap: bool  # as asked, or the link's own ``overlaps`` when not
    spoiled: str | None  # the caller's flag on the measurement, or None
    workers: int
    projected: float  # samples/s, all workers
    measured: float | None  # samples/s, all workers; None when not measured
    error: float | None  # projected / measured - 1; None without a positive measurement
    bound: float
    verified: bool
    reason: str | None  # None when verified

    @property
    def headline(self) -> str:
        """The verdict in a few words, for a figure's title."""
        if self.verified:
            error, bound = f"{self.error:+.0%}", f"±{self.bound:.0%}"
            return f"checked at {self.workers} workers: error {error} (bound {bound})"
        if self.measured is None:
            short = f"no measurement at {self.workers} workers"
        elif self.error is None:
            short = f"the measurement at {self.workers} workers is not a throughput"
        elif self.spoiled is not None:
            short = f"the measurement at {self.workers} workers is flagged as spoiled"
        else:
            short = (
                f"projection {self.error:+.0%} off the measurement at {self.workers} workers "
                f"(bound ±{self.bound:.0%})"
            )
        return f"NOT verified on this machine: {short}"

    def __str__(self) -> str:
        head = f"{self.workers} workers: projected {self.projected:,.0f} samples/s"
        if self.measured is None:
            head += ", not measured"
        elif self.error is None:
            head += f", measured {self.measured:,.0f}"
        else:
            head += f", measured {self.measured:,.0f} ({self.error:+.0%}, bound ±{self.bound:.0%})"
        if self.verified:
            return f"{head}: verified on this machine"
        return f"{head}: NOT verified on this machine ({self.reason})"


def check(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    link: Interconnect,
    measured: dict[int, float] | None,
    workers: int = 2,
    bound: float = BOUND,
    overlap: bool | None = None,
    spoiled: str | None = None,
) -> Check:
    """Check the projection at ``workers`` against ``measured`` (workers -> samples/s, all
    workers together), within ``bound`` of relative error. ``spoiled`` is the caller's flag on
    the measurement (e.g. the scaling lab's, when the machine was busy): the check then fails
    with it as the reason, whatever the numbers say.

    >>> link = Interconnect("loopback", 1e9, 100e-6, overlaps=False)
    >>> verdict = check(0.004, 340_008, 32, link, {1: 8_000.0, 2: 13_000.0})
    >>> verdict.verified, round(verdict.projected), f"{verdict.error:+.0%}"
    (True, 14097, '+8%')
    >>> check(0.004, 340_008, 32, link, {1: 8_000.0, 2: 4_000.0}).verified
    False
    """
    if workers < 2:
        raise ValueError(
            f"a check at {workers} worker(s) checks nothing: the projection starts from one "
            "worker's measurement; check at workers=2 or more"
        )
    if not bound > 0:
        raise ValueError(f"bound must be a positive fraction (0.3 for ±30%), got {bound!r}")
    overlap = link.overlaps if overlap is None else overlap
    p = project(compute_seconds, gradient_bytes, batch_size, link, workers, overlap)
    measured = measured or {}
    point = measured.get(workers)
    point = None if point is None else float(point)
    error = None
    if point is None:
        have = ", ".join(str(n) for n in sorted(measured)) or "none"
        reason = f"no measurement at {workers} workers to check it against, only at {have}"
    elif not point > 0 or not math.isfinite(point):
        reason = f"the measurement at {workers} workers, {point!r} samples/s, is not a throughput"
    else:
        error = p.samples_per_s / point - 1
        if spoiled is not None:
            reason = f"the measurement at {workers} workers is flagged as spoiled: {spoiled}"
        elif abs(error) <= bound:
            reason = None
        else:
            above = error > 0
            reason = (
                f"the projection is {abs(error):.0%} {'above' if above else 'below'} the "
                f"measurement, outside the ±{bound:.0%} bound; {_ABOVE if above else _BELOW}"
            )
    asked = (compute_seconds, gradient_bytes, batch_size, link, overlap, spoiled, workers)
    return Check(*asked, p.samples_per_s, point, error, bound, reason is None, reason)


def coinciding(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    links: list[Interconnect],
    counts=(1, 2, 4, 8, 16, 32, 64),
    overlap: bool = True,
    accumulation: int = 1,
    rtol: float = 0.01,
) -> list[list[Interconnect]]:
    """The links grouped by curve: two links share a group when their projected efficiencies
    agree within ``rtol`` at every count (and so do their throughputs, from the same compute),
    and groups join through a shared member. Groups and their links keep the input order.

    A figure draws one curve per group: with little to communicate, every fast link projects
    an efficiency of 1.00 and their curves would hide each other."""
    args = (compute_seconds, gradient_bytes, batch_size)
    curves = [
        [p.efficiency for p in curve(*args, link, counts, overlap, accumulation)] for link in links
    ]
    group = list(range(len(links)))  # each link's group: the index of its first member

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for j in range(len(links)):
        for i in range(j):
            agree = all(
                math.isclose(a, b, rel_tol=rtol) for a, b in zip(curves[i], curves[j], strict=True)
            )
            if agree:
                first, second = sorted((root(i), root(j)))
                group[second] = first
    groups: dict[int, list[Interconnect]] = {}
    for i, link in enumerate(links):
        groups.setdefault(root(i), []).append(link)
    return list(groups.values())
