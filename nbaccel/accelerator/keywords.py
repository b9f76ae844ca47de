"""Accelerate's keywords that nbaccel's ``Accelerator`` takes with a caveat, or refuses.

``Accelerator(...)`` and ``prepare(...)`` take every keyword of Accelerate 1.15's. Most mean
what they mean there (``accelerator.py``); the ones here need a word first:

* ``split_batches=``: Accelerate 1.15 still lists it but ignores it; nbaccel honours it, folded
  into the ``DataLoaderConfiguration``, and warns (``FutureWarning``) that the same code on
  Accelerate would not split: ``dataloader_config=`` means the same in both.
* ``dispatch_batches=``, ``even_batches=``, ``use_seedable_sampler=``: Accelerate removed them
  from the constructor (a ``TypeError`` there too); the error names the configuration field.
* ``device_placement=False``: honoured where it changes nothing (the CPU, where every tensor
  already is); on an accelerator nbaccel places models itself, so it is refused.
* Engines nbaccel does not drive (Megatron-LM, tensor parallelism, ``parallelism_config``),
  ``torch.compile`` through ``dynamo_backend``, and RNG synchronisation other than the
  sampler's generator (``rng_types``) raise ``NotImplementedError`` saying what to do instead.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from .distributed_type import DistributedType

#: Constructor keywords Accelerate has removed, and where each now goes.
_REMOVED = {
    "dispatch_batches": "DataLoaderConfiguration(dispatch_batches=...)",
    "even_batches": "DataLoaderConfiguration(even_batches=...)",
    "use_seedable_sampler": "DataLoaderConfiguration(use_seedable_sampler=...)",
    "logging_dir": "project_dir=... (or ProjectConfiguration(logging_dir=...))",
}


def refuse_unknown(kwargs: dict[str, Any]) -> None:
    """A ``TypeError`` for keywords ``Accelerator()`` does not take, naming the new home of
    those Accelerate removed."""
    for name in kwargs:
        hint = _REMOVED.get(name)
        if hint is not None:
            where = f"dataloader_config={hint}" if hint.startswith("DataLoader") else hint
            raise TypeError(
                f"Accelerator() got {name}=, which Accelerate 1.x no longer takes either: "
                f"pass {where}"
            )
        raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}")


def fold_split_batches(split_batches: Any, config: Any) -> Any:
    """The ``DataLoaderConfiguration`` with ``split_batches=`` folded in (``None``: not given)."""
    if split_batches is None:
        return config
    if not isinstance(split_batches, bool):
        raise TypeError(f"split_batches={split_batches!r} must be True or False")
    if config is not None and config.split_batches != split_batches:
        raise ValueError(
            f"split_batches={split_batches} and dataloader_config=DataLoaderConfiguration("
            f"split_batches={config.split_batches}) disagree: give it once, in the "
            "DataLoaderConfiguration."
        )
    warnings.warn(
        "Accelerator(split_batches=...) is deprecated: Accelerate 1.15 takes it but ignores it, "
        "so this code would not split batches there. Pass dataloader_config="
        "DataLoaderConfiguration(split_batches=...) instead, which means the same in both.",
        FutureWarning,
        stacklevel=3,
    )
    if config is None:
        from .data.sharding import DataLoaderConfiguration

        config = DataLoaderConfiguration()
    config.split_batches = split_batches
    return config


def refuse_engines(
    torch_tp_plugin: Any,
    megatron_lm_plugin: Any,
    parallelism_config: Any,
    dynamo_backend: Any,
    dynamo_plugin: Any,
    rng_types: Any,
) -> None:
    """``NotImplementedError`` for what nbaccel does not drive; the defaults pass."""
    for name, value in (
        ("torch_tp_plugin", torch_tp_plugin),
        ("megatron_lm_plugin", megatron_lm_plugin),
        ("parallelism_config", parallelism_config),
    ):
        if value is not None:
            raise NotImplementedError(
                f"{name}=: nbaccel trains with DDP, FSDP2 or DeepSpeed ZeRO only (no tensor, "
                "pipeline or Megatron-LM parallelism). Use fsdp_plugin= or deepspeed_plugin=, "
                "or Accelerate itself for these engines."
            )
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError("You cannot pass in both dynamo_plugin and dynamo_backend: pass one.")
    backend = getattr(dynamo_plugin, "backend", dynamo_backend)
    backend = getattr(backend, "value", backend)
    if backend is not None and str(backend).lower() != "no":
        raise NotImplementedError(
            f"dynamo_backend={backend!r}: nbaccel's prepare does not call torch.compile. "
            "Compile the prepared model yourself (model = torch.compile(model)); "
            "unwrap_model and save_state see through it."
        )
    types = [getattr(t, "value", t) for t in rng_types or ()]
    if any(str(t) != "generator" for t in types):
        raise NotImplementedError(
            f"rng_types={rng_types!r}: nbaccel keeps the ranks' shuffling identical through the "
            "sampler's generator only (rng_types=['generator'], the default); it does not "
            "synchronise the global RNGs each epoch. Seed them yourself (set_seed) instead."
        )


def one_deepspeed_plugin(plugin: Any, plugins: Any) -> Any:
    """``deepspeed_plugin=`` or ``deepspeed_plugins=`` (one plugin, or a dict of one)."""
    if plugin is not None and plugins is not None:
        raise ValueError("You cannot pass in both deepspeed_plugins and deepspeed_plugin.")
    if not isinstance(plugins, dict):
        return plugin if plugins is None else plugins
    if len(plugins) != 1:
        raise NotImplementedError(
            f"deepspeed_plugins with {len(plugins)} plugins: nbaccel drives one DeepSpeed "
            "engine per Accelerator. Pass one plugin, or one Accelerator per model."
        )
    return next(iter(plugins.values()))


def check_placement(device_placement: Any, device: torch.device, what: str) -> None:
    """Refuse ``device_placement=False`` where it would change something (off the CPU)."""
    if device_placement is None or device_placement is True:
        return
    if device_placement is not False:
        raise TypeError(f"{what}: device_placement={device_placement!r} must be True or False")
    if device.type != "cpu":
        raise NotImplementedError(
            f"{what}: device_placement=False on {device}: nbaccel places models on the "
            "Accelerator's device itself (DDP and FSDP need them there). Leave it True; for a "
            "DataLoader whose batches you move yourself, use prepare_data_loader(loader, "
            "device_placement=False)."
        )


def placements(objects: tuple, device_placement: Any, deepspeed: bool) -> list[Any]:
    """``prepare``'s ``device_placement`` list, checked: one entry per object."""
    if device_placement is None:
        return [None] * len(objects)
    if deepspeed:
        raise ValueError("You can't customize device placements with DeepSpeed.")
    if not isinstance(device_placement, list | tuple) or len(device_placement) != len(objects):
        raise ValueError(
            f"device_placement should be a list with {len(objects)} elements (the number of "
            f"objects passed), got {device_placement!r}"
        )
    return list(device_placement)


