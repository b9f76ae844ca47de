"""Accelerate's nested-batch helpers and ``extract_model_from_parallel``, from ``nbaccel.utils``.

The oracle is Accelerate's function of the same name on the same data: equal results, equal
types, and the same exception type where Accelerate raises.
"""

from __future__ import annotations

import pickle
from collections import UserDict, namedtuple

import accelerate.utils as theirs
import pytest
import torch
from torch import nn

from nbaccel import Accelerator
from nbaccel.utils import (
    concatenate,
    convert_to_fp32,
    extract_model_from_parallel,
    find_batch_size,
    find_device,
    honor_type,
    is_compiled_module,
    is_namedtuple,
    listify,
    recursively_apply,
)

Pair = namedtuple("Pair", "a b")


def same(ours, reference) -> None:
    """Equal structure, types, and tensors (values and dtypes)."""
    assert type(ours) is type(reference)
    if isinstance(reference, torch.Tensor):
        assert ours.dtype == reference.dtype
        assert torch.equal(ours, reference)
    elif isinstance(reference, dict | UserDict):
        assert list(ours) == list(reference)
        for key in reference:
            same(ours[key], reference[key])
    elif isinstance(reference, list | tuple):
        assert len(ours) == len(reference)
        for a, b in zip(ours, reference, strict=True):
            same(a, b)
    else:
        assert ours == reference


def batch() -> dict:
    t = torch.arange(6.0).reshape(3, 2)
    return {
        "x": t.half(),
        "pair": Pair(t.bfloat16(), [t, "label", 3]),
        "user": UserDict({"y": t.long(), "z": (t.double(), None)}),
    }


def test_recursively_apply_equals_accelerates():
    for kwargs in ({}, {"test_type": lambda x: isinstance(x, int)}):
        ours = recursively_apply(lambda x, k: x * k, batch(), 2, **kwargs)
        same(ours, theirs.recursively_apply(lambda x, k: x * k, batch(), 2, **kwargs))


def test_recursively_apply_refuses_other_leaves_as_accelerate_does():
    data = (torch.tensor(1), 1)
    with pytest.raises(TypeError) as ours:
        recursively_apply(torch.tensor, data, error_on_other_type=True)
    with pytest.raises(TypeError) as reference:
        theirs.recursively_apply(torch.tensor, data, error_on_other_type=True)
    assert str(ours.value) == str(reference.value)


def test_honor_type_and_is_namedtuple():
    assert honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4)
    assert type(honor_type((1,), iter([2]))) is tuple
    assert is_namedtuple(Pair(1, 2)) and not is_namedtuple((1, 2))


def test_convert_to_fp32_listify_find_device_equal_accelerates():
    for name, ours in (
        ("convert_to_fp32", convert_to_fp32),
        ("listify", listify),
        ("find_device", find_device),
    ):
        same(ours(batch()), getattr(theirs, name)(batch()))
    assert find_device([1, "a"]) is None
    converted = convert_to_fp32(batch())
    assert converted["x"].dtype == converted["pair"].a.dtype == torch.float32
    assert converted["user"]["y"].dtype == torch.int64  # integers stay integers


@pytest.mark.parametrize(
    "data",
    [
        {"a": torch.zeros(5, 2), "b": torch.zeros(3)},
        [(torch.zeros(7),), 1],
        [],
        {"a": "text"},
        [[]],
    ],
    ids=["dict", "nested", "empty", "text", "empty-inner"],
)
def test_find_batch_size_equals_accelerates(data):
    try:
        expected = theirs.find_batch_size(data)
    except (TypeError, ValueError) as error:
        with pytest.raises(type(error), match="find_batch_size"):
            find_batch_size(data)
    else:
        assert find_batch_size(data) == expected


def test_concatenate_equals_accelerates():
    torch.manual_seed(0)
    cases = [
        [{"a": torch.randn(2, 3), "b": [torch.randn(2, 1)]} for _ in range(3)],
        [Pair(torch.randn(2), torch.randn(2, 2)) for _ in range(2)],
        ["only"],
    ]
    for data in cases:
        same(concatenate(data), theirs.concatenate(data))
    same(
        concatenate([torch.ones(3, 2), torch.zeros(3, 2)], dim=1),
        torch.cat([torch.ones(3, 2), torch.zeros(3, 2)], 1),
    )
    with pytest.raises(TypeError, match="concatenate merges tensors"):
        concatenate([{"c": "x"}, {"c": "y"}])


def test_extract_model_from_parallel_takes_off_data_parallel():
    model = nn.Linear(2, 2)
    assert extract_model_from_parallel(nn.DataParallel(nn.DataParallel(model))) is model
    assert extract_model_from_parallel(model) is model
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        extract_model_from_parallel("model")


def test_extract_model_from_parallel_keeps_or_drops_torch_compile():
    model = nn.Linear(2, 2)
    compiled = torch.compile(nn.DataParallel(model))
    kept = extract_model_from_parallel(compiled, keep_torch_compile=True)
    assert kept is compiled and is_compiled_module(kept) and kept._orig_mod is model
    assert (
        extract_model_from_parallel(torch.compile(nn.DataParallel(model)), keep_torch_compile=False)
        is model
    )
    assert not is_compiled_module(model)


def test_extract_model_from_parallel_recursive_unwraps_layers():
    inner = nn.Linear(2, 2)
    model = nn.Sequential(nn.DataParallel(inner), nn.ReLU())
    assert extract_model_from_parallel(model, recursive=True)[0] is inner


def test_extract_model_removes_accelerates_fp32_wrapper_and_forward_still_works():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = model(x)
    model._original_forward = model.forward
    model.forward = theirs.convert_outputs_to_fp32(model.forward)
    with pytest.raises((pickle.PicklingError, AttributeError)):  # its forward won't pickle
        pickle.dumps(model)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in vars(model) and "_original_forward" not in vars(model)
    assert torch.equal(model(x), expected)
    pickle.loads(pickle.dumps(model))


def test_extract_model_removes_nbaccels_autocast_as_unwrap_model_does():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", live=False)
    model = accelerator.prepare(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    exact = nn.functional.linear(x, model.weight, model.bias)  # float32 all through
    kept = extract_model_from_parallel(model)(x)
    assert kept.dtype == torch.float32 and not torch.equal(kept, exact)  # computed in bf16
    plain = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert torch.equal(plain(x), exact)
    accelerator.end_training()
