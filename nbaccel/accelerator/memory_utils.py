"""Out of memory: Accelerate's ``find_executable_batch_size``, ``release_memory`` and
``should_reduce_batch_size``, under its names and with its numbers (the batch size times 0.9,
rounded down, after each out-of-memory error).

With several processes, each rank retries on its own: a rank that ran out of memory shrinks its
batch while the others keep theirs, as in Accelerate. Where ranks may differ, agree on the size
yourself (e.g. ``reduce(torch.tensor(batch_size), "min")``) before training with it.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]

# What the out-of-memory errors say (CUDA, HIP and XPU; MPS; the CPU allocator; HPU), and
# cuDNN's refusal, which a smaller batch also cures: the errors that shrink the batch.
_OUT_OF_MEMORY = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return the memory torch's allocator caches to the device (CUDA, MPS); with
    ``garbage_collection``, first collect Python's garbage (slow: use it sparingly)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # nothing to do (and no context made) before CUDA is used
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop the references to ``objects`` and free what they held on the device. Assign the
    result back (``model, optimizer = release_memory(model, optimizer)``): the caller's own
    names still hold the objects until then."""
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (or cuDNN's refusal) that a smaller batch
    may avoid."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        message = str(exception.args[0])
        return any(text in message for text in _OUT_OF_MEMORY)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Call ``function(batch_size, *args, **kwargs)``, and again with a smaller batch size after
    each out-of-memory error, until it runs; used as a decorator::

        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, model, optimizer): ...

        train(model, optimizer)  # batch_size is passed by the decorator

    The batch size shrinks to ``int(0.9 * batch_size)``, or to what ``reduce_batch_size_fn()``
    returns; at 0 it raises ``RuntimeError``. Any other error propagates at once. The size
    reached is kept: a second call starts from it.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        return int(batch_size * 0.9)

    shrink = reduce_batch_size_fn or smaller

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={v!r}" for p, v in zip(params[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called, but find_executable_batch_size passes it: call "
                f"`{function.__name__}({passed})`."
            )
        while True:
            if batch_size == 0:
                raise RuntimeError(
                    "No executable batch size found, reached zero. Even a batch of 1 ran out "
                    "of memory: use a smaller model, mixed precision or a larger device."
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
            # out of the except clause, the error's traceback (which holds the failed call's
            # tensors) is gone, so the cache can give their memory back
            clear_device_cache(garbage_collection=True)
            batch_size = shrink()

    return run
