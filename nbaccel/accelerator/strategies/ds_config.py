"""ZeRO sharding through DeepSpeed's own engine; nbaccel adds no sharding of its own.

ZeRO stage 1 shards the optimizer state over the ranks, stage 2 the gradients too, stage 3 the
parameters too (gathered layer by layer when they are needed). Through the Accelerator the loop
does not change:

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

``prepare`` hands the model and the optimizer to ``deepspeed.initialize`` (so they must be
prepared in the same call) and returns the engine as the model. ``accumulate`` tells the
engine which micro-batch ends a window, and ``backward`` on that micro-batch also steps the
engine, as Accelerate's does: ``optimizer.step()`` and ``zero_grad()`` then do nothing.
Everything given to the Accelerator (accumulation steps, mixed precision, the DataLoader's
batch size) is written into the DeepSpeed config; a config that says otherwise is an error,
never silently overridden.

This module is DeepSpeed's side of the strategy in ``deepspeed`` (beside it): the plugin, the
config it becomes, importing and starting DeepSpeed quietly, and building its op.

DeepSpeed is an optional extra: ``pip install 'nbaccel[deepspeed]'``. On first use it compiles a
small C++ op (about a minute on 2 cores), cached under ``~/.cache/torch_extensions``;
``nbaccel build-ops`` builds it ahead of time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TAG = "deepspeed"  # the engine's checkpoint folder inside a save_state directory
INSTALL_HINT = (
    "DeepSpeed is not installed. Install the extra with the project's constraints: "
    "pip install -c constraints.txt 'nbaccel[deepspeed]' (or pip install deepspeed==0.19.8)."
)


@dataclass(frozen=True)
class DeepSpeedPlugin:
    """How ``Accelerator(deepspeed_plugin=...)`` trains with a DeepSpeed engine.

    Each setting may be given here or in ``config`` (a DeepSpeed config dict, or the path of a
    JSON file); given in both places it must agree.

    Args:
        zero_stage: 0 (plain data parallel), 1 (shard optimizer state), 2 (and gradients) or
            3 (and parameters). Default: the config's, else 2.
        offload_optimizer_device: ``"cpu"`` keeps the optimizer state and its step on the CPU
            (ZeRO-Offload; stages 1-3). Useful on GPUs only. Default ``"none"``.
        gradient_clipping: clip the global gradient norm to this inside the engine's step.
            Default: the config's, else no clipping (DeepSpeed's own default would be 1.0).
        config: more DeepSpeed settings, e.g. ``{"zero_optimization": {"overlap_comm": True}}``.
        hf_ds_config: HF Accelerate's name for ``config`` (also an object holding the dict in
            ``.config``, as transformers' ``HfDeepSpeedConfig`` does); give one of the two.
    """

    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    gradient_clipping: float | None = None
    config: Mapping[str, Any] | str | os.PathLike | None = field(default=None, repr=False)
    hf_ds_config: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.hf_ds_config is not None:
            if self.config is not None:
                raise ValueError(
                    "DeepSpeedPlugin got both config= and hf_ds_config= (HF Accelerate's name "
                    "for the same thing): give the DeepSpeed config once."
                )
            given = self.hf_ds_config
            given = given.config if isinstance(getattr(given, "config", None), dict) else given
            object.__setattr__(self, "config", given)
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.offload_optimizer_device not in (None, "none", "cpu"):
            raise ValueError(
                f"offload_optimizer_device={self.offload_optimizer_device!r} must be 'none' or "
                "'cpu' (NVMe offload needs a DeepSpeed config of its own: pass config=...)"
            )
        if self.gradient_clipping is not None and not self.gradient_clipping >= 0:
            raise ValueError(
                f"gradient_clipping={self.gradient_clipping!r} must be a norm >= 0 (0: off)"
            )


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed for ``device``'s kind (so ``cpu=True`` on a GPU machine stays on CPU)."""
    if sys.modules.get("deepspeed") is None:
        with _environment_kept():
            os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
            try:
                import deepspeed  # noqa: F401  (it reads DS_ACCELERATOR once, here)
            except ImportError as err:
                raise ImportError(INSTALL_HINT) from err
    _quiet_known_noise()  # also when the user imported DeepSpeed first
    return sys.modules["deepspeed"]


