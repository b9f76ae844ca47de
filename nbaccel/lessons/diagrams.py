"""Figures the lessons draw by code rather than in ASCII: each function returns a matplotlib
Figure that a lesson cell shows, so a learner can read how the picture is made and a change of
numbers redraws it. English labels only (matplotlib cannot shape Arabic text).
"""

from __future__ import annotations


def ddp_step_segments(
    compute: float, allreduce: float, buckets: int, overlap: bool, backward_share: float = 2 / 3
) -> tuple[list[tuple[str, str, int, float, float]], float]:
    """One DDP step as ``(lane, what, bucket, start, length)`` segments, and when it ends.

    ``compute`` is a step's forward and backward (backward taking ``backward_share``),
    ``allreduce`` the all-reduce of all gradients; both are split into ``buckets`` equal
    buckets. Backward finishes the buckets one after another (the last layers' first); without
    overlap every all-reduce waits for the whole backward pass, with overlap bucket k's starts
    once its gradients are ready and the previous bucket's all-reduce is done."""
    if compute <= 0 or allreduce < 0 or buckets < 1 or not 0 < backward_share <= 1:
        raise ValueError("compute > 0, allreduce >= 0, buckets >= 1, 0 < backward_share <= 1")
    backward = backward_share * compute
    forward, chunk, send = compute - backward, backward / buckets, allreduce / buckets
    segments = [("compute", "forward", -1, 0.0, forward)]
    busy = 0.0  # when the link is free again
    for k in range(buckets):
        ready = forward + (k + 1) * chunk
        segments.append(("compute", "backward", k, ready - chunk, chunk))
    for k in range(buckets):
        ready = forward + (k + 1) * chunk if overlap else compute
        start = max(ready, busy)
        segments.append(("all-reduce", "all-reduce", k, start, send))
        busy = start + send
    return segments, max(compute, busy)


