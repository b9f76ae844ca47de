"""The Accelerator: one object that makes a plain PyTorch loop run on 1..N processes. Over 400
lines because it is the course's last lesson, one class read in one sitting: every public
method is defined here with its docstring, and the long work is in the modules named below.

Read this after lesson 4. Everything it does is something lesson 2 wrote out by hand, and each
method is written here or comes from one of these:

* ``__init__`` reads the launch's choices, joins the process group and picks a strategy, how
  the ranks share the model (``strategies/``: one process, DDP, FSDP2, DeepSpeed). What differs
  between back ends is asked of ``self.strategy``; nothing here asks which one it got.
* ``prepare`` hands models and optimizers to the strategy, and shards each DataLoader so every
  rank sees distinct samples (``data/``); ``backward`` and ``accumulate`` walk one accumulation
  window (``accumulation.py``).
* The process facts (``rank``, ``device``, ...), ``print``, the barriers, the ``on_*_process``
  decorators and the collectives (``gather``, ``reduce``, ...) come from the base class
  ``PartialState`` (``state.py``); the file methods (``save``, ``save_state``, ``load_state``,
  ...) hand their work to ``saving.py``, and ``log`` to ``tracking.py``.

No hidden globals: two Accelerators in one process share nothing, except what torch itself keeps
process-wide: the default process group (created by the first Accelerator that needs it, shared,
destroyed by the ``end_training`` of the last one alive: ``state.py``), the global RNGs, and
CUDA's current device; ``AcceleratorState()`` reads the newest live one (``current.py``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ..config import LaunchConfig, MixedPrecision, check_mode
from ..observe.meter import StepMeter
from ..observe.rank_recorder import Recorder
from ..observe.trackers.log_with import Trackers
from . import collectives, current, keywords, saving, tracking
from .accumulation import (
    AccumulationWindow,
    GradientAccumulationPlugin,
    MicroBatch,
    accumulation_plugin,
)
from .data import adapters
from .data.loader import LoopState, PreparedDataLoader
from .data.sharding import DataLoaderConfiguration, prepare_dataloader
from .handlers import AutocastKwargs, Handlers
from .join import join_uneven
from .memory_utils import release_memory
from .optim import AcceleratedOptimizer, AcceleratedScheduler
from .project import ProjectConfiguration
from .state import DistributedType, PartialState, process_env
from .strategies import DDP, choose
from .strategies.base import Strategy
from .strategies.ds_config import DeepSpeedPlugin  # DeepSpeed itself loads on demand
from .strategies.fsdp import FSDPPlugin

if TYPE_CHECKING:
    from ..observe.live.view import LiveView


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
        live: show the live view on the main process when no launcher listens (one process in
            a notebook, torchrun): the panel in a notebook, a progress line on stderr elsewhere,
            or your own ``LiveView``. Under ``notebook_launcher`` the notebook draws it anyway.
        fsdp_plugin: shard parameters, gradients and optimizer state over the ranks with
            PyTorch's FSDP2 instead of replicating them with DDP (``strategies/fsdp.py``). A
            launch with ``fsdp=True`` (``nbaccel launch --fsdp``) makes it the default.
        deepspeed_plugin: train through a DeepSpeed engine with ZeRO sharding
            (``strategies/deepspeed.py``). A launch with ``zero_stage=N`` (``nbaccel launch
            --deepspeed --zero-stage N``) makes ``DeepSpeedPlugin(zero_stage=N)`` the default.
        log_with: experiment trackers (``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``,
            a name given to ``register_tracker_class``, a list, or ``GeneralTracker`` objects:
            ``nbaccel.observe.trackers``), started by ``init_trackers``; ``log`` writes to them
            on the main process. Accelerate's other trackers (``"comet_ml"``, ...) are refused.
        project_dir, project_config: the run's folder, for the trackers' files and for
            checkpoints that name themselves (``project.ProjectConfiguration``).
        kwargs_handlers: Accelerate's ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``InitProcessGroupKwargs``, ``AutocastKwargs``, one of each (``handlers.py``).
        device_placement, split_batches, deepspeed_plugins, rng_types, dynamo_backend, ...:
            Accelerate's other keywords; ``keywords.py`` says which are honoured as there,
            which with a warning (``split_batches``) and which raise, and why.

    ``accelerator.state`` and ``accelerator.gradient_state`` are Accelerate's
    ``AcceleratorState`` and ``GradientState``, read from this Accelerator (``current.py``).
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
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        kwargs_handlers: list[Any] | None = None,
        *,
        device_placement: bool = True,
        split_batches: bool | None = None,
        deepspeed_plugins: Any = None,
        rng_types: list[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        **removed: Any,
    ) -> None:
        keywords.refuse_unknown(removed)  # Accelerate's removed ones, named with their new home
        keywords.refuse_engines(
            torch_tp_plugin,
            megatron_lm_plugin,
            parallelism_config,
            dynamo_backend,
            dynamo_plugin,
            rng_types,
        )
        deepspeed_plugin = keywords.one_deepspeed_plugin(deepspeed_plugin, deepspeed_plugins)
        dataloader_config = keywords.fold_split_batches(split_batches, dataloader_config)
        launch = LaunchConfig.from_environ()  # what notebook_launcher / nbaccel launch chose
        given = launch.mixed_precision if mixed_precision is None else mixed_precision
        precision_given = given is not None
        mixed_precision = check_mode("no" if given is None else given)
        plugin = accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
        self.dataloader_config = DataLoaderConfiguration.checked(dataloader_config)
        if not isinstance(step_scheduler_with_optimizer, bool):
            raise TypeError(f"{step_scheduler_with_optimizer=} must be True or False")
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_accumulation_plugin = plugin
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)  # the config's comes first
        self._registered: list[Any] = []  # register_for_checkpointing's objects
        self._state_hooks = saving.StateHooks()  # register_{save,load}_state_pre_hook's
        self._steps_before = 0  # optimizer steps of the run this one resumed
        self._trackers = Trackers(log_with, self.project_configuration.logging_dir)
        plugins, chosen, kind = choose(  # refused before joining the process group
            {"fsdp_plugin": fsdp_plugin, "deepspeed_plugin": deepspeed_plugin},
            launch,
            distributed=process_env().is_distributed,
        )
        self.fsdp_plugin = plugins["fsdp_plugin"]
        self.deepspeed_plugin = plugins["deepspeed_plugin"]
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self.handlers = Handlers.sorted(kwargs_handlers)
        self._distributed_type: DistributedType | None = None  # set through accelerator.state
        cpu = launch.cpu if cpu is None else cpu
        super().__init__(cpu=cpu, **self.handlers.asked("init"))  # rank, device, process group
        self._meter = StepMeter.for_device(self.device)  # the step's events: counts, time
        self._timed = self._meter.backward  # runs backward as a compute span (or untimed)
        try:
            self.strategy = kind(chosen, self, mixed_precision, precision_given, plugin)
            self.precision = self.strategy.precision
            self.recorder = Recorder(live=live, device=self.device, meter=self._meter)
            ddp, scales = isinstance(self.strategy, DDP), self.strategy.scales_losses
            self.handlers.check(self.distributed_type, ddp, self.mixed_precision, scales)
            keywords.check_placement(device_placement, self.device, "Accelerator()")
        except BaseException:
            self.destroy_process_group()  # nothing half-made outlives a refused Accelerator
            raise
        self._window = AccumulationWindow(self.strategy.accumulation_steps, plugin, self.recorder)
        self.run = self.recorder.run  # the records, kept here when no launcher listens
        self._loop = LoopState()
        self._micro_batch = MicroBatch(self._window, self._loop, self.strategy.no_sync, ())
        self._total_steps: int | None = None
        self.device_placement = device_placement
        self.rng_types = list(rng_types or ["generator"])
        current.register(self)  # AcceleratorState() and GradientState() find it

    # -- where this process stands: PartialState's names, and these ---------------------------
    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def state(self) -> current.AcceleratorState:
        """Accelerate's ``AcceleratorState``, a window onto this Accelerator's facts."""
        return current.AcceleratorState(_accelerator=self)

    @property
    def gradient_state(self) -> current.GradientState:
        """Accelerate's ``GradientState``: ``sync_gradients``, ``end_of_dataloader``, ..."""
        return current.GradientState(_accelerator=self)

    @property
    def distributed_type(self) -> DistributedType:
        """How the ranks train together. Assigning it (``accelerator.state.distributed_type =
        ...``, as Accelerate's tests do) changes what this Accelerator reports, not its back end."""
        if self._distributed_type is not None:
            return self._distributed_type
        return self.strategy.distributed_type or super().distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        self._distributed_type = DistributedType(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step. Assignable, as in Accelerate: the windows that
        open from then on have the new length (not under DeepSpeed, whose config fixed it)."""
        return self._window.steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        plugin = keywords.set_accumulation(self.strategy, self._window, value)
        self.gradient_accumulation_plugin = plugin

    @property
    def sync_gradients(self) -> bool:
        """False on the micro-batches of a window that only accumulate. Assignable, as in
        Accelerate (the next ``accumulate`` sets it again)."""
        return self._window.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._window.sync_gradients = bool(value)

    @property
    def step(self) -> int:
        """Micro-batches seen by ``accumulate`` in the current window's count."""
        return self._window.step

    @step.setter
    def step(self, value: int) -> None:
        self._window.step = value

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
        if "_reset_by" in self.__dict__:
            return super().__repr__()
        return (
            f"Accelerator(rank={self.rank}, num_processes={self.num_processes}, "
            f"device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )

    # -- prepare -------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers; return them in order.

        * ``nn.Module``: on ``device``, wrapped by the strategy (DDP with several processes);
          its forward runs under autocast with mixed precision (outputs come back float32).
        * ``Optimizer``: follows the accumulation window (``optim``): ``step()`` waits for its
          last micro-batch; with fp16 the GradScaler steps inside ``step()``. Under DeepSpeed
          ``backward`` steps the engine and ``step()`` does nothing, as in Accelerate.
        * ``DataLoader``: each rank gets ``batch_size`` distinct samples per step, on ``device``.
        * LR scheduler: steps only when its optimizer really stepped.
        * Anything else (None, a list, ...) comes back unchanged, as in Accelerate.

        ``device_placement``: one entry per object (``False`` keeps it where it is: see
        ``prepare_model``, ``prepare_data_loader``). What it prepared has
        ``_is_accelerate_prepared = True``, and preparing it again returns it as it is.
        """
        current.check_not_reset(self, "prepare()")
        deepspeed = self.distributed_type == DistributedType.DEEPSPEED
        placed = keywords.placements(args, device_placement, deepspeed)
        asked = dict(zip(map(id, args), placed, strict=True))
        prepared = self.strategy.prepare(args, lambda o: self._prepare_one(o, asked.get(id(o))))
        held = self._models, self._optimizers, self._schedulers, self._dataloaders
        keywords.mark_prepared(prepared, *held)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """``prepare`` for one model: on ``device``, wrapped by the strategy (DDP, FSDP2), its
        forward under autocast. ``evaluation_mode=True``: placed and autocast only, never
        wrapped, for a model that only evaluates. A model prepared before comes back as it is.
        ``device_placement=False`` is taken on the CPU only (elsewhere nbaccel places it)."""
        current.check_not_reset(self, "prepare_model()")
        if getattr(model, "_is_accelerate_prepared", False):
            return _kept(self._models, model)
        keywords.check_placement(device_placement, self.device, "prepare_model()")
        keywords.check_quantized(model, self.use_distributed)
        if evaluation_mode:  # what one process does: move, autocast; no DDP, no sharding
            prepared = Strategy.prepare_model(self.strategy, model)
        else:
            prepared = self.strategy.prepare_model(model)
        prepared._is_accelerate_prepared = True
        return _kept(self._models, prepared)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """``prepare`` for one optimizer: it follows the accumulation window (see ``prepare``).
        Prepare its model first (FSDP2 replaces the parameters)."""
        current.check_not_reset(self, "prepare_optimizer()")
        keywords.check_placement(device_placement, self.device, "prepare_optimizer()")
        if not isinstance(optimizer, AcceleratedOptimizer):
            optimizer = self.strategy.prepare_optimizer(optimizer, self._window)
        optimizer._is_accelerate_prepared = True
        return _kept(self._optimizers, optimizer)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """``prepare`` for one LR scheduler: it steps when its optimizer really stepped,
        ``num_processes`` times (once with ``split_batches``), as in Accelerate."""
        current.check_not_reset(self, "prepare_scheduler()")
        if not isinstance(scheduler, AcceleratedScheduler):
            batches = 1 if self.split_batches else self.num_processes
            per_step = batches if self.step_scheduler_with_optimizer else None
            scheduler = AcceleratedScheduler(scheduler, self._window, per_step)
        scheduler._is_accelerate_prepared = True
        return _kept(self._schedulers, scheduler)

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """``prepare`` for one DataLoader: this rank's shard, its batches on ``device`` unless
        ``device_placement=False``; ``slice_fn_for_dispatch`` cuts dispatched steps."""
        current.check_not_reset(self, "prepare_data_loader()")
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        placed = self.device_placement if device_placement is None else device_placement
        config, loop = self.dataloader_config, self._loop
        loader = prepare_dataloader(
            data_loader,
            self.env,
            self.device,
            config,
            loop,
            self.recorder,
            slice_fn=slice_fn_for_dispatch,
            device_placement=placed,
        )
        return _kept(self._dataloaders, loader)

    def _prepare_one(self, obj: Any, device_placement: bool | None = None) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement)
        if isinstance(obj, DataLoader | PreparedDataLoader):
            return self.prepare_data_loader(obj, device_placement)
        if isinstance(obj, _SCHEDULERS):
            return self.prepare_scheduler(obj)
        return obj  # as Accelerate: what it does not prepare passes through unchanged

    # -- the training step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by ``gradient_accumulation_steps`` and scaled for fp16:
        pass the loss of one micro-batch as it is, without dividing it yourself."""
        window = self._window
        if not window.sync_gradients:
            window.holds_gradients = True  # zero_grad keeps them until the window's step
        self._timed(self.strategy.backward, loss, window.sync_gradients, **kwargs)

    def accumulate(self, *models: torch.nn.Module) -> MicroBatch:
        """One micro-batch of a gradient-accumulation window.

        ``sync_gradients`` becomes True on every ``gradient_accumulation_steps``-th call and on
        the last batch of a prepared DataLoader; on the other calls DDP skips its all-reduce
        (``no_sync``) and the prepared optimizer's ``step()`` does nothing. The
        ``GradientAccumulationPlugin`` changes when windows end and sync.
        """
        if models and self.strategy.holds_sync:
            return MicroBatch(self._window, self._loop, self.strategy.no_sync, models)
        return self._micro_batch  # no no_sync to enter: one block serves every call

    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None):
        """Train or evaluate on batches that do not divide evenly among the ranks (torch's
        ``Join``: see ``join.py``). ``even_batches`` overrides the prepared loaders' setting
        inside the block; with even batches, or one process, it does nothing."""
        if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            if self.distributed_type != DistributedType.NO:  # as Accelerate: FSDP, DeepSpeed
                warnings.warn(
                    "join_uneven_inputs is only supported for multi-GPU (and multi-CPU) DDP "
                    f"training, not {self.distributed_type.value}: it has no effect here.",
                    stacklevel=2,
                )
            return contextlib.nullcontext()
        default = self.dataloader_config.even_batches
        return join_uneven(joinables, self._dataloaders, even_batches, default)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Make the next ``backward`` inside the block all-reduce, even inside ``no_sync`` or a
        mid-window ``accumulate`` (say, before an optimizer step that a loop takes early)."""
        return self.strategy.sync_in_backward(model)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce (FSDP's reduce-scatter) inside the block."""
        return self.strategy.no_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """Autocast for code outside a prepared model's forward (a no-op with ``"no"``);
        ``autocast_handler`` replaces the Accelerator's ``AutocastKwargs`` in the block."""
        asked = None if autocast_handler is None else autocast_handler.to_kwargs()
        return self.precision.autocast(asked)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        """Clip the accumulated gradient's norm; returns the norm before clipping.

        Only on the micro-batch that syncs (returns None on the others): clipping a partial
        sum would clip the wrong gradient. Unscales fp16 gradients first. Under DeepSpeed the
        engine clips inside the step that ``backward`` ran, at ``DeepSpeedPlugin(
        gradient_clipping=...)``: this checks that the norms agree and returns the norm the
        engine measured (a float), as Accelerate does.
        """
        if not self._unscaled_at_window_end():
            return None
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp each gradient element to ``[-clip_value, clip_value]`` on the syncing step."""
        if self._unscaled_at_window_end():
            self.strategy.clip_grad_value_(parameters, clip_value)

    def _unscaled_at_window_end(self) -> bool:
        if self.sync_gradients:
            self.precision.unscale_(*(o.optimizer for o in self._optimizers))
        return self.sync_gradients

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` per-sample values, dropping the repeats that topped up the last batch:
        over a prepared loader of ``n`` samples, exactly ``n`` rows. Non-tensor data (lists of
        strings, say) is gathered as Python objects, as with ``use_gather_object=True``."""
        if not self.use_distributed:
            return input_data
        with self._collective("gather_for_metrics"):
            return collectives.gather_for_metrics(input_data, self._loop, use_gather_object)

    # -- the live view and the experiment trackers (observe/: trackers/, rank_recorder.py) ----
    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: dict | None = None
    ) -> None:
        """Send numbers (floats, ints, 0-d tensors) to the live view, on every rank, and
        ``values`` to the trackers ``init_trackers`` started (strings too: TensorBoard text).

        ``step`` defaults, in the live view, to the number of earlier ``log`` calls on this
        rank; in the trackers, to the optimizer steps taken (counted on across ``load_state``).
        ``log_kwargs``: per tracker, ``{"wandb": {...}}``. Never blocks training.
        """
        tracking.log(self.recorder, self._trackers, values, step, log_kwargs, self._steps_before)

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the ``log_with`` trackers for a run named ``project_name`` (on the main
        process): each named one is made, then every one's ``start()`` opens its writer or run;
        then ``config``, the hyperparameters, is recorded. ``init_kwargs`` go to each
        library, e.g. ``{"wandb": {"entity": "me"}}``. Every rank may call it."""
        self._trackers.start(project_name, config, init_kwargs, self.is_main_process)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (``unwrap``: the library's own object: the
        SummaryWriter, the MLflow run, the wandb run); on other ranks one that does nothing."""
        return self._trackers.get(name, unwrap)

    tracker = property(lambda self: self.recorder, doc="``recorder``'s old name.")
    trackers = property(lambda self: list(self._trackers.started), doc="The started trackers.")

    @property
    def total_steps(self) -> int | None:
        """The batches the loop will take (e.g. ``epochs * len(loader)``): the progress line's
        total and ETA, counted as its steps are (batches; ``/ K`` if only optimizer steps log)."""
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int) -> None:
        self.recorder.accumulation = self.gradient_accumulation_steps
        self._total_steps = self.recorder.total_steps = value

    # -- models and files (the files' methods call saving.py) ------------------------------------
    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The user's own module inside DDP and ``torch.compile`` wrappers.

        Its ``state_dict()`` has no ``module.`` prefix, so it loads into a plain model.
        ``keep_fp32_wrapper=False`` also removes the autocast that ``prepare`` put on forward.
        ``keep_torch_compile`` (Accelerate's): when ``model`` itself is ``torch.compile``'s
        wrapper, return that wrapper with the bare module inside it (its ``_orig_mod``); False:
        the bare module.
        """
        inner = self.strategy.unwrap(model, keep_autocast=keep_fp32_wrapper)
        if not keep_torch_compile or "_orig_mod" not in getattr(model, "_modules", {}):
            return inner
        model._orig_mod = inner  # as Accelerate: the compiled wrapper, now round the bare module
        return model

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict, unsharded and without wrapper prefixes, on every rank
        (every rank must call it): it loads into the plain model. ``unwrap=False``: a DDP or
        ``torch.compile`` wrapper's own, keys prefixed ``module.`` or ``_orig_mod.``."""
        return saving.state_dict(self.strategy, model, unwrap)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` on the main process only, atomically (temporary file, then rename);
        ``safe_serialization=True`` writes a dict of tensors as safetensors instead.

        Sharded tensors (FSDP) and a DeepSpeed model's state dict (recognised by its keys) are
        gathered whole first, so every rank must call it then, as
        ``accelerator.save(accelerator.unwrap_model(model).state_dict(), path)`` is.
        """
        saving.save(self.strategy, obj, f, self.is_main_process, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save the unwrapped model's weights into ``save_directory`` by Hugging Face's names
        (``model.safetensors``, or ``pytorch_model.bin`` without ``safe_serialization``), in
        shards with an index beyond ``max_shard_size`` (bytes, or ``"5GB"``), for
        ``accelerate.load_checkpoint_in_model`` or ``from_pretrained``. Every rank calls it;
        the main process writes (``model_files.py``)."""
        main = self.is_main_process
        saving.save_model(
            self.strategy, model, save_directory, max_shard_size, safe_serialization, main
        )

    @property
    def project_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint takes at least."""
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Keep ``objects`` (anything with ``state_dict``/``load_state_dict``: an epoch counter,
        an EMA) in every ``save_state``, restored by ``load_state`` in this order."""
        self._registered.extend(saving.checkpointable(objects))

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The prepared ``dataloader``'s next pass without its first ``num_batches`` batches:
        after ``load_state``, the rest of the interrupted epoch, in the order it had. A torch
        DataLoader: one that skips them (``nbaccel.skip_first_batches``, as Accelerate's)."""
        return adapters.skip_first_batches(dataloader, num_batches)

    def register_save_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, weights, output_dir)`` in ``save_state`` before the models are
        written: the prepared models, their state dicts (remove one to leave it unsaved) and the
        folder being written (save your own files there). Returns a handle: ``.remove()``."""
        return self._state_hooks.add("save", hook)

    def register_load_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, input_dir)`` in ``load_state`` before the models are loaded
        (remove a model from the list to leave it as it is). Returns a handle: ``.remove()``."""
        return self._state_hooks.add("load", hook)

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Checkpoint models, optimizers, schedulers, scaler, RNG states, ``step``, the registered
        objects and where each prepared DataLoader stands; return the folder.

        Every rank must call it. The directory is replaced whole, or not at all. With no folder,
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it. Models go to
        ``model.safetensors``, ``model_1.safetensors``, ... (``model_<i>.pt`` with
        ``safe_serialization=False``).
        """
        self._trackers.flush()  # a resumed run's records go on from here, none missing
        held, steps = self._checkpointed(), self._steps_before + self.recorder.optimizer_steps
        return saving.save_state(
            held, output_dir, self, self.step, steps, safe_serialization, save_model_func_kwargs
        )

    def load_state(
        self,
        input_dir: str | os.PathLike | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Restore what ``save_state`` wrote, after preparing the same objects in the same order
        (with no folder: the newest complete automatic checkpoint).

        Raises ``CheckpointError`` (a ``ValueError``) for a missing, partial or corrupt
        checkpoint, before any object is changed. Files load with ``weights_only=True``;
        ``map_location`` (``"cpu"``, ``"on_device"``) is accepted, the states going where the
        prepared objects are.
        """
        held = self._checkpointed()
        self.step, steps = saving.load_state(
            held, input_dir, self.rank, load_kwargs, load_model_func_kwargs
        )
        self._steps_before = steps - self.recorder.optimizer_steps  # the trackers' count goes on

    def _checkpointed(self) -> saving.Checkpointed:
        return saving.Checkpointed(
            self.strategy,
            self.project_configuration,
            [self.unwrap_model(m, keep_torch_compile=False) for m in self._models],  # the user's
            [o.optimizer for o in self._optimizers],
            [s.scheduler for s in self._schedulers],
            self._dataloaders,
            self._registered,
            self.scaler,
            list(self._models),
            self._state_hooks,
        )

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget the prepared models, optimizers, schedulers and DataLoaders (and a DeepSpeed
        engine), set ``step`` to 0, collect garbage and empty the device's cache; returns
        ``objects`` as Nones, to assign back (``model, optimizer = accelerator.free_memory(
        model, optimizer)``): call it between two trainings with different models."""
        keywords.release_engine(self.strategy)  # a DeepSpeed engine: Accelerate destroys it too
        for held in (self._models, self._optimizers, self._schedulers, self._dataloaders):
            held.clear()
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[None]:
        """``free_memory``'s other name, as in Accelerate."""
        return self.free_memory(*objects)

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager:
        """Not here: Accelerate's ``torch.profiler`` context. nbaccel measures where a step's
        time goes on every step (``run.breakdown()``, the live view)."""
        raise NotImplementedError(
            "accelerator.profile() is Accelerate's torch.profiler context; nbaccel shows where "
            "time goes on every step (run.breakdown(), the live view). For a profiler trace, "
            "open torch.profiler.profile() around your loop yourself."
        )

    def end_training(self) -> None:
        """Send the last metrics, draw the final view, finish the trackers, and leave the
        process group: the last live Accelerator's call destroys it (safe to call twice)."""
        self.recorder.close()
        self._trackers.finish()
        self.destroy_process_group()
        current.forget(self)

    def destroy_process_group(self) -> None:
        strategy = self.__dict__.get("strategy")  # None when __init__ was refused early
        if strategy is None:
            return super().destroy_process_group()
        with self._leaving_group() as last:  # the last live Accelerator destroys the group
            strategy.end(self._models, leave_group=last)


_SCHEDULERS = (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau, AcceleratedScheduler)


def _kept(objects: list[Any], obj: Any) -> Any:
    """``obj``, remembered once among the Accelerator's prepared objects."""
    if not any(o is obj for o in objects):
        objects.append(obj)
    return obj
