"""How the ranks share the training: one strategy object per Accelerator, chosen here.

Each back end is one module with one class behind the interface of ``base.Strategy``:

=================  ===========================  =============================================
plugin             strategy                     what each rank holds
=================  ===========================  =============================================
none, 1 process    ``base.Strategy``            everything; nothing to reduce
none, N processes  ``ddp.DDP``                  the whole model; gradients all-reduced
``FSDPPlugin``     ``fsdp.FSDP``                ``1/N`` of parameters, gradients, state
``DeepSpeedPlugin``  ``deepspeed.DeepSpeed``    what the ZeRO stage leaves (an engine's)
=================  ===========================  =============================================

To add a back end: write its module (a ``Strategy`` subclass and a plugin dataclass) and add one
row to ``BACK_ENDS``. The Accelerator needs no change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...config import LaunchConfig
from .base import Strategy
from .ddp import DDP
from .deepspeed import DeepSpeed
from .ds_config import DeepSpeedPlugin
from .fsdp import FSDP, FSDPPlugin

#: plugin type -> (the Accelerator's argument that takes it, its strategy, the plugin a launch
#: asks for: ``notebook_launcher(fsdp=True)``, ``nbaccel launch --zero-stage 2``, or None)
BACK_ENDS: dict[type, tuple[str, type[Strategy], Callable[[LaunchConfig], Any]]] = {
    FSDPPlugin: ("fsdp_plugin", FSDP, lambda launch: FSDPPlugin() if launch.fsdp else None),
    DeepSpeedPlugin: (
        "deepspeed_plugin",
        DeepSpeed,
        lambda launch: None if launch.zero_stage is None else DeepSpeedPlugin(launch.zero_stage),
    ),
}


def choose(
    plugins: dict[str, Any], launch: LaunchConfig, distributed: bool
) -> tuple[dict[str, Any], Any, type[Strategy]]:
    """Each plugin argument's value (the launch's plugin where none was given), the one plugin
    in use, and the strategy it asks for.

    ``plugins`` maps each plugin argument (``fsdp_plugin=...``) to its value or None.
    """
    plugins = dict(plugins)
    for argument, _, from_launch in BACK_ENDS.values():
        if plugins.get(argument) is None:
            plugins[argument] = from_launch(launch)
    given = {name: plugin for name, plugin in plugins.items() if plugin is not None}
    for name, plugin in given.items():
        expected = [kind for kind, (argument, *_) in BACK_ENDS.items() if argument == name]
        if not isinstance(plugin, tuple(expected)):
            raise TypeError(
                f"{name}={plugin!r} must be an nbaccel.{expected[0].__name__}, e.g. "
                f"{name}=nbaccel.{expected[0].__name__}()"
            )
    if len(given) > 1:
        raise ValueError(
            f"both {' and '.join(given)} were given (by argument or by the launch's "
            "fsdp/zero_stage options): choose one way to shard."
        )
    if given:
        (plugin,) = given.values()
        return plugins, plugin, BACK_ENDS[type(plugin)][1]
    return plugins, None, DDP if distributed else Strategy


__all__ = ["BACK_ENDS", "DDP", "FSDP", "DeepSpeed", "Strategy", "choose"]
