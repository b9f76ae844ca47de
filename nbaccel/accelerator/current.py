"""Accelerate's ``AcceleratorState`` and ``GradientState``, as windows onto an Accelerator.

In Accelerate these are process-wide singletons: every ``AcceleratorState()`` shares one
dictionary, which the first ``Accelerator()`` fills. nbaccel keeps each Accelerator's state in
the Accelerator itself (two never share it), so here both classes are *windows*: they hold no
fact of their own and read, on every access, the Accelerator they were made for.

How a window finds its Accelerator:

* ``accelerator.state`` and ``accelerator.gradient_state``: that Accelerator.
* ``AcceleratorState()`` and ``GradientState()``: the most recently created Accelerator of
  this process that is still live, looked up once, when the window is made. Live means created,
  not yet ended (``end_training``), not garbage, and not forgotten by ``_reset_state()``.
  This registry, ``_live``, is the one process-wide structure DESIGN.md allows besides the
  process group's holders (``state.py``): weak (it keeps no Accelerator alive, so nothing leaks
  from one test into the next) and read-only to everyone but the Accelerator's own
  ``__init__`` and ``end_training``.

With none: ``AcceleratorState()`` raises ``ValueError`` as Accelerate's does (there is no
state to read: create an ``Accelerator`` first); ``GradientState()`` reports what Accelerate's
reports before any Accelerator: gradients sync, no DataLoader is being iterated, one step.

With two: the newer one. They share only torch's process group (counted, ``state.py``); a window
of one never shows the other's precision, accumulation or DataLoaders. Write
``accelerator.state`` when you mean a particular one.

A window may be kept: it holds its Accelerator (an ordinary reference, as any object you keep
does), so ``state = AcceleratorState()`` stays valid while you hold it.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Protocol


class AcceleratorLike(Protocol):
    """What the windows read of an Accelerator by name (``accelerator.py``'s class, declared
    here, so this module does not import it); any other public name is read through."""

    mixed_precision: str
    device: Any
    distributed_type: Any  # assignable: what the Accelerator reports, not its back end
    backend: str | None
    num_processes: int
    process_index: int
    local_process_index: int
    deepspeed_plugin: Any
    gradient_accumulation_plugin: Any
    gradient_accumulation_steps: int
    sync_gradients: bool
    _loop: Any  # the prepared DataLoaders being iterated (``data/loader.py``'s LoopState)


#: The live Accelerators, oldest first (a dict keeps insertion order; its values are weak).
_live: weakref.WeakValueDictionary[int, AcceleratorLike] = weakref.WeakValueDictionary()


def register(accelerator: AcceleratorLike) -> None:
    """``accelerator`` is the newest live one (its ``__init__`` calls this last)."""
    _live.pop(id(accelerator), None)
    _live[id(accelerator)] = accelerator


def forget(accelerator: AcceleratorLike) -> None:
    """``accelerator`` ended: windows made from now on do not find it."""
    if _live.get(id(accelerator)) is accelerator:
        del _live[id(accelerator)]


def newest() -> AcceleratorLike | None:
    """The most recently created live Accelerator, or None."""
    accelerators = list(_live.values())
    return accelerators[-1] if accelerators else None


def check_not_reset(accelerator: AcceleratorLike, what: str) -> None:
    """Refuse ``what`` on an Accelerator that ``AcceleratorState._reset_state()`` forgot."""
    by = accelerator.__dict__.get("_reset_by")
    if by is not None:
        raise AttributeError(
            f"{what}: this Accelerator's `{by}` object has no attributes for you any more. "
            f"This happens if `{by}._reset_state()` was called after the Accelerator was "
            "made: create a new Accelerator() after the reset."
        )


# -- Accelerate's reset, on objects that are not singletons -----------------------------------
#: Where a state keeps the facts that a reset takes away (the process facts read from them).
_FACT_STORAGE = ("env", "device")


def forget_facts(state: Any, by: str) -> None:
    """``state`` (a ``PartialState`` or an Accelerator) answers no process fact from now on, as
    Accelerate's state after ``{by}._reset_state()``: the facts' storage is set aside, so reading
    ``num_processes``, ``device``, ... raises ``missing``'s error. Nothing else changes: its
    prepared objects, its hold on the process group and its ``end_training`` stay."""
    held = state.__dict__
    if "_reset_by" not in held:
        held["_forgotten"] = {name: held.pop(name) for name in _FACT_STORAGE if name in held}
        held["_reset_by"] = by


def forget_all(by: str | None = None) -> None:
    """Forget every live Accelerator: windows made from now on find none. With ``by``
    (``"AcceleratorState"``), their facts are forgotten too (``forget_facts``)."""
    for accelerator in list(_live.values()) if by is not None else ():
        forget_facts(accelerator, by)
    _live.clear()


def missing(state: Any, name: str) -> AttributeError:
    """The error for ``state.name`` that ordinary lookup did not find (``__getattr__``'s):
    Accelerate's words after a reset, else Python's own. A property that failed inside is run
    again so that its own error, the useful one, is raised instead."""
    by = state.__dict__.get("_reset_by")
    found = inspect.getattr_static(type(state), name, None)
    if by is not None and (name in _FACT_STORAGE or isinstance(found, property)):
        return AttributeError(
            f"`{by}` object has no attribute `{name}`. This happens if `{by}._reset_state()` "
            "was called and an `Accelerator` or `PartialState` was not reinitialized: create "
            "a new one after the reset, and use it instead."
        )
    if isinstance(found, property) and found.fget is not None:
        found.fget(state)  # raises the error that made ordinary lookup fail
    return AttributeError(f"'{type(state).__name__}' object has no attribute '{name}'")


class ResetMethod:
    """``_reset_state`` on the class (forget the live Accelerators) or, as Accelerate's tests
    call it, on an instance (that too, and the instance answers no process fact any more)."""

    def __get__(self, state: Any, owner: type) -> Any:
        def _reset_state() -> None:
            forget_all()
            if state is not None:
                forget_facts(state, "PartialState")

        return _reset_state


class SharedState:
    """Accelerate's ``_shared_state``, read: on the class, the newest live Accelerator's facts
    (``{}`` when none is live, as after a reset); on an instance, its own ({} once reset)."""

    def __get__(self, state: Any, owner: type) -> dict[str, Any]:
        source = newest() if state is None else state
        if source is None or source.__dict__.get("_reset_by"):
            return {}
        return {name: getattr(source, name) for name in _FACTS if hasattr(source, name)}


#: Accelerate's AcceleratorState fields for engines nbaccel does not drive: always these.
_ABSENT: dict[str, Any] = {
    "dynamo_plugin": None,
    "megatron_lm_plugin": None,
    "torch_tp_plugin": None,
    "parallelism_config": None,
    "device_mesh": None,
    "use_ipex": False,
    "initialized": True,
}


#: What ``AcceleratorState.__dict__`` shows: the facts Accelerate's state holds as data.
_FACTS = (
    "distributed_type",
    "num_processes",
    "process_index",
    "local_process_index",
    "device",
    "mixed_precision",
    "backend",
)


class AcceleratorState:
    """Accelerate's ``AcceleratorState``: the facts of one Accelerator, read through.

    ``num_processes``, ``process_index``, ``local_process_index``, ``device``,
    ``distributed_type``, ``mixed_precision``, ``deepspeed_plugin``, ``fsdp_plugin``,
    ``is_main_process``, ``wait_for_everyone``, ``print`` and every other public name are the
    Accelerator's own (see the module docstring for which Accelerator).

    >>> from nbaccel import Accelerator
    >>> accelerator = Accelerator(cpu=True, live=False)
    >>> AcceleratorState().num_processes, accelerator.state.mixed_precision
    (1, 'no')

    Args:
        mixed_precision, cpu: as in Accelerate, what the caller expects of the existing state:
            a different value raises ``ValueError`` (a live Accelerator's state cannot change;
            create the Accelerator with it). None: whatever it is. Accelerate's other
            arguments (``fsdp_plugin``, ``dynamo_plugin``, ...) are the Accelerator's too: any
            but None raises.
    """

    def __init__(
        self, mixed_precision: str | None = None, cpu: bool | None = None, **kwargs: Any
    ) -> None:
        accelerator = kwargs.pop("_accelerator", None) or newest()
        kwargs.pop("_from_accelerator", None)
        if accelerator is None:
            raise ValueError(
                "AcceleratorState() reads the Accelerator of this process, and none is live: "
                "create one first (accelerator = Accelerator()), then use AcceleratorState() "
                "or accelerator.state."
            )
        object.__setattr__(self, "_accelerator", accelerator)
        if mixed_precision is not None and mixed_precision != accelerator.mixed_precision:
            raise ValueError(_changed(f"mixed_precision={mixed_precision!r}", accelerator))
        if cpu and accelerator.device.type != "cpu":
            raise ValueError(_changed("cpu=True", accelerator))
        for name, value in kwargs.items():  # dynamo_plugin, fsdp_plugin, ...: Accelerator's
            if value is not None:
                raise ValueError(_changed(f"{name}=...", accelerator))

    _shared_state = SharedState()

    def __getattr__(self, name: str) -> Any:  # only names the class itself lacks
        if name in _ABSENT:
            return _ABSENT[name]
        accelerator = object.__getattribute__(self, "_accelerator")
        extras = accelerator.__dict__.get("_state_extras", {})
        if name in extras:
            return extras[name]
        if not name.startswith("_"):
            try:
                return getattr(accelerator, name)
            except AttributeError:
                if accelerator.__dict__.get("_reset_by"):
                    raise  # Accelerate's words: the state was reset
        raise AttributeError(f"'AcceleratorState' object has no attribute '{name}'") from None

    def __setattr__(self, name: str, value: Any) -> None:
        accelerator = self._accelerator
        if name == "distributed_type":
            accelerator.distributed_type = value  # what that Accelerator reports, from now
        elif name in _FACTS or name in _ABSENT or hasattr(type(accelerator), name):
            raise AttributeError(
                f"AcceleratorState.{name} cannot be assigned: the state is its Accelerator's, "
                "set when it was created. Pass the value to Accelerator(...) instead."
            )
        else:  # a name of your own, kept with the Accelerator: every window onto it sees it
            accelerator.__dict__.setdefault("_state_extras", {})[name] = value

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """The facts, as Accelerate's state keeps them in its ``__dict__`` (one dict, shared):
        so two windows onto equal states, an Accelerator's and its pickled copy's, compare equal
        by ``__dict__`` as Accelerate's do. The window's reference to its Accelerator is kept
        in the instance's own storage, which this property does not show."""
        return {name: getattr(self, name) for name in _FACTS}

    @property
    def deepspeed_plugins(self) -> dict[str, Any] | None:
        plugin = self._accelerator.deepspeed_plugin
        return None if plugin is None else {"default": plugin}

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget the live Accelerators, as Accelerate's reset forgets its shared state.

        Windows made afterwards find only Accelerators created afterwards, and the Accelerators
        made before answer no process fact (``accelerator.num_processes`` raises
        ``AttributeError``, as in Accelerate, whose state is gone) and refuse ``prepare``.
        Their prepared objects, their ``end_training`` and their hold on the process group
        stay (``state.py``). ``reset_partial_state`` is taken for Accelerate's signature:
        nbaccel's ``PartialState`` shares nothing, so there is nothing more to forget.
        """
        forget_all("AcceleratorState")

    def __repr__(self) -> str:
        a = self._accelerator
        backend = f"  Backend: {a.backend}" if a.backend else ""
        return (
            f"Distributed environment: {a.distributed_type.value}{backend}\n"
            f"Num processes: {a.num_processes}\nProcess index: {a.process_index}\n"
            f"Local process index: {a.local_process_index}\nDevice: {a.device}\n\n"
            f"Mixed precision type: {a.mixed_precision}\n"
        )


def _changed(flag: str, accelerator: AcceleratorLike) -> str:
    return (
        f"AcceleratorState({flag}) asks to change the live Accelerator's state "
        f"(mixed_precision={accelerator.mixed_precision!r}, device={accelerator.device}); "
        f"a state is fixed when its Accelerator is created: pass {flag} to Accelerator()."
    )


class GradientFacts:
    """``GradientState._shared_state``: what a ``GradientState()`` made now reports. Never
    empty: with no live Accelerator it reports Accelerate's defaults, so it is always what
    Accelerate calls initialized."""

    def __get__(self, window: Any, owner: type) -> dict[str, Any]:
        names = ("sync_gradients", "end_of_dataloader", "remainder", "num_steps")
        return {name: getattr(window or owner(), name) for name in names}


class GradientState:
    """Accelerate's ``GradientState``: where one Accelerator's accumulation and data loops are.

    ``sync_gradients``: this micro-batch ends an accumulation window (its step is real).
    ``active_dataloader``: the prepared DataLoader being iterated (the innermost, when one loop
    runs inside another), else None; ``in_dataloader``: whether there is one.
    ``end_of_dataloader``: its current batch is its last. ``remainder``: the real samples in
    the last global batch when it was topped up with repeats, else -1 (as Accelerate, -1
    outside a DataLoader; nbaccel knows it only on the last batch).
    ``num_steps``, ``adjust_scheduler``, ``sync_with_dataloader``, ``plugin_kwargs``: the
    Accelerator's ``GradientAccumulationPlugin`` (its values, where Accelerate's class reports
    ``adjust_scheduler=False`` for a default plugin).

    >>> GradientState(_accelerator=None).sync_gradients  # no Accelerator: Accelerate's defaults
    True
    """

    def __init__(self, gradient_accumulation_plugin: Any = None, **kwargs: Any) -> None:
        if kwargs.keys() - {"_accelerator"}:
            raise TypeError(f"GradientState takes gradient_accumulation_plugin; got {kwargs}")
        accelerator = kwargs["_accelerator"] if "_accelerator" in kwargs else newest()
        self._accelerator = accelerator
        if gradient_accumulation_plugin is not None and (
            accelerator is None
            or gradient_accumulation_plugin != accelerator.gradient_accumulation_plugin
        ):
            raise ValueError(
                "GradientState(gradient_accumulation_plugin=...) cannot set the plugin: it is "
                "the Accelerator's. Pass it as Accelerator(gradient_accumulation_plugin=...)."
            )

    @property
    def sync_gradients(self) -> bool:
        return True if self._accelerator is None else self._accelerator.sync_gradients

    def _frame(self) -> Any:
        if self._accelerator is None or not self._accelerator._loop.active:
            return None
        return self._accelerator._loop.active[-1]

    @property
    def active_dataloader(self) -> Any:
        return getattr(self._frame(), "loader", None)

    @property
    def in_dataloader(self) -> bool:
        return self._frame() is not None

    @property
    def end_of_dataloader(self) -> bool:
        frame = self._frame()
        return frame is not None and frame.end

    @property
    def remainder(self) -> int:
        frame = self._frame()
        return -1 if frame is None or frame.remainder is None else frame.remainder

    @property
    def _plugin(self) -> Any:
        return None if self._accelerator is None else self._accelerator.gradient_accumulation_plugin

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The plugin's fields that differ from their defaults (Accelerate's ``to_kwargs``)."""
        plugin = self._plugin
        if plugin is None:
            return {}
        fields = dataclasses.fields(plugin)
        return {f.name: v for f in fields if (v := getattr(plugin, f.name)) != f.default}

    @property
    def num_steps(self) -> int:
        return 1 if self._accelerator is None else self._accelerator.gradient_accumulation_steps

    @property
    def adjust_scheduler(self) -> bool:
        return True if self._plugin is None else self._plugin.adjust_scheduler

    @property
    def sync_with_dataloader(self) -> bool:
        return True if self._plugin is None else self._plugin.sync_with_dataloader

    _shared_state = GradientFacts()

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's: forget the shared state. A window holds none, so there is nothing to do;
        ``AcceleratorState._reset_state()`` forgets the Accelerators themselves."""

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )
