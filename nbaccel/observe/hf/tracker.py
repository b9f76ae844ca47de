"""Live plots for Hugging Face Accelerate's own ``Accelerator``: ``LiveTracker``, a tracker for
Accelerate's tracker API, and ``LiveTracker.watch``, one line on every rank.

    from accelerate import Accelerator
    from nbaccel import LiveTracker

    accelerator = Accelerator(log_with=LiveTracker())
    accelerator.init_trackers("lesson")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader = LiveTracker.watch(accelerator, model, optimizer, loader)  # every rank (optional)
    for inputs, labels in loader:
        ...
        accelerator.log({"loss": loss.item()})
    accelerator.end_training()

**The tracker** draws what ``accelerator.log`` records. Accelerate calls trackers on its main
process only, so these are rank 0's records. Under ``notebook_launcher`` they reach the
notebook's live view through the same channel as nbaccel's own Accelerator; anywhere else
rank 0 draws them itself.

**The watch** (every rank, after ``prepare``) counts each rank's samples and optimizer steps and
times its loop, through public hooks only: a wrapper around the loader it returns (iterate that
one), a forward pre-hook on the prepared model, a step post-hook on the optimizer inside
Accelerate's, and, on a DDP model, a communication hook. Nothing of Accelerate's is patched, and
nothing changes a number it computes: the hooks only read clocks and count.

* **data**: inside the loader's ``next``, from asking for a batch to having it (on the device).
* **compute**: from the model's first training forward to the optimizer step's end (or, in a
  micro-batch of gradient accumulation, to the next batch asked for), minus communication.
* **communication** (DDP): from the last gradient bucket being ready to the last all-reduce
  being done (the hook chains a callback to each bucket's future). The hook runs torch's own
  ``allreduce_hook``, or the hook you register on the model after the watch
  (``model.register_comm_hook``, which the watch composes with). A hook Accelerate registered
  before the watch (``DistributedDataParallelKwargs(comm_hook=...)``) cannot be composed with:
  then, as under FSDP and DeepSpeed, communication is not measured apart and the panel says so.
* **other**: the rest of the loop (logging, evaluation, checkpoints).

On CUDA the watch counts samples and steps but times nothing (host clocks time only kernel
launches there); nbaccel's own Accelerator times CUDA with events.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

try:
    from accelerate.tracking import GeneralTracker
except ImportError as e:  # pragma: no cover - accelerate is in the notebook and test extras
    raise ImportError(
        "LiveTracker is a tracker for Hugging Face Accelerate, which is not installed here: "
        f"{sys.executable} -m pip install accelerate"
    ) from e

from ...env import DistEnv
from ...tensors import samples_in
from .. import stacks
from ..breakdown import Breakdown, for_device
from . import common


class LiveTracker(GeneralTracker):
    """Accelerate's ``Accelerator(log_with=LiveTracker())`` draws what ``accelerator.log``
    records (the main process's) in the launching notebook's live view, kept as ``Run``
    records. ``LiveTracker.watch(...)`` adds every rank's samples, steps and time breakdown.

    nbaccel's own Accelerator takes it too (the port back is one import), and draws what it
    logs on every rank already: there the tracker adds nothing.
    """

    name = "nbaccel"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "nbaccel") -> None:
        super().__init__()
        self.run_name = run_name
        self.in_nbaccel = False  # set by nbaccel's Accelerator, which records its log itself
        self._rank: int | None = None  # read at the first call, in the process that logs

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rank": None}  # a copy sent to a worker reads its own rank

    @property
    def tracker(self):
        """This process's ``Recorder`` (its ``run`` holds the records when no launcher does)."""
        return common.current()

    def _here(self) -> bool:
        # Accelerate calls trackers on its main process only; read the rank from the launch's
        # environment rather than through Accelerate's PartialState, which nbaccel's own
        # Accelerator has not set up.
        if self._rank is None:
            self._rank = DistEnv.from_environ().rank
        return self._rank == 0 and not self.in_nbaccel

    def store_init_configuration(self, values: dict) -> None:
        """The configuration is not drawn (a tracker such as TensorBoard keeps it)."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if self._here():
            common.recorder().log(common.numbers(values), step)

    def finish(self) -> None:
        if self._here():
            common.close()

    @staticmethod
    def watch(accelerator: Any, model: Any, optimizer: Any, dataloader: Any) -> Any:
        """Count and time this rank's loop (call it on every rank, after ``prepare``); returns
        the loader to iterate. See the module's docstring for what is timed, and how. A second
        watch of the same model and optimizer (a cell run again) replaces the first: nothing
        is counted twice."""
        return _watch(accelerator, model, optimizer, dataloader)


def _watch(accelerator: Any, model: Any, optimizer: Any, dataloader: Any) -> Any:
    if getattr(accelerator, "recorder", None) is not None:
        return dataloader  # nbaccel's own Accelerator counts and times its loop already
    # Watched again (a notebook cell run twice): the new watch replaces the old one, so every
    # sample and step is counted once, not once per watch.
    if isinstance(dataloader, _Watched):
        dataloader = dataloader.loader
    inner = _torch_optimizer(optimizer)
    for hooked in (model, inner):
        for handle in _hooks.pop(hooked, ()):
            handle.remove()
    device = accelerator.device
    recorder = common.recorder(device=device)
    if accelerator.gradient_accumulation_steps > 1:
        recorder.accumulation = accelerator.gradient_accumulation_steps
    breakdown = for_device(device) if device.type == "cpu" else None
    recorder.meter.time_with(breakdown)
    spans = _Spans(breakdown)
    _hooks[model] = [model.register_forward_pre_hook(spans.forward, prepend=True)]

    def stepped(*_: Any) -> None:
        spans.close()
        recorder.count(optimizer_steps=1)

    _hooks[inner] = [inner.register_step_post_hook(stepped)]
    distributed = accelerator.num_processes > 1
    if breakdown is not None and distributed and not _hook_ddp(model, spans):
        common.unmeasured(recorder, "communication")
    return _Watched(dataloader, recorder, spans)


_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model, optimizer: a watch's


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside what ``prepare`` returned, the one that steps and takes a step
    hook: Accelerate's wrapper holds it, and under DeepSpeed the wrapper holds the engine's ZeRO
    optimizer, which holds it in turn and steps it inside the engine's step."""
    inner = found = optimizer
    seen = {id(inner)}
    while id(getattr(inner, "optimizer", inner)) not in seen:  # a chain, never a loop
        inner = inner.optimizer
        seen.add(id(inner))
        if hasattr(inner, "register_step_post_hook"):
            found = inner  # the innermost: a wrapper's own hooks never run
    return found


class _Spans:
    """This rank's compute spans, timed from hooks (``Breakdown.add_span``)."""

    def __init__(self, breakdown: Breakdown | None) -> None:
        self.breakdown = breakdown
        self.opened: float | None = None
        self.ready: float | None = None  # the last gradient bucket ready in this span
        self.done: float | None = None  # the last all-reduce done (set on gloo's thread)

    def forward(self, module: Any, args: Any) -> None:
        opening = self.breakdown is not None and self.opened is None and module.training
        if opening and torch.is_grad_enabled():
            self.opened = self.breakdown.now()

    def bucket_ready(self) -> None:
        if self.breakdown is not None:
            stacks.waiting_in("DDP's gradient all_reduce")
            self.ready = self.breakdown.clock()

    def reduced(self) -> None:
        if self.breakdown is not None:
            self.done = self.breakdown.clock()

    def close(self) -> None:
        if self.opened is None:
            return
        end = self.breakdown.clock()
        waited = 0.0
        if self.ready is not None and self.done is not None:
            stacks.waiting_in(None)
            waited = max(0.0, min(self.done, end) - self.ready)
        self.breakdown.add_span(end - self.opened, waited)
        self.opened = self.ready = self.done = None


class _CommHook:
    """The state of DDP's one communication hook: the spans, and the hook it runs (torch's
    all-reduce, or one registered on the model after the watch)."""

    def __init__(self, spans: _Spans, group: Any) -> None:
        self.spans, self.group = spans, group
        self.hook: Any = None
        self.state: Any = None

    def register(self, state: Any, hook: Any) -> None:
        """The model's ``register_comm_hook`` after the watch: run ``hook`` inside the timing."""
        self.state, self.hook = state, hook

    def finished(self, future: Any) -> Any:
        self.spans.reduced()
        return future.value()


def _timed_hook(state, bucket):  # unannotated: DDP refuses any but its own types
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.spans.bucket_ready()
    if state.hook is None:
        future = allreduce_hook(state.group, bucket)
    else:
        future = state.hook(state.state, bucket)
    return future.then(state.finished)


def _hook_ddp(model: Any, spans: _Spans) -> bool:
    """Put the timing hook on a DDP model; False where it cannot be (not DDP, or a hook there
    already, which DDP cannot hand back to compose with)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    ours = getattr(model.__dict__.get("register_comm_hook"), "__self__", None)
    if isinstance(ours, _CommHook):  # an earlier watch's hook, which DDP keeps: it times these
        ours.spans = spans
        return True
    comm = _CommHook(spans, model.process_group)
    try:
        model.register_comm_hook(comm, _timed_hook)
    except RuntimeError:  # torch: a comm hook "can only be called once"
        return False
    model.register_comm_hook = comm.register  # a hook of yours, later, runs inside ours
    return True


class _Watched:
    """The loader the watch returns: the prepared one, with each batch counted and the wait for
    it timed. Everything else (``len``, ``set_epoch``, attributes) is the prepared loader's."""

    def __init__(self, loader: Any, recorder: Any, spans: _Spans) -> None:
        self.loader, self.recorder, self.spans = loader, recorder, spans

    def __iter__(self):
        breakdown = self.spans.breakdown
        batches = iter(self.loader)
        while True:
            self.spans.close()  # a micro-batch without an optimizer step ends here
            asked = breakdown.now() if breakdown is not None else None
            try:
                batch = next(batches)
            except StopIteration:
                break
            if asked is not None:
                breakdown.waited_for_data(asked)
            self.recorder.count(samples=samples_in(batch))
            yield batch
        self.recorder.epoch_done()

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
