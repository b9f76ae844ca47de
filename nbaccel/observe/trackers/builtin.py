"""The built-in experiment trackers, behind Accelerate's names: TensorBoard, MLflow and wandb.

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("mnist", config={"lr": 0.1})   # the hyperparameters, once
    accelerator.log({"loss": loss})          # the trackers, and the live view as before
    accelerator.end_training()               # finishes every tracker

Each is made in two steps, as in Accelerate 1.x: the constructor only keeps its arguments, and
``start()`` (called by ``init_trackers``, on the main process) opens the writer or run, so a
tracker made before the Accelerator touches no process state. Only the main process writes (a
tracker with ``main_process_only = False``: every rank). ``step`` defaults to the optimizer
steps taken. Each library is optional (``pip install
"nbaccel[trackers]"``): a missing one fails when the Accelerator is made. Where they write:

* ``"tensorboard"``: ``<logging_dir>/<project_name>``, scalars, text and the config as
  TensorBoard's hyperparameters (``%tensorboard --logdir <logging_dir>`` shows them).
* ``"mlflow"``: ``MLFLOW_TRACKING_URI`` when set, else a local store ``<project_dir>/mlflow.db``
  (its UI comes with the full ``mlflow`` package, not ``mlflow-skinny``: ``mlflow ui
  --backend-store-uri sqlite:///<project_dir>/mlflow.db``); an experiment named after the
  project, one run per ``init_trackers``, the config as parameters; metrics are queued to a
  background thread.
* ``"wandb"``: ``WANDB_MODE`` as set; without it and without an API key it logs offline under
  ``<project_dir>/wandb`` and says so (``wandb sync`` uploads it later).

The built-in ones keep numbers back and write them once a second (and at ``save_state`` and
``end_training``): a process that is killed loses at most its last second of them. Your own:
subclass ``GeneralTracker`` (``general``) and pass an instance, or register the class by
name (``registry.register_tracker_class``).
"""

from __future__ import annotations

import json
import netrc
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .general import GeneralTracker

