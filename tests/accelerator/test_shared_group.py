"""Two Accelerators in one worker share the process group: ending one leaves the other's
collectives right, and a collective whose group is gone raises instead of returning this rank's
value alone (state.py's ``_holders``). Two CPU ranks on gloo.

Each scenario runs on both ranks and returns what it saw, so the verdict is in the values and
the error messages, never in timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nbaccel import Accelerator, NbaccelError, PartialState

from ..distributed import move_the_meeting, run_ranks

pytestmark = pytest.mark.multiprocess


def collected(state: PartialState) -> tuple[float, list[float], bool]:
    """``state``'s sum of ones, gather of ranks and trigger, across both ranks."""
    total = state.reduce(torch.ones(1), "sum").item()
    ranks = state.gather(torch.tensor([float(state.rank)])).tolist()
    state.wait_for_everyone()
    return total, ranks, state.check_trigger()


def raised(call) -> str:
    try:
        call()
    except NbaccelError as err:
        return str(err)
    return "no error"


def two_accelerators() -> dict:
    seen = {}
    # The second ends first, then the first (which created the group).
    first, second = Accelerator(live=False), Accelerator(live=False)
    model = second.prepare(torch.nn.Linear(2, 1))  # DDP
    second.backward(model(torch.ones(4, 2)).sum())
    second.end_training()
    seen["group after the second ended"] = dist.is_initialized()
    seen["its model let go of the group"] = model.reducer is None  # before the group goes
    seen["first"] = collected(first)
    seen["second, ended"] = raised(lambda: second.reduce(torch.ones(1)))
    move_the_meeting()
    first.end_training()
    seen["group after both ended"] = dist.is_initialized()
    seen["first, ended"] = raised(lambda: first.gather(torch.ones(1)))

    # The first (the creator) ends first: the second keeps the group.
    first, second = Accelerator(live=False), Accelerator(live=False)
    first.end_training()
    seen["group after the creator ended"] = dist.is_initialized()
    seen["second"] = collected(second)
    seen["second, gather_for_metrics"] = second.gather_for_metrics(torch.ones(2)).tolist()
    second.end_training()
    seen["group at the end"] = dist.is_initialized()
    return seen


def test_ending_one_accelerator_leaves_the_others_collectives_right():
    for seen in run_ranks(two_accelerators):
        assert seen["group after the second ended"]
        assert seen["its model let go of the group"]
        assert seen["first"] == (2.0, [0.0, 1.0], False)
        assert "reduce after this Accelerator's end_training()" in seen["second, ended"]
        assert "this rank's value alone" in seen["second, ended"]
        assert not seen["group after both ended"]
        assert "gather after this Accelerator's end_training()" in seen["first, ended"]
        assert seen["group after the creator ended"]
        assert seen["second"] == (2.0, [0.0, 1.0], False)
        assert seen["second, gather_for_metrics"] == [1.0] * 4
        assert not seen["group at the end"]


def holders_and_strangers() -> dict:
    seen = {}
    # A bare PartialState holds the group like an Accelerator.
    accelerator = Accelerator(live=False)
    state = PartialState()
    accelerator.end_training()
    seen["state"] = collected(state)
    move_the_meeting()
    state.destroy_process_group()
    seen["group after the state left"] = dist.is_initialized()

    # An Accelerator that became garbage holds nothing: the live one's end destroys the group.
    Accelerator(live=False)  # dropped at once
    accelerator = Accelerator(live=False)
    move_the_meeting()
    accelerator.end_training()
    seen["group after the live one ended"] = dist.is_initialized()

    # One dropped in a reference cycle, which only the collector frees, holds nothing either.
    cycle = Accelerator(live=False)
    cycle.itself = cycle
    del cycle
    accelerator = Accelerator(live=False)
    move_the_meeting()
    accelerator.end_training()
    seen["group after the live one ended, a cycle dropped"] = dist.is_initialized()

    # The group destroyed behind the Accelerators' backs: their collectives say so.
    accelerator = Accelerator(live=False)
    move_the_meeting()
    dist.destroy_process_group()
    seen["destroyed"] = raised(lambda: accelerator.reduce(torch.ones(1)))
    seen["barrier"] = raised(accelerator.wait_for_everyone)
    accelerator.end_training()  # nothing left to destroy: no error

    # A group the user created is the user's: used, shared, never destroyed by nbaccel.
    dist.init_process_group("gloo")
    first, second = Accelerator(live=False), Accelerator(live=False)
    first.end_training()
    second.end_training()
    seen["user's group after both ended"] = dist.is_initialized()
    dist.destroy_process_group()
    return seen


def test_a_group_is_destroyed_by_its_last_holder_and_never_silently_missing():
    for seen in run_ranks(holders_and_strangers):
        assert seen["state"] == (2.0, [0.0, 1.0], False)
        assert not seen["group after the state left"]
        assert not seen["group after the live one ended"]
        assert not seen["group after the live one ended, a cycle dropped"]
        assert "reduce: the process group this Accelerator used was destroyed" in seen["destroyed"]
        assert "wait_for_everyone (a barrier): the process group" in seen["barrier"]
        assert seen["user's group after both ended"]
