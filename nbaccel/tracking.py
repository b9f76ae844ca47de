"""Experiment trackers behind Accelerate's names: TensorBoard, MLflow and wandb, or your own.

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("mnist", config={"lr": 0.1})   # the hyperparameters, once
    accelerator.log({"loss": loss})          # the trackers, and the live view as before
    accelerator.end_training()               # finishes every tracker

Only the main process writes (a tracker with ``main_process_only = False`` is made on every
rank). ``step`` defaults to the optimizer steps taken so far. Each library is optional
(``pip install "nbaccel[trackers]"``); naming one that is not installed fails when the
Accelerator is made, not at the first ``log``. Where each one writes:

* ``"tensorboard"``: ``<logging_dir>/<project_name>``, scalars, text and the config as
  TensorBoard's hyperparameters (``%tensorboard --logdir <logging_dir>`` shows them).
* ``"mlflow"``: ``MLFLOW_TRACKING_URI`` when set, else a local store ``<project_dir>/mlflow.db``
  (its UI comes with the full ``mlflow`` package, not ``mlflow-skinny``: ``mlflow ui
  --backend-store-uri sqlite:///<project_dir>/mlflow.db``); an experiment named after the
  project, one run per ``init_trackers``, the config as parameters; metrics are queued to a
  background thread.
* ``"wandb"``: ``WANDB_MODE`` as set; without it and without an API key it logs offline under
  ``<project_dir>/wandb`` and says so (``wandb sync`` uploads it later).

Your own: subclass ``GeneralTracker`` (a ``name``, ``requires_logging_directory``, a
``tracker`` property, ``store_init_configuration``, ``log``, ``finish``) and pass an instance.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import json
import netrc
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .env import DistEnv


class LoggerType(str, enum.Enum):
    """The trackers ``log_with`` names (Accelerate's enum; its members equal the strings)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"


def on_main_process(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a tracker's method on the main process only (unless its ``main_process_only`` is
    False): Accelerate's decorator of this name, for trackers written for it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "main_process_only", True) or DistEnv.from_environ().rank == 0:
            return method(self, *args, **kwargs)
        return None

    return wrapper


class GeneralTracker:
    """What every tracker does; subclass it for your own (every method may be left as is)."""

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:  # Accelerate's signature
        pass

    @property
    def tracker(self) -> Any:
        """The library's own object (``get_tracker(name, unwrap=True)`` returns it)."""
        return None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters, once, at ``init_trackers``."""

    def log(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Write what is left and close (``end_training`` calls it)."""


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files under ``logging_dir/run_name`` (torch's SummaryWriter)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self.writer._get_file_writer()  # in this run, not a folder of its own
        for summary in hparams(_flat(values), {}):
            writer.add_summary(summary)
        self.writer.add_text("config", f"```\n{json.dumps(values, indent=2, default=str)}\n```")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, dict(value), global_step=step, **kwargs)
            else:
                self.writer.add_scalar(key, value, global_step=step, **kwargs)

    def finish(self) -> None:
        self.writer.close()


class MLflowTracker(GeneralTracker):
    """One MLflow run in the experiment ``experiment_name``, written through a client of its
    own: the process's ``mlflow`` defaults (tracking URI, active run) are left as they were."""

    name = "mlflow"

    def __init__(
        self,
        experiment_name: str,
        logging_dir: str | os.PathLike | None = None,
        run_name: str | None = None,
        tags: dict[str, Any] | None = None,
    ) -> None:
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            folder = Path(logging_dir or ".").resolve()
            folder.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is None:
            experiment_id = self.client.create_experiment(experiment_name, artifacts)
        else:
            experiment_id = experiment.experiment_id
        self.run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = self.run.info.run_id
        self.tracking_uri = uri

    @property
    def tracker(self) -> Any:
        return self.client

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(values).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now, step or 0)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if metrics:  # queued: a background thread batches them to the store
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)  # waits for the queued metrics first