FLUSH_SECONDS = 1.0  # how long the built-in trackers keep numbers back, to write them together


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files under ``logging_dir/run_name`` (torch's SummaryWriter).

    Numbers are kept back and written once a second, one event per step with all its numbers:
    an event written per number costs TensorBoard's pure-Python file layer hundreds of
    microseconds (``benchmarks/results/trackers-cpu.md``). Text and dicts are written at once.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        self.run_name, self.logging_dir_param = run_name, logging_dir  # Accelerate's names
        self.logging_dir = Path(logging_dir) / run_name
        self.init_kwargs = {"max_queue": 1000, **kwargs}  # a second's events go in at once
        self.writer: Any = None  # made by start()
        self._pending: list[tuple[int | None, dict[str, float], float]] = []
        self._due = time.monotonic() + FLUSH_SECONDS

    def start(self) -> None:
        """Open the event file (``init_trackers`` calls this; a second call keeps the first)."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.logging_dir), **self.init_kwargs)
            self._due = time.monotonic() + FLUSH_SECONDS

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

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers = {}
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, dict(value), global_step=step, **kwargs)
            elif kwargs:  # add_scalar's own options (new_style=, ...): its own event
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            else:
                numbers[key] = float(value)
        if numbers:
            self._pending.append((step, numbers, time.time()))
        if time.monotonic() >= self._due:
            self._write_pending()

    def _write_pending(self) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self.writer._get_file_writer()
        pending, self._pending = self._pending, []
        for step, numbers, walltime in pending:
            values = [Summary.Value(tag=k, simple_value=v) for k, v in numbers.items()]
            writer.add_summary(Summary(value=values), step, walltime)
        self._due = time.monotonic() + FLUSH_SECONDS

    def flush(self) -> None:
        if self.writer is not None:
            self._write_pending()
            self.writer.flush()  # on disk when it returns

    def finish(self) -> None:
        if self.writer is not None:
            self._write_pending()
            self.writer.close()
            self.writer = None  # start() opens a new file


class MLflowTracker(GeneralTracker):
    """One MLflow run in the experiment ``experiment_name``, written through a client of its
    own: the process's ``mlflow`` defaults (tracking URI, active run) are left as they were.

    Accelerate's arguments, and its environment variables, which win over them:
    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID`` (go on with that run), ``MLFLOW_TAGS`` (JSON)
    and ``MLFLOW_NESTED_RUN`` (a run under the process's active ``mlflow`` run). A parameter
    longer than MLflow takes (6000 characters) is left out, with a warning, as Accelerate does.
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | str | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.run_id = self._resume = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = _as_bool(nested, "MLFLOW_NESTED_RUN / nested_run")
        self.run_name, self.description = run_name, description
        self.client: Any = None  # made by start()
        self.active_run: Any = None  # the run (mlflow.entities.Run), as in Accelerate
        self.tracking_uri: str | None = None
        self._pending: list[Any] = []  # Metric entities, sent together once a second
        self._due = time.monotonic() + FLUSH_SECONDS

    def start(self) -> None:
        """Open the experiment and start (or go on with) the run."""
        if self.client is not None:
            return
        import mlflow
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            folder = Path(self.logging_dir or ".").resolve()
            folder.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri()
        client = MlflowClient(tracking_uri=uri)
        given = {k: str(v) for k, v in (self.tags or {}).items()}  # the experiment's, the run's
        tags = {**given, "mlflow.note.content": self.description} if self.description else given
        if self.run_id is not None:  # resumed: running again, its other facts as they were
            client.update_run(self.run_id, status="RUNNING")
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
        else:
            name = self.experiment_name or "Default"
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                experiment_id = client.create_experiment(name, artifacts, tags=given or None)
            else:
                experiment_id = experiment.experiment_id
            parent = mlflow.active_run() if self.nested_run else None
            if parent is not None:
                tags = {**tags, "mlflow.parentRunId": parent.info.run_id}
            run = client.create_run(experiment_id, run_name=self.run_name, tags=tags or None)
            self.run_id = run.info.run_id
        self.client, self.tracking_uri = client, uri
        self.active_run = client.get_run(self.run_id)
        self._due = time.monotonic() + FLUSH_SECONDS

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = []
        for key, value in _flat(values).items():
            if len(str(value)) > 6000:  # MLflow's longest parameter value
                warnings.warn(
                    f"mlflow: the parameter {key!r} is {len(str(value))} characters long, and "
                    "MLflow takes at most 6000, so it is left out of the run's parameters.",
                    stacklevel=2,
                )
            else:
                params.append(Param(key, str(value)))
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Keep the numbers back (others are not MLflow metrics, and are left out); they are
        sent once a second, or now with ``synchronous=True``. ``kwargs``: ``mlflow.log_metrics``'
        ``synchronous`` and ``timestamp`` (``log_kwargs={"mlflow": {...}}``)."""
        from mlflow.entities import Metric

        synchronous, now = kwargs.pop("synchronous", None), kwargs.pop("timestamp", None)
        if kwargs:
            raise TypeError(
                f"MLflowTracker.log got {sorted(kwargs)}: it takes synchronous= and timestamp= "
                "(milliseconds); the run is the tracker's own, so drop the others."
            )
        now = int(time.time() * 1000) if now is None else int(now)
        self._pending += [
            Metric(k, float(v), now, step or 0)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if synchronous:
            self.flush(synchronous=True)
        elif time.monotonic() >= self._due:
            self.flush()

    def flush(self, synchronous: bool = False) -> None:
        """Send the numbers kept back: one store write a second (each costs the SQLite store
        milliseconds, more than a small step), queued to MLflow's background thread."""
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), 1000):  # MLflow takes 1000 metrics a call
            batch = pending[start : start + 1000]
            self.client.log_batch(self.run_id, metrics=batch, synchronous=synchronous)
        self._due = time.monotonic() + FLUSH_SECONDS

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """A matplotlib or plotly figure, saved as the run's artifact ``artifact_file``."""
        self.client.log_figure(self.run_id, figure, artifact_file, save_kwargs=save_kwargs or None)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """A file, copied into the run's artifacts (under ``artifact_path``)."""
        self.client.log_artifact(self.run_id, local_path, artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Everything in a folder, copied into the run's artifacts (under ``artifact_path``)."""
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def finish(self) -> None:
        if self.client is None:
            return
        self.flush()
        self.client.set_terminated(self.run_id)  # waits for the queued metrics first
        self.client, self.run_id = None, self._resume  # start() begins a new run


class WandBTracker(GeneralTracker):
    """A wandb run; offline, and said so, when no API key is at hand and ``WANDB_MODE`` is
    unset. ``finish`` also stops wandb's service process."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike | None = None, **kwargs: Any
    ) -> None:
        self.run_name, self.logging_dir, self.init_kwargs = run_name, logging_dir, kwargs
        self.run: Any = None  # made by start()

    def start(self) -> None:
        """``wandb.init`` the run (a second call keeps the first)."""
        if self.run is not None:
            return
        import wandb

        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None:
            Path(self.logging_dir).mkdir(parents=True, exist_ok=True)
            kwargs.setdefault("dir", str(self.logging_dir))
        if "mode" not in kwargs and not os.environ.get("WANDB_MODE") and not _wandb_key():
            kwargs["mode"] = "offline"
            where = Path(kwargs.get("dir", ".")) / "wandb"
            print(
                f"wandb: no API key found (WANDB_API_KEY, `wandb login`), so this run is logged "
                f"offline under {where}; upload it later with `wandb sync {where}/offline-run-*`",
                file=sys.stderr,
            )
        self.run = wandb.init(project=self.run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(dict(values), step=step, **kwargs)

    def finish(self) -> None:
        if self.run is None:
            return
        import wandb

        run, self.run = self.run, None
        run.finish()
        if wandb.run is None:  # no other run of this process needs wandb's service process
            wandb.teardown()


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


def _as_bool(value: Any, what: str) -> bool:
    """A yes/no setting that may come as text from the environment (Accelerate's spellings)."""
    if not isinstance(value, str):
        return bool(value)
    if value.strip().lower() in ("1", "true", "t", "yes", "y", "on"):
        return True
    if value.strip().lower() in ("0", "false", "f", "no", "n", "off", ""):
        return False
    raise ValueError(f"{what}={value!r}: say yes or no (true/false, 1/0, yes/no, on/off).")


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False
