"""The progress line: one sentence about a run, the same in a terminal and atop the panel.

    step 120/400 | 2 ranks on CPU | 1,830 samples/s | 35 ms/step | loss 0.41 | 12 s, ETA 3 s

It reads only each rank's latest records (``records.Run``), so it costs the same however long
the run is. This module imports no torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..channel import MEMORY, SAMPLES, STEPS

if TYPE_CHECKING:
    from ..records import Run


def loss_name(run: Run) -> str | None:
    """The metric to plot against step: the first with "loss" in its name, else the first."""
    names = run.names()
    return next((n for n in names if "loss" in n.lower()), names[0] if names else None)


def progress(run: Run, total_steps: int | None = None, now: float | None = None) -> str:
    """``step 120/400 | 2 ranks on CPU | 1,830 samples/s | 35 ms/step | loss 0.41 | 12 s, ETA 3 s``,
    then ``| rank 1 is the straggler (data: others waited 3.2 s)`` when one rank is waited for.

    Reads only each rank's latest records, so it costs the same however long the run is. The
    clock of a run still going reads ``now`` (default: the wall clock, as the records do).
    """
    parts = []
    name = loss_name(run)
    steps = run.latest(STEPS)
    step = int(max(steps.values())) if steps else None
    if step is None and name:  # no optimizer counted: steps done = the last step index + 1
        step = max(run.latest_step(name).values()) + 1
    if step is not None:
        parts.append(f"step {step}" + (f"/{total_steps}" if total_steps else ""))
    ranks = run.label or f"{run.world_size} rank{'s' if run.world_size > 1 else ''}"
    parts.append(f"{ranks} on {run.device}" if run.device else ranks)
    if run.latest_rate(SAMPLES):
        parts.append(f"{run.samples_per_s():,.0f} samples/s")
    step_rates = [r for r in run.latest_rate(STEPS).values() if r > 0]
    if step_rates:  # the slowest rank sets the pace of a synchronous step
        parts.append(f"{1000 / min(step_rates):,.0f} ms/step")
    if name:
        values = list(run.latest(name).values())
        parts.append(f"{name} {sum(values) / len(values):.4g}")
    memory = run.latest(MEMORY)
    if memory:
        parts.append(f"max {max(memory.values()):,.0f} MB")
    elapsed = (run.finished or (time.time() if now is None else now)) - run.started
    clock = f"{elapsed:.0f} s"
    if total_steps and step and not run.finished:
        clock += f", ETA {elapsed / step * max(total_steps - step, 0):.0f} s"
    parts.append(clock)
    note = straggler_note(run)
    if note:
        parts.append(note)
    return " | ".join(parts)


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