def ddp_step_timeline(
    compute: float, allreduce: float, buckets: int = 4, backward_share: float = 2 / 3, note=""
):
    """Two timelines of one DDP step, without and with overlap: backward computing gradient
    buckets while the buckets already computed are all-reduced. Seconds in, milliseconds drawn;
    ``note`` says where the durations come from (measured, or illustrative)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), dpi=80, layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    colors = [f"C{k % 10}" for k in range(buckets)]
    lanes = {"compute": 1, "all-reduce": 0}
    for ax, overlap in zip(axes, (False, True), strict=True):
        segments, end = ddp_step_segments(compute, allreduce, buckets, overlap, backward_share)
        for lane, what, k, start, length in segments:
            color = "lightgray" if k < 0 else colors[k]
            ax.broken_barh(
                [(start * 1e3, length * 1e3)], (lanes[lane] - 0.35, 0.7), color=color, ec="k"
            )
            if k < 0 or (k == 0 and what == "backward"):
                ax.text((start + length / 2) * 1e3, lanes[lane], what, ha="center", va="center")
        ax.axvline(end * 1e3, color="k", ls="--")
        ax.set_yticks([0, 1], ["all-reduce", "compute"])
        way = (
            "overlap: bucket k is sent while backward computes the next"
            if overlap
            else ("no overlap: all-reduce after the whole backward pass")
        )
        ax.set_title(f"{way}; step {end * 1e3:.2f} ms", fontsize=10, loc="left")
    axes[-1].set_xlabel(f"milliseconds ({buckets} gradient buckets; colour = bucket)")
    fig.suptitle(note or "illustrative durations", fontsize=9)
    return fig


# lesson 6's colours for the three parts of the model state, and the four ways to keep them
ZERO_PARTS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green"}
ZERO_ROWS = {
    0: "DDP: all replicated",
    1: "ZeRO 1: optimizer state sharded",
    2: "ZeRO 2: + gradients sharded",
    3: "ZeRO 3 / FSDP: + parameters sharded",
}


def zero_sharding(predicted, n: int, **bytes_per_param):
    """What each of ``n`` ranks keeps of the model state under DDP and ZeRO stages 1-3.

    ``predicted(stage, psi, n, **bytes_per_param)`` is the lesson's own formula (lesson 6): it
    returns each part's bytes on one rank. The figure calls it with ``psi=1``, so every length is
    in bytes per parameter. Each rank gets one row per stage: its parameters, gradients and
    optimizer state laid end to end at their whole, unsharded length; the filled part is what
    this rank keeps. A part kept whole is filled all along (replicated on every rank); a part
    sharded into ``n`` pieces is filled only on this rank's piece, and the rest of its length,
    hatched, lives on the other ranks. The number at the right of each row is the rank's total;
    each stage's title gives its formula, N being the number of ranks.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    whole = predicted(0, 1, n, **bytes_per_param)
    length = sum(whole.values())
    fig = Figure(figsize=(9, 0.9 + 0.32 * 4 * (n + 1)), dpi=80)
    ax = fig.subplots()
    y, ticks, names = 0.0, [], []
    for stage in range(4):
        held = predicted(stage, 1, n, **bytes_per_param)
        for rank in range(n):
            start = 0.0
            for part, color in ZERO_PARTS.items():
                size, kept = whole[part], held[part]
                ax.barh(
                    y,
                    size,
                    left=start,
                    height=0.8,
                    color="white",
                    edgecolor=color,
                    hatch="///",
                    lw=0.8,
                )
                if kept >= size:  # replicated: this rank holds all of it
                    ax.barh(y, size, left=start, height=0.8, color=color, edgecolor="black", lw=0.5)
                else:  # sharded: this rank holds piece number `rank` of n
                    ax.barh(
                        y,
                        kept,
                        left=start + rank * kept,
                        height=0.8,
                        color=color,
                        edgecolor="black",
                        lw=0.5,
                    )
                start += size
            ax.text(length * 1.01, y, f"{sum(held.values()):.4g}", va="center", fontsize=8)
            ticks.append(y)
            names.append(f"rank {rank}")
            y += 1
        formula = " + ".join(
            f"{whole[p]:g}Ψ" + ("" if held[p] >= whole[p] else "/N") for p in ZERO_PARTS
        )
        ax.text(
            -0.01 * length,
            y - n - 0.75,
            f"{ZERO_ROWS[stage]}: {formula}",
            ha="left",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
        y += 1.0  # a gap, and room for the next stage's title
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, length * 1.08)
    ax.set_xlabel(
        "bytes per parameter: the whole model state laid end to end; "
        "number at the right = this rank's total"
    )
    parts = [Patch(color=c, label=p) for p, c in ZERO_PARTS.items()]
    parts.append(Patch(facecolor="white", edgecolor="gray", hatch="///", label="on another rank"))
    fig.legend(handles=parts, loc="lower center", ncol=4, fontsize=8, frameon=False)
    ax.set_title(f"What each of {n} ranks keeps (filled) of the model state", pad=14)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def ring_all_reduce(ranks: int = 4):
    """The ring all-reduce of lesson 2, one panel per step: ``ranks`` ranks on a ring, each
    holding its N chunks (a, b, c, ...; the digits say whose values a chunk holds so far), the
    chunk each rank sends to its right-hand neighbour during the step, and the bytes per rank."""
    import math

    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from .tools import ring_all_reduce_steps

    n = ranks
    states, sends = ring_all_reduce_steps(
        [[frozenset({r}) for _ in range(n)] for r in range(n)], add=frozenset.union
    )
    titles = ["start: every rank holds its own values"]
    titles += [f"reduce-scatter step {s}: add what arrives" for s in range(n - 1)]
    titles += [f"all-gather step {s}: copy what arrives" for s in range(n - 1)]
    columns = math.ceil(len(states) / 2)
    fig = Figure(figsize=(4.2 * columns, 8.2), dpi=90, layout="constrained")
    axes = fig.subplots(2, columns)
    axes = list(axes.flat)
    radius, box, height = 1.45, 0.52, 0.42
    where = [
        (radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n))
        for r in range(n)
    ]
    for k, (state, title) in enumerate(zip(states, titles, strict=True)):
        ax = axes[k]
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-1.05 * radius - n * box / 2, 1.05 * radius + n * box / 2)
        ax.set_ylim(-radius - 0.6, radius + 0.6)
        ax.set_aspect("equal")
        ax.axis("off")
        arriving = {dst: c for _, dst, c in sends[k - 1]} if k else {}
        for r, (x, y) in enumerate(where):
            left = x - n * box / 2
            ax.text(x, y + height * 0.8, f"rank {r}", ha="center", fontsize=10)
            for c, owners in enumerate(state[r]):
                share = len(owners) / n
                colour = "tab:green" if share == 1 else colormaps["Blues"](0.15 + 0.6 * share)
                edge = 2.2 if arriving.get(r) == c else 0.6
                ax.add_patch(
                    Rectangle(
                        (left + c * box, y - height / 2),
                        box,
                        height,
                        facecolor=colour,
                        edgecolor="black",
                        linewidth=edge,
                    )
                )
                label = f"${chr(ord('a') + c)}_{{{''.join(str(o) for o in sorted(owners))}}}$"
                ax.text(
                    left + (c + 0.5) * box,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=11 if n > 3 else 12,
                )
        for src, dst, c in sends[k - 1] if k else []:
            arrow = FancyArrowPatch(
                where[src],
                where[dst],
                connectionstyle="arc3,rad=-0.3",
                arrowstyle="-|>",
                mutation_scale=10,
                shrinkA=26,
                shrinkB=26,
                color="tab:orange",
            )
            ax.add_patch(arrow)
            mx, my = (where[src][0] + where[dst][0]) / 2, (where[src][1] + where[dst][1]) / 2
            ax.text(
                1.45 * mx,
                1.45 * my,
                chr(ord("a") + c),
                color="tab:orange",
                ha="center",
                va="center",
                fontsize=11,
                fontweight="bold",
            )
    for ax in axes[len(states) :]:
        ax.axis("off")
    last = axes[-1]
    last.text(
        0.02,
        0.5,
        f"{n} ranks, a tensor of S bytes in {n} chunks of S/{n}:\n"
        f"each step, every rank sends one chunk\n"
        f"(orange) and receives one (bold box).\n\n"
        f"{2 * (n - 1)} steps x S/{n} = {2 * (n - 1)}/{n} x S\n"
        f"sent per rank: 2(N-1)/N x S.\n\n"
        "green: the complete sum",
        fontsize=11,
        va="center",
        transform=last.transAxes,
    )
    fig.suptitle(f"Ring all-reduce on {n} ranks", fontsize=11)
    return fig
