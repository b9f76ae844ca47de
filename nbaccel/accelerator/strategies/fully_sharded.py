"""``FullyShardedDataParallelPlugin``: the user's FSDP choices, by HF Accelerate's names.

A loop written for Hugging Face Accelerate builds its plugin as

    FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, cpu_offload=False)

and the same line runs here with the import changed. nbaccel shards with PyTorch's FSDP2
(``fully_shard``) only, so FSDP1's options (``sharding_strategy`` aside, which maps onto
``reshard_after_forward``) are accepted at their defaults and refused otherwise, each with what
to do instead. ``FSDPPlugin`` is the same class under nbaccel's earlier, shorter name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

# HF's options that nbaccel does not act on, each with why and what to do instead; they are
# accepted at None (HF's "not set") and refused with this sentence otherwise
UNSUPPORTED = {
    "backward_prefetch": "an FSDP1 option; FSDP2 prefetches one unit ahead by itself",
    "mixed_precision_policy": "set Accelerator(mixed_precision='bf16') instead: nbaccel builds "
    "FSDP2's MixedPrecisionPolicy from it",
    "ignored_modules": "not supported by nbaccel yet; freeze those parameters instead",
    "state_dict_config": "nbaccel saves full state dicts only",
    "optim_state_dict_config": "nbaccel saves full state dicts only",
    "param_init_fn": "not supported by nbaccel yet",
    "sync_module_states": "an FSDP1 option; nbaccel's ranks start from the same weights by "
    "set_seed (or load them before prepare)",
    "forward_prefetch": "an FSDP1 option",
    "activation_checkpointing": "not supported by nbaccel yet; use "
    "torch.utils.checkpoint in the model",
    "activation_checkpointing_offload": "not supported by nbaccel yet",
    "cpu_ram_efficient_loading": "not supported by nbaccel yet",
}
STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # FSDP1's names, as FSDP2's switch
POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")


@dataclass(frozen=True)
class FullyShardedDataParallelPlugin:
    """How ``Accelerator(fsdp_plugin=...)`` shards models with FSDP2; HF Accelerate's arguments.

    Args:
        fsdp_version: 2 (or None): FSDP2, PyTorch's ``fully_shard``. 1 is refused.
        reshard_after_forward: free each unit's gathered parameters after its forward (less
            memory, one more all-gather in backward), as ZeRO stage 3 does; ``False`` keeps
            them until backward, like ZeRO stage 2. Default True.
        sharding_strategy: FSDP1's name for the same choice: ``"FULL_SHARD"`` (True) or
            ``"SHARD_GRAD_OP"`` (False); give one of the two, not both.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (the optimizer steps on the CPU): True, or torch's ``CPUOffloadPolicy``. GPUs only.
        auto_wrap_policy: which submodules become their own shard unit, gathered and freed
            together (the whole model is always one more unit): ``"transformer_based_wrap"``
            (classes named in ``transformer_cls_names_to_wrap``), ``"size_based_wrap"`` (units of
            at least ``min_num_params`` parameters), ``"no_wrap"``, or torch's FSDP policy
            callable ``(module, recurse, nonwrapped_numel) -> bool``. Default: every direct
            child that holds parameters.
        state_dict_type: ``"FULL_STATE_DICT"`` (what nbaccel saves) or None.
        shard: nbaccel's own: a predicate over the model's direct children.
        limit_all_gathers, use_orig_params: FSDP1's; accepted and ignored.
    """

    fsdp_version: int | None = None
    sharding_strategy: str | None = None
    reshard_after_forward: bool | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable[..., bool] | None = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: str | None = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: Any = None
    forward_prefetch: Any = None
    activation_checkpointing: Any = None
    activation_checkpointing_offload: Any = None
    cpu_ram_efficient_loading: Any = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    shard: Callable[[nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if self.fsdp_version not in (None, 2):
            raise ValueError(
                f"fsdp_version={self.fsdp_version!r}: nbaccel shards with FSDP2 (PyTorch's "
                "fully_shard) only; pass fsdp_version=2, which HF Accelerate recommends too."
            )
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) not in (None, False):
                raise ValueError(f"FullyShardedDataParallelPlugin({name}=...): {why}.")
        if self.state_dict_type not in (None, "FULL_STATE_DICT"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}: nbaccel saves and loads full state "
                "dicts (gathered on every rank); pass 'FULL_STATE_DICT' or leave it unset."
            )
        reshard = self.reshard_after_forward
        if self.sharding_strategy is not None:
            if self.sharding_strategy not in STRATEGIES:
                raise ValueError(
                    f"sharding_strategy={self.sharding_strategy!r}: FSDP2 knows 'FULL_SHARD' "
                    "(reshard_after_forward=True) and 'SHARD_GRAD_OP' (False); for no sharding "
                    "use DDP (no fsdp_plugin)."
                )
            if reshard is not None and reshard != STRATEGIES[self.sharding_strategy]:
                raise ValueError(
                    f"sharding_strategy={self.sharding_strategy!r} contradicts "
                    f"reshard_after_forward={reshard!r}: give one of the two."
                )
            reshard = STRATEGIES[self.sharding_strategy]
        if not isinstance(reshard, bool | None):
            raise ValueError(f"reshard_after_forward={reshard!r} must be True or False")
        object.__setattr__(self, "reshard_after_forward", True if reshard is None else reshard)
        policy = self.auto_wrap_policy
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"auto_wrap_policy={policy!r} must be one of {POLICIES} or callable")
        if policy == "transformer_based_wrap" and not self.transformer_cls_names_to_wrap:
            raise ValueError(
                "auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap, "
                "the class names of the model's layers, e.g. ['Block']."
            )
        if policy is not None and self.shard is not None:
            raise ValueError("give auto_wrap_policy or shard, not both")

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules to shard as their own units, innermost first (FSDP2 needs a unit's
        inner units sharded before it)."""
        policy = self.auto_wrap_policy
        if policy is None or self.shard is not None:
            chosen = self.shard or (lambda m: any(True for _ in m.parameters()))
            return [child for child in model.children() if chosen(child)]
        if policy == "no_wrap":
            return []
        names = self.transformer_cls_names_to_wrap
        names = {names} if isinstance(names, str) else set(names or ())
        smallest = int(self.min_num_params or 100_000_000)  # HF's default for size_based_wrap
        found: list[nn.Module] = []
        inside: dict[int, int] = {}  # id(module) -> its parameters inside chosen units
        for module in reversed(list(model.modules())[1:]):  # children before their parents
            own = sum(p.numel() for p in module.parameters())
            free = own - sum(inside.get(id(c), 0) for c in module.children())
            if policy == "transformer_based_wrap":
                take = type(module).__name__ in names
            elif policy == "size_based_wrap":
                take = free >= smallest
            else:
                take = bool(policy(module=module, recurse=False, nonwrapped_numel=free))
            inside[id(module)] = own if take else own - free
            if take:
                found.append(module)
        return found


FSDPPlugin = FullyShardedDataParallelPlugin  # nbaccel's earlier name
