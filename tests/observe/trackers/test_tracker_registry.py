"""Trackers by name and the two-step start, as in Accelerate 1.x: ``register_tracker_class`` and
``LOGGER_TYPE_TO_CLASS``, a tracker's constructor that touches nothing until ``init_trackers``
calls its ``start()``, the folder error, and the refused names of Accelerate's other trackers.

The oracle is Hugging Face Accelerate itself: the same tracker class, registered in its registry
and driven by its Accelerator, sees the same calls as under nbaccel's.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel import (
    LOGGER_TYPE_TO_CLASS,
    Accelerator,
    GeneralTracker,
    LoggerType,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    register_tracker_class,
)
from nbaccel.observe.trackers.general import installed
from nbaccel.observe.trackers.registry import NOT_IN_NBACCEL


@pytest.fixture(autouse=True)
def registry():
    """Each test's registrations are undone after it."""
    saved = dict(LOGGER_TYPE_TO_CLASS)
    yield LOGGER_TYPE_TO_CLASS
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


def recording_tracker(base: type, name: str = "calls", folder: bool = False) -> type:
    """A tracker class on ``base`` (nbaccel's or Accelerate's ``GeneralTracker``) that keeps
    every call made to it, in a list shared by its instances."""
    calls: list[tuple] = []

    class Recording(base):
        requires_logging_directory = folder
        seen = calls

        def __init__(self, run_name, *args, **kwargs):
            super().__init__()
            calls.append(("init", run_name, *map(str, args), kwargs))

        def start(self):
            calls.append(("start",))

        @property
        def tracker(self):
            return calls

        def store_init_configuration(self, values):
            calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            calls.append(("log", step, values, kwargs))

        def finish(self):
            calls.append(("finish",))

    Recording.name = name
    return Recording


def drive(accelerator_class, name: str, project_dir: Path, **extra) -> None:
    accelerator = accelerator_class(log_with=name, project_dir=project_dir, cpu=True, **extra)
    accelerator.init_trackers("proj", {"lr": 0.5, "n": 3}, init_kwargs={name: {"tag": "a"}})
    accelerator.log({"a": 1, "b": 0.25, "s": "text"}, step=7, log_kwargs={name: {"x": 1}})
    accelerator.end_training()


@pytest.mark.parametrize("folder", [False, True])
def test_a_registered_class_sees_the_calls_accelerates_registry_gives_it(tmp_path, folder):
    import accelerate.tracking
    from accelerate import Accelerator as Theirs
    from accelerate.state import AcceleratorState as TheirState

    ours = recording_tracker(GeneralTracker, folder=folder)
    theirs = recording_tracker(accelerate.tracking.GeneralTracker, folder=folder)
    register_tracker_class(ours)
    saved = dict(accelerate.tracking.LOGGER_TYPE_TO_CLASS)
    accelerate.tracking.register_tracker_class(theirs)
    try:
        drive(Theirs, "calls", tmp_path)
    finally:
        accelerate.tracking.LOGGER_TYPE_TO_CLASS.clear()
        accelerate.tracking.LOGGER_TYPE_TO_CLASS.update(saved)
        TheirState._reset_state(True)
    drive(Accelerator, "calls", tmp_path, live=False)
    assert repr(ours.seen) == repr(theirs.seen)  # an int stays an int
    assert ours.seen[0] == ("init", "proj", *([str(tmp_path)] if folder else []), {"tag": "a"})
    assert ("log", 7, {"a": 1, "b": 0.25, "s": "text"}, {"x": 1}) in ours.seen  # 1 stays an int


