"""The Accelerator: one object that makes a plain PyTorch loop run on 1..N processes.

Read this after lesson 4. Everything it does is something lesson 2 wrote out by hand:

* ``__init__`` reads the launcher's environment (``env.py``), picks the device, and joins the
  process group (gloo on CPU, NCCL on CUDA) when there are several processes.
* ``prepare`` moves the model to the device and wraps it in DDP, shards the DataLoader so each
  rank sees distinct samples (``data.py``), and wraps the optimizer so that gradient
  accumulation and fp16 loss scaling happen inside ``optimizer.step()``.
* ``backward`` divides the loss for accumulation and scales it for fp16 (``precision.py``).
* ``accumulate`` tells DDP to skip the all-reduce on all but the last micro-batch of a window.

No hidden globals: two Accelerators in one process share nothing, except what torch itself keeps
process-wide: the default process group (created by the first Accelerator that needs it and
destroyed by that one's ``end_training``), the global RNGs, and CUDA's current device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join, Joinable
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from . import checkpoint, utils, zero
from .data import (
    DataLoaderConfiguration,
    LoopState,
    PreparedDataLoader,
    ShardedBatchSampler,
    has_tensor,
    map_tensors,
    shard_dataloader,
)
from .display import LiveView
from .env import (
    DEEPSPEED_VAR,
    FSDP_VAR,
    MIXED_PRECISION_VAR,
    backend_for,
)
from .metrics import Run
from .optim import AcceleratedOptimizer, AcceleratedScheduler, GradientAccumulationPlugin
from .precision import MixedPrecision, Precision, check_mode
from .sharding import (
    FSDPPlugin,
    full_states,
    full_tensors,
    is_sharded,
    load_full_states,
    shard_model,
    swap_parameters,
)
from .state import DistributedType, PartialState
from .tracker import Tracker
from .utils import set_seed  # noqa: F401  (its old home; nbaccel.set_seed is the same)
from .zero import DeepSpeedOptimizer, DeepSpeedPlugin  # DeepSpeed itself loads on demand

logger = logging.getLogger(__name__)


class Accelerator(PartialState):
    """Device placement, DDP, mixed precision and gradient accumulation for a training loop.

    >>> accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    >>> accelerator.num_processes, accelerator.is_main_process
    (1, True)

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; ``None`` takes the launch default
            (``nbaccel launch --mixed-precision``, ``notebook_launcher(mixed_precision=...)``),
            else ``"no"``.
        gradient_accumulation_steps: micro-batches per optimizer step inside ``accumulate``.
        cpu: use the CPU even when a GPU is present; ``None`` takes the launch default
            (``nbaccel launch --cpu``, ``notebook_launcher(cpu=True)``), else False.
        live: without a launcher listening (one process in a notebook, or torchrun), show the
            live view on the main process: the panel in a notebook, a progress line on stderr
            elsewhere (or pass your own ``LiveView``). Under ``notebook_launcher`` the notebook
            draws it, whatever this says.
        fsdp_plugin: shard parameters, gradients and optimizer state over the ranks with
            PyTorch's FSDP2 instead of replicating them with DDP (``nbaccel.sharding``). A
            launch with ``fsdp=True`` (``nbaccel launch --fsdp``) makes it the default.
        deepspeed_plugin: train through a DeepSpeed engine with ZeRO sharding
            (``nbaccel.zero``). A launch with ``zero_stage=N`` (``nbaccel launch --deepspeed
            --zero-stage N``) makes ``DeepSpeedPlugin(zero_stage=N)`` the default.
    """

    def __init__(
        self,
        mixed_precision: MixedPrecision | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool | None = None,
        live: bool | LiveView = True,
        fsdp_plugin: FSDPPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        step_scheduler_with_optimizer: bool = True,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
    ) -> None:
        precision_given = mixed_precision is not None or bool(os.environ.get(MIXED_PRECISION_VAR))
        if mixed_precision is None:
            mixed_precision = os.environ.get(MIXED_PRECISION_VAR) or "no"  # type: ignore[assignment]
        check_mode(mixed_precision)
        if gradient_accumulation_plugin is not None:
            if not isinstance(gradient_accumulation_plugin, GradientAccumulationPlugin):
                raise TypeError(
                    f"gradient_accumulation_plugin={gradient_accumulation_plugin!r} must be a "
                    "nbaccel.utils.GradientAccumulationPlugin"
                )
            if gradient_accumulation_steps != 1:
                raise ValueError(
                    "give gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                    "(the plugin's num_steps is the number of steps)"
                )
            gradient_accumulation_steps = gradient_accumulation_plugin.num_steps
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if not isinstance(self.dataloader_config, DataLoaderConfiguration):
            raise TypeError(
                f"dataloader_config={dataloader_config!r} must be a "
                "nbaccel.utils.DataLoaderConfiguration"
            )
        if not isinstance(step_scheduler_with_optimizer, bool):
            raise TypeError(
                f"step_scheduler_with_optimizer={step_scheduler_with_optimizer!r} must be True "
                "or False"
            )
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(
            gradient_accumulation_steps, int
        ):
            raise TypeError(
                f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be an int "
                f"(got {type(gradient_accumulation_steps).__name__}), e.g. 4."
            )
        if gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps} must be a positive "
                "int; use 1 to step the optimizer on every batch."
            )
        self.gradient_accumulation_plugin = gradient_accumulation_plugin or (
            GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        )
        if fsdp_plugin is None and os.environ.get(FSDP_VAR) == "1":
            fsdp_plugin = FSDPPlugin()  # asked for by the launch (fsdp=True, --fsdp)
        if fsdp_plugin is not None and not isinstance(fsdp_plugin, FSDPPlugin):
            raise TypeError(f"fsdp_plugin={fsdp_plugin!r} must be an nbaccel.FSDPPlugin")
        if fsdp_plugin is not None and mixed_precision == "fp16":
            raise ValueError(
                "mixed_precision='fp16' with FSDP needs a sharded gradient scaler, which nbaccel "
                "does not provide yet; use mixed_precision='bf16' (no scaler needed) or DDP."
            )
        if deepspeed_plugin is None and os.environ.get(DEEPSPEED_VAR, "") != "":
            deepspeed_plugin = DeepSpeedPlugin(zero_stage=int(os.environ[DEEPSPEED_VAR]))
        if deepspeed_plugin is not None and not isinstance(deepspeed_plugin, DeepSpeedPlugin):
            raise TypeError(f"deepspeed_plugin={deepspeed_plugin!r} must be a DeepSpeedPlugin")
        if deepspeed_plugin is not None and fsdp_plugin is not None:
            raise ValueError(
                "both an FSDP and a DeepSpeed plugin were given (by argument or by the launch's "
                "fsdp/zero_stage options): choose one way to shard."
            )
        self.fsdp_plugin = fsdp_plugin
        self.deepspeed_plugin = deepspeed_plugin
        self._new_parameters: dict[int, torch.nn.Parameter] = {}  # replaced by FSDP sharding
        super().__init__(cpu=cpu)  # rank, device; joins the process group with several
        try:
            self._setup(mixed_precision, precision_given, gradient_accumulation_steps, live)
        except BaseException:
            self.destroy_process_group()  # nothing half-made outlives a refused Accelerator
            raise

    def _setup(self, mixed_precision, precision_given, gradient_accumulation_steps, live) -> None:
        deepspeed_plugin = self.deepspeed_plugin
        if deepspeed_plugin is not None and self.gradient_accumulation_plugin.sync_each_batch:
            raise ValueError(
                "GradientAccumulationPlugin(sync_each_batch=True) under DeepSpeed: the engine "
                "decides when gradients are reduced; leave sync_each_batch False."
            )
        self.deepspeed_config: dict[str, Any] | None = None  # the config the engine gets
        if deepspeed_plugin is not None:
            zero.import_deepspeed(self.device)  # an install hint now, not at prepare()
            self.deepspeed_config, mixed_precision, gradient_accumulation_steps = zero.build_config(
                deepspeed_plugin,
                mixed_precision=mixed_precision,
                precision_given=precision_given,
                accumulation=gradient_accumulation_steps,
                device=self.device,
            )
            if not dist.is_initialized():
                # DeepSpeed needs a process group even for one process: a private one, no port
                dist.init_process_group(
                    backend_for(self.device), store=dist.HashStore(), rank=0, world_size=1
                )
                self._owns_process_group = True
        self._set_local_rank = deepspeed_plugin is not None and "LOCAL_RANK" not in os.environ
        if self._set_local_rank:  # DeepSpeed reads it; end_training removes it again
            os.environ["LOCAL_RANK"] = str(self.env.local_rank)
        self.precision = Precision(mixed_precision, self.device)
        if deepspeed_plugin is not None:
            self.precision.scaler = None  # the engine scales fp16 losses itself
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.step = 0  # micro-batches seen by accumulate() in this window-aligned count
        self.sync_gradients = True  # False on the micro-batches that only accumulate
        # Metrics: to the launcher when one listens; otherwise kept here in ``run``.
        memory = self._max_memory_mb if self.device.type == "cuda" else None
        self.tracker = Tracker(live=live, memory=memory)
        self._total_steps: int | None = None
        self.run: Run | None = self.tracker.run
        if self.run is not None and self.run.device is None:  # a launcher's run says it already
            self.run.device = {"cpu": "CPU", "cuda": "GPU"}.get(self.device.type, self.device.type)
        self._loop = LoopState()
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._grads_pending = False  # gradients of a window that no optimizer step used yet
        self._engine: Any = None  # the DeepSpeed engine, once prepared
        self._triggered = False  # set_trigger since the last check_trigger
        self._unsynced: set[int] = set()  # ids of sharded models inside no_sync

    # -- where this process stands: PartialState's names, and these ---------------------------
    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def state(self) -> Accelerator:
        """Accelerate's ``accelerator.state`` (its ``AcceleratorState``): here the Accelerator
        holds those facts itself, so ``accelerator.state.num_processes`` works unchanged."""
        return self

    @property
    def distributed_type(self) -> DistributedType:
        if self.deepspeed_plugin is not None:
            return DistributedType.DEEPSPEED
        if self.fsdp_plugin is not None and self.use_distributed:
            return DistributedType.FSDP
        return super().distributed_type

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when fp16 found inf/NaN gradients and skipped the last real step."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        return (
            f"Accelerator(rank={self.rank}, num_processes={self.num_processes}, "
            f"device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )

    # -- prepare -------------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers; return them in order.

        * ``nn.Module``: moved to ``device``; wrapped in DDP when there are several processes;
          its forward runs under autocast with mixed precision (outputs come back float32).
        * ``Optimizer``: inside ``accumulate``, ``step()`` does nothing until the window's last
          micro-batch; ``zero_grad()`` is skipped only while a window holds gradients that no
          step has used, so ``backward; step; zero_grad`` and ``zero_grad; backward; step`` are
          both correct. With fp16 the GradScaler steps and updates inside ``step()``, and
          ``step_was_skipped`` says when inf/NaN gradients made it skip.
        * ``DataLoader``: each rank gets ``batch_size`` distinct samples per step (see
          ``nbaccel.data``), already on ``device``.
        * LR scheduler: steps only when its optimizer really stepped.
        """
        if self.deepspeed_plugin is not None:
            return self._prepare_deepspeed(objects)
        # models first: sharding replaces parameters that the optimizers must then point at
        prepared = list(objects)
        for i in sorted(
            range(len(objects)), key=lambda i: not isinstance(objects[i], torch.nn.Module)
        ):
            prepared[i] = self._prepare_one(objects[i])
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, AcceleratedOptimizer | AcceleratedScheduler | PreparedDataLoader):
            return obj
        if isinstance(obj, torch.nn.Module):
            return self._prepare_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            swap_parameters(obj, self._new_parameters)
            optimizer = AcceleratedOptimizer(obj, self)
            self._optimizers.append(optimizer)
            return optimizer
        if isinstance(obj, DataLoader):
            config = self.dataloader_config
            if config.use_seedable_sampler and config.data_seed is None and self.use_distributed:
                # every rank must shuffle alike, seeded by the user or not (Accelerate takes
                # each rank's own initial seed, so unseeded ranks would read different orders)
                seed = utils.broadcast_object_list([torch.initial_seed()])[0]
                config = dataclasses.replace(config, data_seed=seed)
            loader = shard_dataloader(obj, self.rank, self.num_processes, self._shared_seed, config)
            prepared = PreparedDataLoader(
                loader,
                self.device,
                self._loop,
                self.tracker.count,
                self.tracker.epoch_done,
                non_blocking=config.non_blocking,
            )
            self._dataloaders.append(prepared)
            return prepared
        if isinstance(obj, LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler = AcceleratedScheduler(obj, self)
            self._schedulers.append(scheduler)
            return scheduler
        raise TypeError(
            f"prepare() got a {type(obj).__module__}.{type(obj).__qualname__}; it prepares "
            "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and LR "
            "schedulers. Pass other objects around prepare(), unchanged."
        )

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        trainable = any(p.requires_grad for p in model.parameters())
        if self.fsdp_plugin and self.env.is_distributed and trainable and not is_sharded(model):
            before = {name: id(p) for name, p in model.named_parameters()}
            model = shard_model(model, self.fsdp_plugin, self.device, self.precision.dtype)
            after = dict(model.named_parameters())
            self._new_parameters.update({before[n]: after[n] for n in before if n in after})
            for optimizer in self._optimizers:  # prepared in an earlier call
                swap_parameters(optimizer.optimizer, self._new_parameters)
        elif (
            self.env.is_distributed and trainable and not isinstance(model, DistributedDataParallel)
        ):
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        if self.precision.dtype is not None and not self._sharded(model):
            model.forward = _AutocastForward(model.forward, self.precision)
        self._models.append(model)
        return model

    def _prepare_deepspeed(self, objects: tuple[Any, ...]) -> Any:
        """One ``deepspeed.initialize`` for the model and optimizer of this call."""
        models = [
            i
            for i, obj in enumerate(objects)
            if isinstance(obj, torch.nn.Module)
            and not zero.is_engine(obj)
            and any(p.requires_grad for p in obj.parameters())
        ]
        optimizers = [
            i
            for i, obj in enumerate(objects)
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer)
        ]
        if (models or optimizers) and (
            len(models) != 1 or len(optimizers) != 1 or self._engine is not None
        ):
            raise ValueError(
                "under DeepSpeed one model trains with one optimizer, prepared in the same call: "
                "accelerator.prepare(model, optimizer, loader, ...). This call has "
                f"{len(models)} trainable model(s) and {len(optimizers)} optimizer(s)"
                + (", and an engine was already prepared." if self._engine is not None else ".")
            )
        prepared = [
            obj if i in models or i in optimizers or zero.is_engine(obj) else self._prepare_one(obj)
            for i, obj in enumerate(objects)
        ]
        if models:
            loaders = [obj for obj in prepared if isinstance(obj, PreparedDataLoader)]
            assert self.deepspeed_config is not None
            zero.set_micro_batch(self.deepspeed_config, loaders[0].batch_size if loaders else None)
            zero.cap_buckets(self.deepspeed_config, objects[models[0]])
            deepspeed = zero.import_deepspeed(self.device)
            model, optimizer = objects[models[0]], objects[optimizers[0]]
            with zero.quiet_start():
                engine, *_ = deepspeed.initialize(
                    model=model.to(self.device), optimizer=optimizer, config=self.deepspeed_config
                )
            if self.precision.dtype is not None:  # 16-bit weights; float32 inputs and outputs
                engine.forward = _AutocastForward(engine.forward, self.precision)
            self._engine = engine
            self._models.append(engine)
            prepared[models[0]] = engine
            prepared[optimizers[0]] = DeepSpeedOptimizer(optimizer, self, engine)
            self._optimizers.append(prepared[optimizers[0]])
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _shared_seed(self) -> int:
        """Rank 0's draw from the global RNG, on every rank: one shuffle order for all."""
        seed = torch.empty((), dtype=torch.int64).random_()
        if self.env.is_distributed:
            seed = seed.to(self.device)
            dist.broadcast(seed, src=0)
        return int(seed.item())

    # -- the training step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by ``gradient_accumulation_steps`` and scaled for fp16.

        Pass the loss of one micro-batch as it is: do not divide it yourself.
        """
        if not self.sync_gradients:
            self._grads_pending = True
        if self._engine is not None:  # the engine divides by the accumulation steps itself
            self._engine.set_gradient_accumulation_boundary(self.sync_gradients)
            self._engine.backward(loss, **kwargs)
            return
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.precision.backward(loss, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch of a gradient-accumulation window.

        ``sync_gradients`` becomes True on every ``gradient_accumulation_steps``-th call and on
        the last batch of a prepared DataLoader; on the other calls DDP skips its all-reduce
        (``no_sync``) and the prepared optimizer's ``step()`` does nothing.
        ``GradientAccumulationPlugin(sync_each_batch=True)`` all-reduces on every call (less
        memory held, more traffic), ``sync_with_dataloader=False`` ignores the data's end.
        """
        plugin = self.gradient_accumulation_plugin
        if plugin.sync_with_dataloader and self._loop.end_of_dataloader:
            self.step = 0  # the next epoch starts a fresh window
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.gradient_accumulation_steps == 0
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients and not plugin.sync_each_batch:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None):
        """Train or evaluate on batches that do not divide evenly among the ranks.

        With ``even_batches=False`` (here, or in the ``DataLoaderConfiguration``) some ranks
        run out of batches first; torch's ``Join`` lets the others finish: the ranks that are
        done answer each all-reduce with zeros (so a late step's gradient is divided by all
        the ranks) and DDP copies the final weights to every rank at the end. ``even_batches``
        overrides the prepared loaders' setting inside the block. With even batches, or one
        process, it does nothing.
        """
        if not self.use_distributed:
            yield
            return
        samplers = [
            d.loader.batch_sampler
            for d in self._dataloaders
            if isinstance(d.loader.batch_sampler, ShardedBatchSampler)
        ]
        saved = [s.even_batches for s in samplers]
        if even_batches is not None:
            for sampler in samplers:
                sampler.even_batches = even_batches
        uneven = not (self.dataloader_config.even_batches if even_batches is None else even_batches)
        for joinable in joinables if uneven else ():
            if not isinstance(joinable, Joinable):
                raise TypeError(
                    f"join_uneven_inputs joins what torch's Join can (a DDP model, "
                    f"ZeroRedundancyOptimizer); got a {type(joinable).__name__}. FSDP and "
                    "DeepSpeed need even batches: use DataLoaderConfiguration(even_batches=True)."
                )
        try:
            with Join(joinables, enable=uneven, throw_on_early_termination=False):
                yield
        finally:
            for sampler, value in zip(samplers, saved, strict=True):
                sampler.even_batches = value

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Make the next ``backward`` inside the block all-reduce, even inside ``no_sync`` or a
        mid-window ``accumulate`` (say, before an optimizer step that a loop takes early)."""
        if self._sharded(model):
            model.set_requires_gradient_sync(True)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(id(model) not in self._unsynced)
            return
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])  # arm the reducer that no_sync left idle
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip DDP's gradient all-reduce (FSDP's reduce-scatter) inside the block."""
        if self._sharded(model):
            model.set_requires_gradient_sync(False)
            self._unsynced.add(id(model))
            try:
                yield
            finally:
                self._unsynced.discard(id(model))
                model.set_requires_gradient_sync(True)
            return
        context = model.no_sync() if isinstance(model, DistributedDataParallel) else None
        with context or contextlib.nullcontext():
            yield

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for code outside a prepared model's forward (a no-op with ``"no"``)."""
        return self.precision.autocast()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        """Clip the accumulated gradient's norm; returns the norm before clipping.

        Only on the micro-batch that syncs (returns None on the others): clipping a partial
        sum would clip the wrong gradient. Unscales fp16 gradients first.

        Under DeepSpeed the engine clips inside ``optimizer.step()`` at the norm given once in
        ``DeepSpeedPlugin(gradient_clipping=...)``; this call checks that it asks for the same
        norm and returns None.
        """
        if self._engine is not None:
            clip = self.deepspeed_config["gradient_clipping"] if self.deepspeed_config else 0.0
            if float(max_norm) != clip or norm_type != 2.0:
                now = f"at {clip}" if clip else "not at all (gradient_clipping unset)"
                raise ValueError(
                    f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) under "
                    f"DeepSpeed: the engine clips the 2-norm inside its step, here {now}. Give "
                    f"the norm once: DeepSpeedPlugin(gradient_clipping={max_norm})."
                )
            return None
        if not self.sync_gradients:
            return None
        for optimizer in self._optimizers:
            self.precision.unscale_(optimizer.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return full_tensors(norm) if self.fsdp_plugin else norm  # under FSDP: a DTensor

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp each gradient element to ``[-clip_value, clip_value]`` on the syncing step."""
        if self._engine is not None:
            raise ValueError(
                "clip_grad_value_ is not available under DeepSpeed (the engine owns the "
                "gradients); clip the norm instead: DeepSpeedPlugin(gradient_clipping=...)."
            )
        if not self.sync_gradients:
            return
        for optimizer in self._optimizers:
            self.precision.unscale_(optimizer.optimizer)
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- collectives (nbaccel.utils, on this Accelerator's process group) -----------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate each tensor across ranks along dim 0, in rank order (0-d tensors stack).

        Every rank must pass tensors of the same shape (else every rank raises a ``ValueError``
        naming each rank's shape); see ``pad_across_processes``.
        """
        return utils.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` per-sample values, dropping the repeats that topped up the last batch.

        Over a prepared loader of ``n`` samples this returns exactly ``n`` rows in total.
        Non-tensor data (lists of strings, say) is gathered as Python objects, as with
        ``use_gather_object=True``.
        """
        if not self.use_distributed:
            return input_data
        if has_tensor(input_data) and not use_gather_object:
            gathered = self.gather(input_data)
        else:
            listed = input_data if isinstance(input_data, list | tuple) else [input_data]
            gathered = utils.gather_object(listed)
        remainder = self._loop.remainder
        if self._loop.end_of_dataloader and remainder is not None:
            gathered = map_tensors(gathered, lambda t: t[:remainder], lists=True)
        return gathered

    def reduce(self, tensor: Any, reduction: utils.Reduction = "sum", scale: float = 1.0) -> Any:
        """Sum (the Accelerator's default, as in Accelerate), average, max or min each tensor
        across ranks; every rank gets the result."""
        return utils.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad each tensor along ``dim`` to the largest size on any rank, so it can be gathered."""
        return utils.pad_across_processes(tensor, dim, pad_index, pad_first)

    # -- one rank stops everyone (early stopping, a NaN loss) -----------------------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; the next ``check_trigger`` on every rank sees it."""
        self._triggered = True

    def check_trigger(self) -> bool:
        """True on every rank when any rank called ``set_trigger`` since the last check (the
        flags are then lowered). A collective: every rank must call it at the same point."""
        flag = utils.reduce(torch.tensor(float(self._triggered), device=self.device), "max")
        self._triggered = False
        return bool(flag.item())

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Send numbers (floats, ints, 0-d tensors) to the live view, on every rank.

        ``step`` defaults to the number of earlier ``log`` calls on this rank, which lines the
        ranks up. Never blocks training: values wait in a bounded buffer (drops are counted).
        """
        self.tracker.log(values, step)

    @property
    def total_steps(self) -> int | None:
        """Set it to the batches the loop will take (e.g. ``epochs * len(loader)``) and the
        progress line shows an ETA. The line counts optimizer steps, so with accumulation over
        K batches it shows ``total_steps / K`` (rounded up) as the total."""
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int) -> None:
        self._total_steps = value
        self.tracker.total_steps = -(-value // self.gradient_accumulation_steps)

    def _max_memory_mb(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**20

    # -- models and checkpoints ------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True):
        """The user's own module inside DDP and ``torch.compile`` wrappers.

        Its ``state_dict()`` has no ``module.`` prefix, so it loads into a plain model.
        ``keep_fp32_wrapper=False`` also removes the autocast that ``prepare`` put on forward.
        """
        while True:
            if zero.is_engine(model) or isinstance(
                model, DistributedDataParallel | torch.nn.DataParallel
            ):
                model = model.module
            elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
                model = model._orig_mod
            else:
                break
        if not keep_fp32_wrapper and isinstance(model.__dict__.get("forward"), _AutocastForward):
            del model.__dict__["forward"]
        return model

    def save(self, obj: Any, path: str | os.PathLike) -> None:
        """``torch.save`` on the main process only, atomically (temporary file, then rename).

        Sharded tensors (FSDP) and a DeepSpeed model's state dict (recognised by its keys) are
        gathered whole first, so every rank must call it then, as
        ``accelerator.save(accelerator.unwrap_model(model).state_dict(), path)`` is.
        """
        if self.fsdp_plugin is not None and self.env.is_distributed:
            obj = full_tensors(obj)
        if self._engine is not None:  # ZeRO 3 placeholders, bf16 copies: the whole float32
            obj = zero.consolidate(obj, self._engine)
        if self.is_main_process:
            checkpoint.atomic_save(obj, path)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's full state dict, unsharded and without wrapper prefixes, on every rank
        (every rank must call it): it loads into the plain model."""
        if zero.is_engine(model):
            return zero.full_state_dict(model)
        return full_tensors(self.unwrap_model(model).state_dict())

    def save_state(self, output_dir: str | os.PathLike | None = None) -> None:
        """Checkpoint models, optimizers, schedulers, scaler, RNG states and ``step``.

        Every rank must call it. The directory is replaced whole, or not at all.
        """
        output_dir = _checkpoint_dir(output_dir, "save_state")
        if self._engine is not None:  # its own sharded checkpoint, inside ours
            checkpoint.save_state(
                output_dir,
                models=[],
                optimizers=[],
                schedulers=[s.scheduler for s in self._schedulers],
                scaler=None,
                step=self.step,
                rank=self.rank,
                world_size=self.num_processes,
                barrier=self.wait_for_everyone,
                engine=lambda staging: self._engine.save_checkpoint(str(staging), tag=zero.TAG),
            )
            return
        models = [self.unwrap_model(m) for m in self._models]
        optimizers = [o.optimizer for o in self._optimizers]
        if any(self._sharded(m) for m in models):  # gathered whole: loadable without FSDP too
            models, optimizers = full_states(models, optimizers)
        checkpoint.save_state(
            output_dir,
            models=models,
            optimizers=optimizers,
            schedulers=[s.scheduler for s in self._schedulers],
            scaler=self.scaler,
            step=self.step,
            rank=self.rank,
            world_size=self.num_processes,
            barrier=self.wait_for_everyone,
        )

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """Restore what ``save_state`` wrote, after preparing the same objects in the same order.

        Raises ``CheckpointError`` (a ``ValueError``) for a missing, partial or corrupt
        checkpoint, before any object is changed. Files load with ``weights_only=True``.
        """
        input_dir = _checkpoint_dir(input_dir, "load_state")
        engine = self._engine
        models = [] if engine else [self.unwrap_model(m) for m in self._models]
        optimizers = [] if engine else [o.optimizer for o in self._optimizers]
        state = checkpoint.read_state(
            input_dir,
            models=models,
            optimizers=optimizers,
            schedulers=[s.scheduler for s in self._schedulers],
            scaler=self.scaler,
            rank=self.rank,
            engine=(zero.TAG, self.num_processes) if engine else None,
        )
        if engine is not None:
            engine.load_checkpoint(str(input_dir), tag=zero.TAG, load_lr_scheduler_states=False)
        model_states = [state[f"model_{i}.pt"] for i in range(len(models))]
        optimizer_states = [state[f"optimizer_{i}.pt"] for i in range(len(optimizers))]
        if any(self._sharded(m) for m in models):
            load_full_states(models, optimizers, model_states, optimizer_states)
        else:
            for model, model_state in zip(models, model_states, strict=True):
                model.load_state_dict(model_state)
            for optimizer, optimizer_state in zip(optimizers, optimizer_states, strict=True):
                optimizer.load_state_dict(optimizer_state)
        for i, scheduler in enumerate(self._schedulers):
            scheduler.scheduler.load_state_dict(state[f"scheduler_{i}.pt"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler.pt"])
        if f"rng_{self.rank}.pt" in state:
            checkpoint.set_rng_state(state[f"rng_{self.rank}.pt"])
        self.step = state["manifest"]["step"]

    def _sharded(self, model: torch.nn.Module) -> bool:
        # without a plugin nothing was sharded here: no FSDP lookup on the accumulation path
        return self.fsdp_plugin is not None and is_sharded(model)

    def end_training(self) -> None:
        """Send the last metrics, draw the final view, and destroy the process group this
        Accelerator created (safe to call twice)."""
        self.tracker.close()
        if self._owns_process_group and dist.is_initialized():
            # A DDP model that outlives its gloo group can deadlock when it is freed: its
            # Reducer, then the last owner of the group, tears the group down while holding the
            # GIL that a gloo thread is waiting for. Free the Reducers while the group lives.
            for model in self._models:
                if isinstance(model, DistributedDataParallel):
                    model.reducer = None
            if self._engine is not None:  # DeepSpeed's way also drops its cached groups
                zero.import_deepspeed(self.device).comm.destroy_process_group()
            else:
                dist.destroy_process_group()
        self._owns_process_group = False
        if self._set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
            self._set_local_rank = False


def _checkpoint_dir(folder: str | os.PathLike | None, method: str) -> str | os.PathLike:
    if folder is None:  # Accelerate's default needs a ProjectConfiguration, not here yet
        raise ValueError(
            f"{method}() needs a folder here, e.g. accelerator.{method}('checkpoints/epoch_3'): "
            "nbaccel does not name checkpoints automatically (Accelerate's project_config)."
        )
    return folder


class _AutocastForward:
    """A model's forward run under autocast, its floating outputs returned as float32."""

    def __init__(self, forward: Any, precision: Precision) -> None:
        self.forward, self.precision = forward, precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            out = self.forward(*args, **kwargs)
        return map_tensors(out, lambda t: t.float() if t.is_floating_point() else t)
