"""``find_executable_batch_size``, ``release_memory`` and ``should_reduce_batch_size`` from
``nbaccel.utils``: the batch sizes tried, and what shrinks them, equal Accelerate's."""

from __future__ import annotations

import gc
import weakref

import accelerate.utils.memory as theirs
import pytest
import torch

from nbaccel.utils import find_executable_batch_size, release_memory, should_reduce_batch_size


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """gc.collect, counted instead of run: a collection takes 0.3 s in a heap with torch and
    Accelerate, and both sides collect before every try."""
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(1) or 0)
    return calls


def tried(decorator, fits: int, calls: int = 1) -> list[int]:
    """The batch sizes a function decorated by ``decorator`` is called with, when only a batch
    of at most ``fits`` runs; ``calls`` calls of it."""
    sizes = []

    @decorator
    def train(batch_size, label):
        sizes.append(batch_size)
        if batch_size > fits:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size, label

    for _ in range(calls):
        assert train("x") == (sizes[-1], "x")
    return sizes


@pytest.mark.parametrize("start, fits, calls", [(128, 8, 1), (100, 37, 2), (7, 7, 1)])
def test_the_sizes_tried_equal_accelerates(start, fits, calls, collections):
    ours = tried(find_executable_batch_size(starting_batch_size=start), fits, calls)
    reference = tried(theirs.find_executable_batch_size(starting_batch_size=start), fits, calls)
    assert ours == reference
    assert ours[-1] <= fits and (calls == 1 or ours[-1] == ours[-2])  # a second call starts there
    assert collections  # memory is given back between tries


def test_a_custom_reduction_and_the_result(collections):
    halves = iter([32, 16, 8])

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: next(halves))
    def train(batch_size):
        if batch_size > 10:
            raise RuntimeError("CPU out of memory.")
        return batch_size

    assert train() == 8


def test_zero_other_errors_and_a_batch_size_passed_by_hand(collections):
    @find_executable_batch_size(starting_batch_size=4)
    def never(batch_size):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never()

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size, a, b):
        return batch_size

    with pytest.raises(
        TypeError, match=r"Batch size was passed into `train`.*train\(a='x', b='y'\)"
    ):
        train(128, "x", "y")
    assert train("x", "y") == 4


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear"),
        RuntimeError("out of memory"),
        RuntimeError("CUDA out of memory.", "two arguments"),
        ValueError("CUDA out of memory."),
        MemoryError(),
    ],
)
def test_should_reduce_batch_size_equals_accelerates(error):
    assert should_reduce_batch_size(error) == theirs.should_reduce_batch_size(error)


def test_release_memory_returns_nones_and_frees_the_objects():
    model, tensor = torch.nn.Linear(4, 4), torch.ones(8)
    refs = [weakref.ref(model), weakref.ref(tensor)]
    model, tensor = release_memory(model, tensor)
    gc.collect()
    assert (model, tensor) == (None, None)
    assert [ref() for ref in refs] == [None, None]
    assert release_memory() == []
