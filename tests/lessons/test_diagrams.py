"""The lessons' figures and the simulation behind lesson 2's ring: their numbers, checked apart
from the lessons that show them (whose own check cells run under nbval)."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from nbaccel.lessons import diagrams
from nbaccel.lessons.tools import ring_all_reduce_steps


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_ring_simulation_ends_with_every_sum_on_every_rank(n):
    chunks = [[10**r * (c + 1) for c in range(n)] for r in range(n)]  # rank r's chunk c
    states, sends = ring_all_reduce_steps(chunks)
    sums = [sum(chunks[r][c] for r in range(n)) for c in range(n)]
    assert states[-1] == [sums] * n
    assert len(sends) == 2 * (n - 1)  # reduce-scatter, then all-gather
    for moves in sends:  # each step, each rank sends one chunk to its right-hand neighbour
        assert sorted((src, dst) for src, dst, _ in moves) == [(r, (r + 1) % n) for r in range(n)]
    after_scatter = states[n - 1]  # rank r holds chunk (r + 1) mod N complete
    assert all(after_scatter[r][(r + 1) % n] == sums[(r + 1) % n] for r in range(n))


def test_a_ddp_step_with_overlap_ends_when_the_last_bucket_is_sent():
    compute, allreduce, k, share = 3.0, 1.2, 4, 2 / 3
    _, serial = diagrams.ddp_step_segments(compute, allreduce, k, False, share)
    _, overlapped = diagrams.ddp_step_segments(compute, allreduce, k, True, share)
    forward, backward = compute * (1 - share), compute * share
    assert serial == pytest.approx(compute + allreduce)
    assert overlapped == pytest.approx(
        forward + max(backward + allreduce / k, backward / k + allreduce)
    )
    with pytest.raises(ValueError, match="buckets >= 1"):
        diagrams.ddp_step_segments(compute, allreduce, 0, True)


def predicted(stage, psi, n, weight=2, grad=2, k=12):
    return {
        "parameters": weight * psi / (n if stage >= 3 else 1),
        "gradients": grad * psi / (n if stage >= 2 else 1),
        "optimizer": k * psi / (n if stage >= 1 else 1),
    }


def test_each_figure_draws():
    figures = [
        diagrams.ring_all_reduce(3),
        diagrams.ddp_step_timeline(0.003, 0.001, note="test durations"),
        diagrams.zero_sharding(predicted, 2),
    ]
    for fig in figures:
        assert isinstance(fig, Figure) and fig.axes
        fig.canvas.draw()  # laid out and rendered without error