class WandBTracker(GeneralTracker):
    """A wandb run; offline, and said so, when no API key is at hand and ``WANDB_MODE`` is
    unset. ``finish`` also stops wandb's service process."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike | None = None, **kwargs: Any
    ) -> None:
        import wandb

        if logging_dir is not None:
            Path(logging_dir).mkdir(parents=True, exist_ok=True)
            kwargs.setdefault("dir", str(logging_dir))
        if "mode" not in kwargs and not os.environ.get("WANDB_MODE") and not _wandb_key():
            kwargs["mode"] = "offline"
            where = Path(kwargs.get("dir", ".")) / "wandb"
            print(
                f"wandb: no API key found (WANDB_API_KEY, `wandb login`), so this run is logged "
                f"offline under {where}; upload it later with `wandb sync {where}/offline-run-*`",
                file=sys.stderr,
            )
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        self.run.log(dict(values), step=step, **kwargs)

    def finish(self) -> None:
        import wandb

        self.run.finish()
        if wandb.run is None:  # no other run of this process needs wandb's service process
            wandb.teardown()


# name -> (class, the module that must be importable, what to install)
BUILT_IN: dict[str, tuple[type[GeneralTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "mlflow": (MLflowTracker, "mlflow", "mlflow-skinny sqlalchemy alembic"),
    "wandb": (WandBTracker, "wandb", "wandb"),
}


def installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve(log_with: Any, logging_dir: str | os.PathLike | None) -> list[str | GeneralTracker]:
    """The trackers ``log_with`` asks for: names checked (installed, a folder where one is
    needed) and objects as given. Raised here, when the Accelerator is made."""
    if log_with is None:
        return []
    asked = list(log_with) if isinstance(log_with, list | tuple) else [log_with]
    chosen: list[str | GeneralTracker] = []
    for item in asked:
        if isinstance(item, GeneralTracker):
            chosen.append(item)
            continue
        name = item.value if isinstance(item, LoggerType) else item
        if name == "all":
            chosen += [n for n, (_, module, _) in BUILT_IN.items() if installed(module)]
            if not chosen:
                raise ImportError(f'log_with="all" found no tracker installed. {_install()}')
            continue
        if not isinstance(name, str) or name not in BUILT_IN:
            raise ValueError(
                f"log_with={item!r}: the trackers are {', '.join(map(repr, BUILT_IN))}, 'all', "
                "or a nbaccel.tracking.GeneralTracker instance of your own."
            )
        if not installed(BUILT_IN[name][1]):
            raise ImportError(
                f'log_with="{name}" needs the {BUILT_IN[name][1]} package, which is not '
                f"installed here. {_install(BUILT_IN[name][2])}"
            )
        chosen.append(name)
    for name in chosen:
        needs = BUILT_IN[name][0] if isinstance(name, str) else name
        if needs.requires_logging_directory and logging_dir is None and isinstance(name, str):
            raise ValueError(
                f'log_with="{name}" writes files: give the Accelerator a folder for them, '
                f'e.g. Accelerator(log_with="{name}", project_dir="runs").'
            )
    return list(dict.fromkeys(chosen))  # each once, in the order asked


class Trackers:
    """One Accelerator's trackers: checked when it is made, started by ``init_trackers``."""

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None) -> None:
        self.chosen = resolve(log_with, logging_dir)
        self.logging_dir, self.is_main = logging_dir, True
        self.started: list[GeneralTracker] = []

    def start(
        self,
        project_name: str,
        config: dict[str, Any] | None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None,
        is_main: bool,
    ) -> None:
        self.finish()  # a second init_trackers starts new runs
        init_kwargs, self.is_main = init_kwargs or {}, is_main
        for item in self.chosen:
            if isinstance(item, GeneralTracker):
                if self.is_main or not item.main_process_only:
                    self.started.append(item)
                continue
            cls = BUILT_IN[item][0]
            if self.is_main or not cls.main_process_only:
                kwargs = dict(init_kwargs.get(item, {}))
                self.started.append(cls(project_name, self.logging_dir, **kwargs))
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(dict(config))

    def log(
        self, values: Mapping[str, Any], step: int, log_kwargs: Mapping[str, Any] | None
    ) -> None:
        if not self.started:
            return
        plain = {k: v.item() if hasattr(v, "item") else v for k, v in values.items()}
        for tracker in self.started:
            tracker.log(plain, step, **dict((log_kwargs or {}).get(tracker.name, {})))

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main:  # nothing is written here: a tracker that does nothing
            return GeneralTracker()
        names = [t.name for t in self.started] or ["none: call init_trackers first"]
        raise ValueError(f"no tracker named {name!r}; started: {', '.join(names)}")

    def finish(self) -> None:
        started, self.started = self.started, []
        for tracker in started:
            tracker.finish()


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a/b`` keys; values that are not numbers, strings or bools as text."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}/"))
        elif isinstance(value, bool | int | float | str):
            flat[f"{prefix}{key}"] = value
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _install(packages: str = "") -> str:
    extra = f" (or only this one: {sys.executable} -m pip install {packages})" if packages else ""
    return f'Install the trackers with: {sys.executable} -m pip install "nbaccel[trackers]"{extra}'
