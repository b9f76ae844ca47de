"""DDP: every rank holds the whole model and all-reduces the gradients in backward.

What lesson 2 writes by hand: ``DistributedDataParallel`` broadcasts rank 0's weights when it
wraps the model, then averages each bucket of gradients over the ranks while backward is still
running, so every rank's optimizer takes the same step.

The step meter (``nbaccel.observe.meter``) learns when each bucket is ready from a communication
hook around torch's own all-reduce, registered at the first backward that syncs. DDP takes one hook:
a hook of the user's own, registered on the prepared model before then, replaces ours and is timed
the same way (``register_comm_hook`` of the prepared model wraps it). So is the hook that
``DistributedDataParallelKwargs(comm_hook=...)`` asks for, registered when the model is wrapped;
its other fields are ``DistributedDataParallel``'s own arguments (``handlers.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ...observe.meter import timed_allreduce
from .base import Strategy, trainable


class DDP(Strategy):
    """Replicate the model on every rank (gloo on CPUs, NCCL on GPUs)."""

    holds_sync = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._unhooked: list[DistributedDataParallel] = []  # no meter hook tried yet

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        # a frozen model (a teacher, an evaluator) has no gradients to reduce: left unwrapped
        if trainable(model) and not isinstance(model, DistributedDataParallel):
            ids = [self.device.index] if self.device.type == "cuda" else None
            handler = self.handlers.ddp if self.handlers is not None else None
            asked = handler.to_kwargs() if handler is not None else {}
            model = DistributedDataParallel(model, device_ids=ids, **asked)
            if self.meter is not None and self.meter.timing:
                self._unhooked.append(model)
                model.register_comm_hook = self._timing(model, model.register_comm_hook)
            hook = handler.comm_hook_for(model.process_group) if handler is not None else None
            if hook is not None:
                model.register_comm_hook(*hook)  # timed, when the meter times
        return super().prepare_model(model)

    def _timing(self, model: DistributedDataParallel, register: Any) -> Any:
        """``model.register_comm_hook`` for the user's own hook: it notes each bucket's
        readiness to the step meter, then runs the user's hook unchanged."""
        meter = self.meter

        def register_comm_hook(state: object, hook: Any) -> None:
            def timed(state, bucket):  # unannotated: DDP checks only annotations it finds
                meter.bucket_ready()
                return hook(state, bucket)

            # DDP logs the name, and checks it: bf16 hooks need CUDA with NCCL >= 2.10
            timed.__name__ = getattr(hook, "__name__", "hook")
            timed.__qualname__ = getattr(hook, "__qualname__", "hook")
            register(state, timed)
            if model in self._unhooked:
                self._unhooked.remove(model)

        return register_comm_hook

    def backward(self, loss: torch.Tensor, sync: bool, **kwargs: Any) -> None:
        if sync and self._unhooked:
            self._hook_gradient_sync()
        super().backward(loss, sync, **kwargs)

    def _hook_gradient_sync(self) -> None:
        """Register the meter's hook on the models that have none of the user's yet (one
        registered directly on the inner DDP, bypassing ours, is kept: torch refuses a second)."""
        for model in self._unhooked:
            with contextlib.suppress(RuntimeError):  # "can only be called once": the user's
                DistributedDataParallel.register_comm_hook(
                    model, self.meter.hook_state(model.process_group), timed_allreduce
                )
        self._unhooked.clear()

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
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

    def end(self, models: list[torch.nn.Module], leave_group: bool) -> None:
        # A DDP model that outlives its gloo group can deadlock when it is freed: its Reducer,
        # then the last owner of the group, tears the group down while holding the GIL that a
        # gloo thread is waiting for. Free the Reducers while the group lives, even when another
        # Accelerator will destroy the group later (its end cannot reach this one's models).
        for model in models:
            if isinstance(model, DistributedDataParallel):
                model.reducer = None
        super().end(models, leave_group)