# What DeepSpeed prints while it starts that says nothing to a user of nbaccel: the result of
# probing for optional ops (a linker line per missing library) and of loading a cached op.
NOISE = ("cannot find -laio", "collect2: error: ld returned", "built successfully")


@functools.cache
def _quiet_known_noise() -> None:
    """Once per process: DeepSpeed's warning about the torch optimizers nbaccel lets it use,
    and torch's about two collectives it renamed, which DeepSpeed still calls."""
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: "untested optimizer" not in record.getMessage()
    )
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
        "deprecated",
    )


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """Remove the environment variables set inside the block (DeepSpeed's accelerator choice,
    and whatever its start-up sets)."""
    before = set(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - before:
            del os.environ[key]


@contextlib.contextmanager
def _own_tools_on_path() -> Iterator[None]:
    """Where PATH has no ``ninja``, put this interpreter's bin first on PATH inside the block.

    DeepSpeed loads its C++ op through torch, which runs ``ninja`` from PATH even when the op
    is cached. ninja is a pip package installed beside this interpreter, but a Jupyter kernel
    registered from a virtual environment runs without that environment's bin on PATH. A ninja
    already on PATH is left first: it is the one every other process here (HF Accelerate's
    DeepSpeed, say) runs, and two ninja versions rebuild the cached op each time the other one
    built it last (their logs disagree on the command lines): 35 s per start on 2 cores.
    """
    before = os.environ.get("PATH")
    if shutil.which("ninja", path=before) is not None:
        yield
        return
    own = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([own, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Run DeepSpeed's start-up with its probe noise removed from stdout and stderr, at the
    file-descriptor level (the compiler it probes with runs as a child process), with this
    environment's tools on PATH, and without the environment variables it leaves behind."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environment_kept())
        stack.enter_context(_own_tools_on_path())
        captured = {fd: stack.enter_context(tempfile.TemporaryFile()) for fd in (1, 2)}
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        try:
            for fd, file in captured.items():
                os.dup2(file.fileno(), fd)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, file in captured.items():
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
                file.seek(0)
                lines = file.read().decode(errors="replace").splitlines(keepends=True)
                kept = "".join(line for line in lines if not any(n in line for n in NOISE))
                if kept:
                    (sys.stdout if fd == 1 else sys.stderr).write(kept)


def build_config(
    plugin: DeepSpeedPlugin,
    *,
    mixed_precision: str,
    precision_given: bool,
    accumulation: int,
    device: torch.device,
) -> tuple[dict[str, Any], str, int]:
    """The DeepSpeed config for ``plugin`` and the Accelerator's settings.

    Returns ``(config, mixed_precision, gradient_accumulation_steps)``: the last two change only
    where the Accelerator kept its default and the config gives a value.
    """
    config = _read(plugin.config)
    zero = dict(config.get("zero_optimization") or {})

    def agree(name: str, mine: Any, theirs: Any, where: str) -> Any:
        if mine is not None and theirs not in (None, "auto") and mine != theirs:
            raise ValueError(
                f"{name}={mine!r} contradicts the DeepSpeed config's {where}={theirs!r}: give "
                "it in one place (the plugin or the config), or make them equal."
            )
        return theirs if mine is None and theirs not in (None, "auto") else mine

    stage = agree("zero_stage", plugin.zero_stage, zero.get("stage"), "zero_optimization.stage")
    zero["stage"] = 2 if stage is None else stage
    offload = (zero.get("offload_optimizer") or {}).get("device")
    offload = agree(
        "offload_optimizer_device",
        plugin.offload_optimizer_device,
        offload,
        "zero_optimization.offload_optimizer.device",
    )
    if offload not in (None, "none"):
        if zero["stage"] == 0:
            raise ValueError("offload_optimizer_device='cpu' needs zero_stage 1, 2 or 3")
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": offload}
        config.setdefault("zero_force_ds_cpu_optimizer", False)  # the user's torch optimizer
    config["zero_optimization"] = zero
    clip = agree(
        "gradient_clipping", plugin.gradient_clipping, config.get("gradient_clipping"), "value"
    )
    config["gradient_clipping"] = 0.0 if clip is None else float(clip)  # not DeepSpeed's 1.0

    theirs = [m for m in ("fp16", "bf16") if (config.get(m) or {}).get("enabled") is True]
    if len(theirs) > 1:
        raise ValueError("the DeepSpeed config enables both fp16 and bf16: choose one")
    if theirs and not precision_given:
        mixed_precision = theirs[0]
    elif theirs and theirs[0] != mixed_precision:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} contradicts the DeepSpeed config, which "
            f"enables {theirs[0]}: give it in one place, or make them equal."
        )
    if mixed_precision == "fp16" and device.type != "cuda":
        raise ValueError(
            "mixed_precision='fp16' under DeepSpeed needs a GPU (its loss scaler runs on "
            "CUDA); on CPU use mixed_precision='bf16'."
        )
    for mode in ("fp16", "bf16"):
        config[mode] = {**(config.get(mode) or {}), "enabled": mixed_precision == mode}

    steps = config.get("gradient_accumulation_steps")
    if steps not in (None, "auto"):
        if accumulation == 1:
            accumulation = int(steps)  # only the config gives it
        elif accumulation != steps:
            raise ValueError(
                f"gradient_accumulation_steps={accumulation} contradicts the DeepSpeed "
                f"config's {steps}: give it in one place, or make them equal."
            )
    config["gradient_accumulation_steps"] = accumulation
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    config.setdefault("zero_allow_untested_optimizer", True)  # any torch.optim optimizer
    config.setdefault("steps_per_print", 2**31 - 1)
    return config, mixed_precision, accumulation


def set_micro_batch(config: dict[str, Any], batch_size: int | None) -> None:
    """Fill in the per-rank batch size from the prepared DataLoader (``None``: none prepared)."""
    size = config.get("train_micro_batch_size_per_gpu")
    if size in (None, "auto"):
        config["train_micro_batch_size_per_gpu"] = batch_size or 1
    elif batch_size is not None and size != batch_size:
        raise ValueError(
            f"the DeepSpeed config's train_micro_batch_size_per_gpu={size} differs from the "
            f"prepared DataLoader's batch_size={batch_size}: drop it from the config (nbaccel "
            "fills it in) or make them equal."
        )


def cap_buckets(config: dict[str, Any], model: torch.nn.Module) -> None:
    """ZeRO 3 allocates its gradient-reduction bucket whole (DeepSpeed's default 5e8 elements:
    2 GB in float32) whatever the model's size; unless the config sets it, no bigger than the
    model's trainable parameter count."""
    zero = config["zero_optimization"]
    if zero.get("reduce_bucket_size") in (None, "auto"):
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        zero["reduce_bucket_size"] = max(1, min(500_000_000, numel))


def _read(source: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source)))  # a deep copy; the caller's stays unchanged
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"DeepSpeed config file {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config file {path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config file {path} must hold a JSON object")
    return data