def check_quantized(model: torch.nn.Module, distributed: bool) -> None:
    """Refuse to train an 8-bit or 4-bit (bitsandbytes) model placed across devices."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(
        model, "is_loaded_in_4bit", False
    )
    device_map = getattr(model, "hf_device_map", None)
    if not (quantized and device_map):
        return
    devices = {str(d) for d in device_map.values()}
    if "cpu" in devices or "disk" in devices:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU "
            "or disk offload: load it whole on the accelerator (device_map={'': 0})."
        )
    if len(devices) > 1 and distributed:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on "
            "several devices with several processes: launch one process, or load it on one "
            "device per process."
        )


def set_accumulation(strategy: Any, window: Any, steps: int) -> Any:
    """``accelerator.gradient_accumulation_steps = steps``: the window, the loss's divisor and
    the plugin (returned) take it; under DeepSpeed, whose config fixed it, only the same value."""
    from .accumulation import accumulation_plugin

    accumulation_plugin(steps, None)  # checks it: a positive int
    if steps != window.steps and strategy.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            f"gradient_accumulation_steps = {steps}: the DeepSpeed engine's config fixed it at "
            f"{window.steps} when the Accelerator was made. Pass it to Accelerator() instead."
        )
    strategy.accumulation_steps = window.steps = steps  # the strategy divides the loss by it
    window.plugin = dataclasses.replace(window.plugin, num_steps=steps)
    return window.plugin


def release_engine(strategy: Any) -> None:
    """``free_memory``: a DeepSpeed strategy's engine is destroyed and forgotten, so that the
    next ``prepare`` may make another."""
    held = getattr(strategy, "engine", None)
    if held is not None:
        getattr(held, "destroy", lambda: None)()
        strategy.engine = None


def mark_prepared(objects: list[Any], *held: list[Any]) -> None:
    """Set Accelerate's ``_is_accelerate_prepared`` on each object the Accelerator holds."""
    for obj in objects:
        if any(any(obj is h for h in objs) for objs in held):
            try:
                obj._is_accelerate_prepared = True
            except AttributeError:  # an object that takes no new attributes: nothing to mark
                pass
