"""The built-in experiment trackers, behind Accelerate's names: TensorBoard, MLflow and wandb.

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("mnist", config={"lr": 0.1})   # the hyperparameters, once
    accelerator.log({"loss": loss})          # the trackers, and the live view as before
    accelerator.end_training()               # finishes every tracker

Only the main process writes (a tracker with ``main_process_only = False``: every rank).
``step`` defaults to the optimizer steps taken. Each library is optional (``pip install
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
subclass ``GeneralTracker`` (``general``) and pass an instance.
"""

from __future__ import annotations

import json
import netrc
import os
import sys
import time
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
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir) / run_name
        kwargs.setdefault("max_queue", 1000)  # a second's events go in without waiting
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)
        self._pending: list[tuple[int | None, dict[str, float], float]] = []
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

    def log(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
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
        self._write_pending()
        self.writer.flush()  # on disk when it returns

    def finish(self) -> None:
        self._write_pending()
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
        self._pending: list[Any] = []  # Metric entities, sent together once a second
        self._due = time.monotonic() + FLUSH_SECONDS

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
        self._pending += [
            Metric(k, float(v), now, step or 0)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        """Send the numbers kept back: one store write a second (each costs the SQLite store
        milliseconds, more than a small step), queued to MLflow's background thread."""
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), 1000):  # MLflow takes 1000 metrics a call
            batch = pending[start : start + 1000]
            self.client.log_batch(self.run_id, metrics=batch, synchronous=False)
        self._due = time.monotonic() + FLUSH_SECONDS

    def finish(self) -> None:
        self.flush()
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