def test_a_class_registered_by_name_is_made_by_init_trackers(tmp_path):
    mine = recording_tracker(GeneralTracker, name="mine")
    register_tracker_class(mine)
    assert LOGGER_TYPE_TO_CLASS["mine"] is mine
    assert nbaccel.LOGGER_TYPE_TO_CLASS is LOGGER_TYPE_TO_CLASS  # one registry, however imported
    accelerator = Accelerator(log_with=["mine", "mine"], live=False)
    assert mine.seen == []  # nothing made before init_trackers
    accelerator.init_trackers("p", config={"lr": 1})
    accelerator.log({"loss": torch.tensor(0.5)}, step=2)
    assert isinstance(accelerator.get_tracker("mine"), mine)
    assert accelerator.get_tracker("mine", unwrap=True) is mine.seen
    accelerator.end_training()
    assert mine.seen == [  # made once, started before its config
        ("init", "p", {}),
        ("start",),
        ("config", {"lr": 1}),
        ("log", 2, {"loss": 0.5}, {}),  # a one-number tensor as its Python number
        ("finish",),
    ]


def test_a_class_that_needs_a_folder_is_refused_without_one_and_says_how(tmp_path):
    register_tracker_class(recording_tracker(GeneralTracker, name="files", folder=True))
    with pytest.raises(ValueError, match="Logging with `files` requires a `logging_dir`") as err:
        Accelerator(log_with="files", live=False)
    assert 'project_dir="runs"' in str(err.value)
    Accelerator(log_with="files", project_dir=str(tmp_path), live=False)


def test_tensorboard_without_a_folder_uses_accelerates_words():
    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        Accelerator(log_with=LoggerType.TENSORBOARD, live=False)


def test_registering_checks_the_class_and_warns_when_it_takes_a_name_over():
    class Nameless(GeneralTracker):
        requires_logging_directory = False

    class NoFlag(GeneralTracker):
        name = "no_flag"

    for wrong, words in [
        (dict, "subclasses nbaccel.GeneralTracker"),
        (Nameless(), "subclasses nbaccel.GeneralTracker"),
        (Nameless, "needs a `name` of its own"),
        (NoFlag, "requires_logging_directory"),
    ]:
        with pytest.raises(ValueError, match=words):
            register_tracker_class(wrong)
    assert "no_flag" not in LOGGER_TYPE_TO_CLASS

    shadow = recording_tracker(GeneralTracker, name="tensorboard")
    with pytest.warns(UserWarning, match="'tensorboard' was taken by TensorBoardTracker"):
        register_tracker_class(shadow)
    assert LOGGER_TYPE_TO_CLASS["tensorboard"] is shadow
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_tracker_class(recording_tracker(GeneralTracker, name="fresh"))  # no warning


@pytest.mark.parametrize("name", sorted(NOT_IN_NBACCEL))
def test_accelerates_other_trackers_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=f"nbaccel has no {NOT_IN_NBACCEL[name]} tracker") as err:
        Accelerator(log_with=LoggerType(name), live=False)
    assert "register_tracker_class" in str(err.value)
    assert "'tensorboard', 'mlflow', 'wandb', 'all'" in str(err.value)


def test_a_class_you_register_under_a_refused_name_is_used():
    register_tracker_class(recording_tracker(GeneralTracker, name="comet_ml"))
    accelerator = Accelerator(log_with="comet_ml", live=False)
    accelerator.init_trackers("p")
    assert accelerator.get_tracker("comet_ml").name == "comet_ml"
    accelerator.end_training()


