"""Collectives on mismatched shapes raise on every rank, and the ranks go on (issue 32).

Gloo on its own kills a rank with SIGABRT for a mismatched ``all_reduce`` and overwrites a
mismatched ``broadcast`` without a word. Every case below runs in one launch of 2 CPU ranks:
each mismatched call is caught on the rank and reported back, then a correct collective
follows, so a rank that died or hung would fail the whole launch. Matching shapes are compared
with plain torch.distributed on the same tensors, exactly (integers and sums of two floats).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from nbaccel import Accelerator
from nbaccel.accelerator import collectives
from nbaccel.errors import DistributedOperationException, NbaccelError
from nbaccel.utils import PartialState, broadcast, gather, pad_across_processes, reduce

from ..distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def caught(call) -> dict:
    """What ``call`` raised on this rank, then whether a correct collective still works."""
    try:
        call()
        out = {"type": None}
    except Exception as err:  # any type: the test checks it is ours
        out = {
            "type": type(err).__name__,
            "value error": isinstance(err, ValueError),
            "ours": isinstance(err, DistributedOperationException),
            "message": str(err),
        }
    out["after"] = reduce(torch.tensor([1.0, 2.0]), "sum").tolist()  # the group still works
    return out


def mismatches(rank: int, state: PartialState, accelerator: Accelerator) -> dict:
    row = torch.arange(5.0)[None]  # [1, 5] on rank 0, [1, 2, 5] on rank 1
    ragged = {"tensor": row if rank == 0 else torch.arange(10.0).reshape(1, 2, 5)}
    dtype = torch.zeros(2, dtype=[torch.float32, torch.int64][rank])
    calls = {
        "reduce": lambda: reduce(ragged),
        "reduce dtype": lambda: reduce(dtype, "sum"),
        "reduce length": lambda: reduce(torch.ones(3 + rank)),  # gloo: SIGABRT on rank 0
        "broadcast": lambda: broadcast(ragged),
        "broadcast length": lambda: broadcast(torch.ones(3 + rank)),  # gloo: no error at all
        "gather": lambda: gather(ragged),
        "pad ndim": lambda: pad_across_processes(ragged, dim=0),
        "pad dim": lambda: pad_across_processes(torch.zeros(2, 2), dim=2),
        "keys": lambda: reduce({f"k{rank}": torch.ones(2)}),
        "one of many": lambda: gather({f"t{i}": torch.ones(2 + rank * (i == 7)) for i in range(9)}),
        "different collectives": lambda: (reduce if rank == 0 else gather)(torch.ones(2)),
        "state.reduce": lambda: state.reduce(torch.ones(3 + rank)),
        "state.gather": lambda: state.gather(torch.ones(3 + rank)),
        "state.pad": lambda: state.pad_across_processes(torch.ones([2] * (1 + rank))),
        "accelerator.reduce": lambda: accelerator.reduce(torch.ones(3 + rank)),
        "accelerator.gather": lambda: accelerator.gather(torch.ones(3 + rank)),
        "accelerator.pad": lambda: accelerator.pad_across_processes(torch.ones([2] * (1 + rank))),
    }
    return {name: caught(call) for name, call in calls.items()}


def matches(rank: int) -> dict:
    """nbaccel's collectives beside torch.distributed's on the same tensors."""
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    out = {}
    for reduction, op in [("sum", "SUM"), ("max", "MAX"), ("min", "MIN")]:
        plain = x.clone()
        dist.all_reduce(plain, getattr(dist.ReduceOp, op))
        out[f"reduce {reduction}"] = (reduce(x, reduction), plain)
    plain = x.clone()
    dist.all_reduce(plain)
    out["reduce mean"] = (reduce(x), plain / 2)
    plain = x.clone()
    dist.broadcast(plain, src=1)
    out["broadcast"] = (broadcast({"x": x.clone()}, from_process=1)["x"], plain)
    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x)
    out["gather"] = (gather([x])[0], torch.cat(parts))
    # Ten tensors: more sizes than travel with the check, so pad sends the rest after it.
    ragged = {f"t{i}": torch.ones(1 + rank + i % 2, 2) * (rank + 1) for i in range(10)}
    padded = pad_across_processes(ragged, dim=0, pad_index=-1)
    for i in (0, 1):
        by_hand = torch.full((2 + i, 2), -1.0)
        by_hand[: 1 + rank + i] = rank + 1
        out[f"pad t{i}"] = (padded[f"t{i}"], by_hand)
    return out


def collectives_per_call() -> dict:
    """How many all_gathers (the check) and all_reduces one ``reduce`` of ten tensors takes."""
    counts = {"all_gather": 0, "all_reduce": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in counts:
            setattr(dist, name, counting(name))
        reduce({f"t{i}": torch.ones(2) for i in range(10)})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def accelerates_op_checker() -> str:
    """Accelerate's own ``test_op_checker``, calling nbaccel's collectives and expecting
    nbaccel's exception: its globals are pointed at nbaccel, its code is not copied."""
    from accelerate.test_utils.scripts import test_ops

    names = ("pad_across_processes", "reduce", "broadcast", "DistributedOperationException")
    saved = {name: getattr(test_ops, name) for name in names}
    ours = {
        **{n: getattr(collectives, n) for n in names[:3]},
        names[3]: DistributedOperationException,
    }
    try:
        vars(test_ops).update(ours)
        test_ops.test_op_checker(PartialState(cpu=True))
    finally:
        vars(test_ops).update(saved)
    return "passed"


