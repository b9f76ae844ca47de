"""The progress line: one sentence about a run, the same in a terminal and atop the panel.

    step 120/400 | 2 ranks on CPU | 1,830 samples/s (last 3 s) | 35 ms/step | loss 0.41 |
    CPU RSS max 1,210 MiB | 12 s

It reads only each rank's latest records (``records.Run``), so it costs the same however long
the run is. This module imports no torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..channel import ACCUMULATION, MEMORY, MIN_WINDOW_S, RSS, SAMPLES, STEPS

if TYPE_CHECKING:
    from ..records import Run


def loss_name(run: Run) -> str | None:
    """The metric to plot against step: the first with "loss" in its name, else the first."""
    names = run.names()
    return next((n for n in names if "loss" in n.lower()), names[0] if names else None)


def steps(run: Run) -> tuple[int | None, str, int | None]:
    """``(count, unit, optimizer_steps)``: how far the run got, counted as the loss axis counts.

    The loss axis has one point per ``log`` call (its ``step``), so the line counts the same:
    the last logged step + 1. ``unit`` says what those are: ``"optimizer steps"`` when the run's
    optimizer-step counter keeps pace with them, ``"micro-batches"`` when it falls behind by
    half or more (gradient accumulation: several logs per optimizer step), ``"log calls"``
    when no optimizer was counted. ``optimizer_steps`` is that counter (None without one).
    Without a logged metric, the counter itself is the count."""
    counted = run.latest(STEPS)
    optimizer = int(max(counted.values())) if counted else None
    name = loss_name(run)
    if name is None:
        return optimizer, "optimizer steps", optimizer
    count = max(run.latest_step(name).values()) + 1
    if optimizer is None:
        return count, "log calls", None
    unit = "micro-batches" if count >= 1.5 * optimizer else "optimizer steps"
    return count, unit, optimizer


def progress(run: Run, total_steps: int | None = None, now: float | None = None) -> str:
    """``step 120/400 | 2 ranks on CPU | 1,830 samples/s (last 3 s) | 35 ms/step | loss 0.41 |
    CPU RSS max 1,210 MiB | 12 s, ETA 3 s`` (the memory: ``memory_parts``), then ``| rank 1 is
    the straggler (data: others waited 3.2 s)`` when one rank is waited for.

    While the run goes, the rate is every rank's samples over its last ``RATE_WINDOW_S``
    seconds (``Run.live_samples_per_s``), said with the seconds it spans (``Run.live_span``:
    longer after a pause that counted nothing); once it ended, the run's throughput over its
    training window (``Run.throughput``, the scaling table's number), said as such: neither
    from a span too short (``MIN_RATE_SPAN_S``, ``MIN_WINDOW_S``). The total counts what the
    step counts: the batches a loop will take, or, when the steps are optimizer steps under
    accumulation, those batches over the accumulation. The step counts what the loss axis
    counts, and says what that is under accumulation. Reads only each rank's latest records,
    so it costs the same however long the run is. The clock of a run still going reads ``now``
    (default: the wall clock, as the records do).
    """
    parts = []
    count, unit, optimizer = steps(run)
    accumulation = run.latest(ACCUMULATION)
    if total_steps and accumulation and unit == "optimizer steps":
        total_steps = -(-total_steps // int(max(accumulation.values())))
    if count is not None:
        text = f"step {count}" + (f"/{total_steps}" if total_steps else "")
        if unit == "micro-batches":
            text += f" (micro-batches; {optimizer} optimizer steps)"
        if run.failures:
            text += " (the last that arrived)"
        parts.append(text)
    ranks = run.label or f"{run.world_size} rank{'s' if run.world_size > 1 else ''}"
    parts.append(f"{ranks} on {run.device}" if run.device else ranks)
    rate = _rate(run)
    if rate:
        parts.append(rate)
    ms = _ms_per_step(run, optimizer)
    if ms:
        parts.append(f"{ms:,.0f} ms/step")
    name = loss_name(run)
    if name:
        values = list(run.latest(name).values())
        parts.append(f"{name} {sum(values) / len(values):.4g}")
    parts += memory_parts(run)
    elapsed = (run.finished or (time.time() if now is None else now)) - run.started
    clock = f"{elapsed:.0f} s"
    if total_steps and count and not run.finished:
        clock += f", ETA {elapsed / count * max(total_steps - count, 0):.0f} s"
    parts.append(clock)
    note = straggler_note(run)
    if note:
        parts.append(note)
    return " | ".join(parts)


def memory_parts(run: Run) -> list[str]:
    """``GPU peak 1,234 MiB`` (the CUDA allocator's peak, ``channel.MEMORY``) and ``CPU RSS
    2,345 MiB`` (the latest resident set size, ``channel.RSS``): the largest rank's of each,
    "max" said when there are several ranks. MiB (2**20 bytes) here as on the panel."""
    parts = []
    for name, label in ((MEMORY, "GPU peak"), (RSS, "CPU RSS")):
        values = run.latest(name)
        if values:
            most = " max" if len(values) > 1 and name == RSS else ""
            parts.append(f"{label}{most} {max(values.values()):,.0f} MiB")
    return parts


def _rate(run: Run) -> str | None:
    """The samples rate, said with the span it covers; None before any sample was counted."""
    if not run.latest(SAMPLES):
        return None
    if run.finished:
        timing = run.timing()
        rate = run.throughput()
        if rate is None:  # too short a window to divide by
            samples = sum(timing.samples.values())
            return f"{samples:,.0f} samples in {timing.training:.2f} s (too short for a rate)"
        return f"{rate:,.0f} samples/s (training window {timing.training:.1f} s)"
    rate, span = run.live_samples_per_s(), run.live_span()
    return None if rate is None else f"{rate:,.0f} samples/s (last {span:.0f} s)"


def _ms_per_step(run: Run, optimizer: int | None) -> float | None:
    """Milliseconds per optimizer step: the training window over the steps once the run ended,
    else the slowest rank's over the live window (it sets the pace of a synchronous step)."""
    if run.finished:
        training = run.timing().training
        return 1000 * training / optimizer if optimizer and training >= MIN_WINDOW_S else None
    rates = [r for r in run.live_rate(STEPS).values() if r > 0]
    return 1000 / min(rates) if rates else None


def timing_line(run: Run) -> str | None:
    """``training window 4.12 s: 15,000 samples, 3,641 samples/s | start-up 2.10 s | finish
    0.31 s``: the run's own measurement (``Run.timing``), printed under the final progress
    line. None when no samples were counted."""
    timing = run.timing()
    if not timing.samples:
        return None
    samples = sum(timing.samples.values())
    rate = run.throughput()
    speed = f"{rate:,.0f} samples/s" if rate is not None else "too short for a rate"
    return (
        f"training window {timing.training:.2f} s: {samples:,.0f} samples, {speed} | "
        f"start-up {timing.startup:.2f} s | finish {timing.finish:.2f} s"
    )


def straggler_note(run: Run) -> str | None:
    """``rank 1 is the straggler (data: others waited 3.2 s)``, or None when no rank stands
    out: the progress line's last part."""
    straggler = run.straggler()
    if straggler is None:
        return None
    return (
        f"rank {straggler.rank} is the straggler "
        f"({straggler.cause}: others waited {straggler.waited:.1f} s)"
    )