#: Building DeepSpeed's op takes tens of seconds. torch's build lock (a FileBaton: an empty file,
#: no pid) that is older than this was left by a build that was interrupted (a kernel killed or
#: restarted mid-build), and every later DeepSpeed start waits for it forever.
STALE_LOCK_S = 300


def warn_stale_build_lock(name: str = "deepspeed_shm_comm") -> None:
    """Say so, before DeepSpeed starts, when its op's build lock looks abandoned."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        age = time.time() - os.stat(lock).st_mtime
    except Exception:  # no lock (the usual case), or torch moved its private helper
        return
    if age > STALE_LOCK_S:
        print(
            f"nbaccel: DeepSpeed's op build lock {lock} is {age / 60:.0f} min old: a build that "
            "was interrupted left it, and DeepSpeed waits for it forever. If no other process is "
            "building DeepSpeed's op now, delete that file and run this again.",
            file=sys.stderr,
            flush=True,
        )


def build_ops() -> None:
    """Compile (or find in torch's extension cache) the C++ op DeepSpeed loads on first use,
    so that the first training run does not wait for the compiler."""
    import_deepspeed(torch.device("cpu"))
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        with _own_tools_on_path():
            builder.load(verbose=False)
        print(f"nbaccel: DeepSpeed's {builder.absolute_name()} op is built and cached")
