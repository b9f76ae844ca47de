"""Taking the wrappers off a model: Accelerate's ``extract_model_from_parallel``.

A prepared model may sit inside ``torch.compile``'s ``OptimizedModule``, then DDP,
``DataParallel``, FSDP (version 1's wrapper class) or a DeepSpeed engine, and its forward may be
wrapped to run under autocast (nbaccel's ``AutocastForward``, or any wrapper that keeps the
original as ``model._original_forward`` and reaches it through ``__wrapped__``, as Accelerate's
``convert_outputs_to_fp32`` does). The wrapper classes of FSDP and DeepSpeed are looked up only
where their modules were imported already: a model cannot be wrapped by a class never loaded,
and the lookup costs no import.
"""

from __future__ import annotations

import sys
from types import MethodType
from typing import Any

import torch

from .precision import without_autocast

__all__ = ["extract_model_from_parallel"]


def _loaded(module: str, name: str) -> tuple[type, ...]:
    """``(module.name,)`` if ``module`` is imported already, else ``()``."""
    cls = getattr(sys.modules.get(module), name, None)
    return (cls,) if isinstance(cls, type) else ()


def _containers() -> tuple[type, ...]:
    """The classes whose ``.module`` is the model they wrap."""
    return (
        torch.nn.parallel.DistributedDataParallel,
        torch.nn.DataParallel,
        *_loaded("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
        *_loaded("deepspeed.runtime.engine", "DeepSpeedEngine"),
    )


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``)."""
    return isinstance(module, _loaded("torch._dynamo.eval_frame", "OptimizedModule"))


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """The model inside its distributed containers (DDP, ``DataParallel``, FSDP, DeepSpeed).

    Args:
        model: the model, wrapped or not.
        keep_fp32_wrapper: False also removes the mixed-precision wrapper from its forward (the
            autocast ``prepare`` put there, and a forward kept in ``_original_forward``).
        keep_torch_compile: with a compiled model, return the ``torch.compile`` wrapper, now
            around the unwrapped model (its ``_orig_mod`` is replaced, as in Accelerate);
            False returns the model without it.
        recursive: also replace every submodule that has a ``.module`` by that module, all the
            way down (wrappers around layers rather than around the whole model).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"extract_model_from_parallel takes a torch.nn.Module, got a {type(model).__name__}."
        )
    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    elif "_orig_mod" in model.__dict__:  # a module with compiled regions, whose own is kept
        compiled, model = model, model.__dict__["_orig_mod"]
    containers = _containers()
    while isinstance(model, containers):
        model = model.module
    if recursive:
        model = _unwrap_all(model)
    if not keep_fp32_wrapper:
        model = _without_fp32_wrapper(model)
    if keep_torch_compile and compiled is not None:
        if is_compiled_module(compiled):
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        model = compiled
    return model


def _unwrap_all(module: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(module, "module", None)
    if isinstance(inner, torch.nn.Module):
        module = _unwrap_all(inner)
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrap_all(child))
    return module


def _without_fp32_wrapper(model: torch.nn.Module) -> torch.nn.Module:
    if getattr(model, "_converted_to_transformer_engine", False):
        raise ValueError(
            "extract_model_from_parallel(keep_fp32_wrapper=False): this model's layers were "
            "converted to Transformer Engine's by HF Accelerate, and nbaccel has no Transformer "
            "Engine to convert them back; unwrap it with accelerate.utils."
            "extract_model_from_parallel, or keep the wrapper."
        )
    original = model.__dict__.pop("_original_forward", None)
    if original is not None:  # a wrapper that kept the forward it wraps (Accelerate's)
        forward = model.forward
        while hasattr(forward, "__wrapped__"):
            forward = forward.__wrapped__
            if forward == original:
                break
        function = getattr(forward, "__func__", forward)  # a bound method: its function
        if function is getattr(type(model), "forward", None):
            model.__dict__.pop("forward", None)  # the class's own forward, as before prepare
        else:
            model.forward = MethodType(function, model)
    return without_autocast(model)