def every_case() -> dict:
    state = PartialState(cpu=True)
    accelerator = Accelerator(cpu=True, live=False)
    rank = state.process_index
    out = {
        "mismatches": mismatches(rank, state, accelerator),
        "matches": matches(rank),
        "counts": collectives_per_call(),
        "accelerate's test_op_checker": accelerates_op_checker(),
    }
    accelerator.end_training()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(every_case, timeout=300)


def mismatch(two_ranks, name: str) -> str:
    """The message of ``name``'s exception, checked to be ours and the same on both ranks."""
    rank0, rank1 = (result["mismatches"][name] for result in two_ranks)
    for rank, got in enumerate((rank0, rank1)):
        assert got["type"] == "DistributedOperationException", (name, rank, got)
        assert got["ours"] and got["value error"], (name, rank)
        assert got["after"] == [2.0, 4.0], (name, rank)  # the next collective works
    assert rank0["message"] == rank1["message"], name
    return rank0["message"]


def test_distributed_operation_exception_is_a_value_error_and_ours():
    assert issubclass(DistributedOperationException, ValueError)
    assert issubclass(DistributedOperationException, NbaccelError)
    with pytest.raises(ValueError, match="shapes"):
        raise DistributedOperationException("shapes")


def test_a_mismatched_reduce_raises_on_every_rank_instead_of_aborting(two_ranks):
    shapes = r"\['tensor'\]: rank 0: \[1, 5\] float32, rank 1: \[1, 2, 5\] float32"
    message = mismatch(two_ranks, "reduce")
    assert re.search(f"^reduce needs the same shape and dtype.*got {shapes}", message)
    assert "reduce(t.sum())" in message
    assert "rank 0: [3] float32, rank 1: [4] float32" in mismatch(two_ranks, "reduce length")
    assert "rank 0: [2] float32, rank 1: [2] int64" in mismatch(two_ranks, "reduce dtype")


def test_a_mismatched_broadcast_raises_on_every_rank(two_ranks):
    message = mismatch(two_ranks, "broadcast")
    assert re.search(r"^broadcast needs .*rank 0: \[1, 5\] float32, rank 1: \[1, 2, 5\]", message)
    assert "broadcast_object_list([t.shape])" in message
    assert "rank 0: [3] float32, rank 1: [4] float32" in mismatch(two_ranks, "broadcast length")


def test_a_mismatched_gather_or_pad_raises_the_same_exception(two_ranks):
    assert "pad_across_processes(t, dim=0)" in mismatch(two_ranks, "gather")
    message = mismatch(two_ranks, "pad ndim")
    assert re.search(r"^pad_across_processes needs .* same number of dimensions", message)
    assert "rank 0: [1, 5] float32, rank 1: [1, 2, 5] float32" in message
    assert "between -2 and 1" in mismatch(two_ranks, "pad dim")


def test_the_message_names_the_tensor_that_differs_in_a_structure(two_ranks):
    assert "['k0']: rank 0: [2] float32, rank 1: no tensor" in mismatch(two_ranks, "keys")
    message = mismatch(two_ranks, "one of many")
    assert message.count("rank 0:") == 1  # only t7 differs
    assert "['t7']: rank 0: [2] float32, rank 1: [3] float32" in message


def test_ranks_in_different_collectives_raise_instead_of_hanging(two_ranks):
    message = mismatch(two_ranks, "different collectives")
    assert "different collectives at the same point: rank 0: reduce, rank 1: gather" in message


def test_partial_state_and_accelerator_methods_raise_it_too(two_ranks):
    for owner in ("state", "accelerator"):
        for op in ("reduce", "gather"):
            message = mismatch(two_ranks, f"{owner}.{op}")
            assert f"{op} needs" in message and "rank 0: [3] float32, rank 1: [4]" in message
        assert "rank 0: [2] float32, rank 1: [2, 2] float32" in mismatch(two_ranks, f"{owner}.pad")


def test_matching_shapes_give_plain_torchs_results(two_ranks):
    for rank, result in enumerate(two_ranks):
        for name, (ours, plain) in result["matches"].items():
            assert torch.equal(ours, plain), (rank, name, ours, plain)


def test_one_check_per_call_however_many_tensors(two_ranks):
    for result in two_ranks:
        assert result["counts"] == {"all_gather": 1, "all_reduce": 10}


def test_accelerates_own_op_checker_passes(two_ranks):
    assert [r["accelerate's test_op_checker"] for r in two_ranks] == ["passed", "passed"]