# -- the built-in trackers start in two steps ------------------------------------------------
def test_the_builtin_trackers_touch_nothing_until_init_trackers(tmp_path, monkeypatch):
    """Made with their libraries unimportable and PartialState refusing to be made: the
    constructors read neither; nor does an Accelerator given them, before init_trackers."""
    for module in ("tensorboard", "torch.utils.tensorboard", "mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)

    def refuse(*_, **__):
        raise AssertionError("a tracker's constructor made a PartialState")

    monkeypatch.setattr(nbaccel.PartialState, "__init__", refuse)
    made = [
        TensorBoardTracker("tb", tmp_path / "tb"),
        MLflowTracker("exp", tmp_path / "ml"),
        WandBTracker("wb", tmp_path / "wb"),
    ]
    assert [t.tracker for t in made] == [None, None, None]
    monkeypatch.undo()
    Accelerator(log_with=made, project_dir=str(tmp_path), live=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard is not installed")
def test_tensorboards_writer_is_opened_by_start(tmp_path):
    tracker = TensorBoardTracker("run", tmp_path)
    accelerator = Accelerator(log_with=tracker, live=False)
    assert not (tmp_path / "run").exists()
    accelerator.init_trackers("ignored: the tracker was made with its own name")
    assert accelerator.get_tracker("tensorboard", unwrap=True) is tracker.writer is not None
    accelerator.end_training()
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1


# -- MLflow: Accelerate's arguments and environment ----------------------------------------
needs_mlflow = pytest.mark.skipif(not installed("mlflow"), reason="mlflow is not installed")


@needs_mlflow
def test_mlflows_environment_variables_win_as_in_accelerate(tmp_path, monkeypatch):
    for value, nested in [("False", False), ("off", False), ("0", False), ("yes", True)]:
        monkeypatch.setenv("MLFLOW_NESTED_RUN", value)
        assert MLflowTracker("exp", tmp_path).nested_run is nested
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "maybe")
    with pytest.raises(ValueError, match="say yes or no"):
        MLflowTracker("exp", tmp_path)
    monkeypatch.delenv("MLFLOW_NESTED_RUN")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "a"}')
    tracker = MLflowTracker("from-argument", tmp_path, tags={"team": "b"})
    assert (tracker.experiment_name, tracker.tags) == ("from-env", {"team": "a"})


@needs_mlflow
def test_mlflow_run_artifacts_and_parameters(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MLflowTracker("exp", tmp_path, run_name="r1", description="about")
    accelerator = Accelerator(log_with=tracker, live=False)
    assert not (tmp_path / "mlflow.db").exists()
    accelerator.init_trackers("exp")
    (tmp_path / "note.txt").write_text("hello")
    tracker.log_artifact(str(tmp_path / "note.txt"), artifact_path="notes")
    config = {"lr": 0.1, "long": "x" * 6001}
    with pytest.warns(UserWarning, match="'long' is 6001 characters long"):
        tracker.store_init_configuration(config)
    assert config == {"lr": 0.1, "long": "x" * 6001}  # the caller's dict as it was
    with pytest.raises(TypeError, match=r"got \['x'\]: it takes synchronous= and timestamp="):
        accelerator.log({"loss": 0.5}, step=3, log_kwargs={"mlflow": {"x": 1}})
    accelerator.log({"loss": 0.25}, step=4, log_kwargs={"mlflow": {"synchronous": True}})
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    client = tracker.client
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert history == [(4, 0.25)]  # sent at once; step 3's was refused before it was kept
    accelerator.end_training()
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1"}
    assert run.data.tags["mlflow.note.content"] == "about"
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id, "notes")] == ["notes/note.txt"]


@needs_mlflow
def test_a_nested_mlflow_run_hangs_under_the_active_one(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the fluent API's store too
    client = mlflow.MlflowClient(uri)
    made = client.create_run(client.create_experiment("outer")).info.run_id
    with mlflow.start_run(run_id=made) as parent:  # a new one would ask git for its commit
        tracker = MLflowTracker("exp", nested_run=True)
        tracker.start()
        tracker.finish()
        assert mlflow.active_run().info.run_id == parent.info.run_id  # left as it was
    run = client.get_run(tracker.active_run.info.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard is not installed")
def test_all_takes_the_installed_builtin_trackers_and_no_registered_class(tmp_path, monkeypatch):
    for module in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    mine = recording_tracker(GeneralTracker, name="mine")
    register_tracker_class(mine)
    accelerator = Accelerator(
        log_with=["all", "tensorboard"], project_dir=str(tmp_path), live=False
    )
    accelerator.init_trackers("p")
    assert [t.name for t in accelerator.trackers] == ["tensorboard"]
    assert mine.seen == []  # as in Accelerate, "all" is the built-in ones only
    accelerator.end_training()
