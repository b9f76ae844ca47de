"""Accelerate's helpers on nested batches, under its names: ``recursively_apply`` and what is
built on it (``convert_to_fp32``, ``listify``), ``concatenate``, ``find_device``,
``find_batch_size``.

``nbaccel.tensors.map_tensors`` is the walk nbaccel itself uses on every step (tuned for the
common batch, tensors only). ``recursively_apply`` is Accelerate's public, more general walk:
any leaf test (``test_type``), extra arguments for the function, and an error on any other leaf
when asked. Both keep the structure: lists, tuples, named tuples and mappings (a mapping
rebuilt as its own type, ``UserDict`` included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "concatenate",
    "convert_to_fp32",
    "find_batch_size",
    "find_device",
    "honor_type",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "recursively_apply",
]


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``: ``recursively_apply``'s default leaf test."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a named tuple (a tuple with ``_fields`` and ``_asdict``)."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """The items of ``generator`` in a sequence of ``obj``'s own type: list, tuple or named
    tuple (whose constructor takes the fields one by one)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``func(leaf, *args, **kwargs)`` for every leaf of ``data`` that ``test_type`` accepts
    (tensors by default), inside lists, tuples, named tuples and mappings, keeping the structure.

    Other leaves are kept as they are, or, with ``error_on_other_type=True``, raise
    ``TypeError``.
    """
    if isinstance(data, tuple | list):
        return honor_type(
            data,
            (
                recursively_apply(
                    func,
                    item,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for item in data
            ),
        )
    if isinstance(data, Mapping):
        return type(data)(
            {
                key: recursively_apply(
                    func,
                    value,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for key, value in data.items()
            }
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's words, which its tests compare whole
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{func.__name__}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{test_type.__name__}` should be "
            "passed."
        )
    return data


def _half(tensor: Any) -> bool:
    return (isinstance(tensor, torch.Tensor) or hasattr(tensor, "dtype")) and tensor.dtype in (
        torch.float16,
        torch.bfloat16,
    )


def _float(tensor: Any) -> Any:
    return tensor.float()


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16 and bfloat16 tensor inside ``tensor`` as float32; other leaves as they are."""
    return recursively_apply(_float, tensor, test_type=_half)


def _to_list(tensor: torch.Tensor) -> Any:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy, which tolist goes through, has no bfloat16
        tensor = tensor.float()
    return tensor.tolist()


def listify(data: Any) -> Any:
    """Every tensor inside ``data`` as (nested) Python lists of numbers, the structure kept."""
    return recursively_apply(_to_list, data)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (depth first); None without one."""
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = data.values()
    elif not isinstance(data, tuple | list):
        return None
    for item in data:
        device = find_device(item)
        if device is not None:
            return device
    return None


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in ``data`` (following first items and first
    values). Raises ``ValueError`` on an empty container on that path and ``TypeError`` when
    its first leaf is not a tensor."""
    while isinstance(data, tuple | list | Mapping):
        if len(data) == 0:
            raise ValueError(
                f"find_batch_size: the batch holds an empty {type(data).__name__}, so it has no "
                "first tensor to read the batch size from."
            )
        data = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
    if not isinstance(data, torch.Tensor):
        raise TypeError(
            f"find_batch_size reads the first dimension of the batch's first tensor, but its "
            f"first leaf is a {type(data).__name__}. Put the tensors first, or pass the tensor."
        )
    return data.shape[0]


def concatenate(data: list[Any] | tuple[Any, ...], dim: int = 0) -> Any:
    """Concatenate a list of batches of one structure along ``dim``, leaf by leaf: a list of
    dicts of tensors gives one dict of concatenated tensors. A list of one non-tensor batch
    gives that batch. Raises ``TypeError`` on any other leaf (strings cannot be merged)."""
    first = data[0]
    if isinstance(first, tuple | list):
        return honor_type(
            first, (concatenate([batch[i] for batch in data], dim=dim) for i in range(len(first)))
        )
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([batch[k] for batch in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if isinstance(data, tuple | list) and len(data) == 1:
        return first
    raise TypeError(
        f"concatenate merges tensors, but the batches hold a {type(first).__name__}. Leave "
        "such values out of what you concatenate, or collect them in a list yourself."
    )
