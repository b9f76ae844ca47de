"""The exceptions nbaccel raises at run time.

Bad arguments raise the builtin ``ValueError``/``TypeError``; failures that happen while the
library works (a checkpoint that cannot be loaded, a worker that crashed) raise these. Every
failed launch, of one process or many, here or on SLURM, and every failed ranks cell raises one
``LaunchError`` (``CellError`` is one), which is also torch's ``ChildFailedError``: the two are
made on first use (``__getattr__`` below), since that base imports torch.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

# What a function should return instead of a value that cannot come back to the notebook.
RETURN_INSTEAD = (
    "return plain data, tensors or state_dicts instead (for a prepared model: "
    "`return accelerator.unwrap_model(model).state_dict()`, then load it into a fresh model "
    "in the notebook)"
)


class NbaccelError(RuntimeError):
    """Base class of nbaccel's run-time errors."""


class CheckpointError(NbaccelError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the objects it is loaded into.

    Also a ``ValueError``, since the bad value is the checkpoint path handed to ``load_state``.
    """


class DistributedOperationException(NbaccelError, ValueError):
    """The ranks handed a collective tensors it cannot combine: different shapes, dtypes or
    structures, or different collectives at the same point.

    Every rank raises it, before any data moves, so the process group still works and the
    next collective succeeds. Accelerate's name, so that ``except DistributedOperationException``
    ports unchanged; also a ``ValueError``, since the bad value is the caller's tensor.
    """


@dataclass(frozen=True)
class RankFailure:
    """What one worker did wrong, as plain data that crossed the process boundary."""

    rank: int
    pid: int | None = None
    exit_code: int | None = None  # negative: killed by signal -exit_code
    exc_type: str | None = None  # None: it died without a Python exception
    message: str = ""  # the exception's; for a killed rank, what the launcher found about it
    traceback: str = ""
    secondary: bool = False  # a collective failed because another rank was gone
    node: str | None = None  # on a cluster: the node it ran on, as SLURM names it

    def who(self) -> str:
        where = f" on node {self.node}" if self.node else ""
        pid = f" (pid {self.pid})" if self.pid is not None else ""  # a lost node's: unknown
        return f"rank {self.rank}{pid}{where}"

    def describe(self) -> str:
        if self.exc_type == "SystemExit":  # sys.exit(...): its code and what Python prints
            note = f": {self.message}" if self.message else ""
            return f"{self.who()} exited with code {self.exit_code}{note}"
        if self.exc_type is not None:
            return f"{self.who()} raised {self.exc_type}: {self.message}"
        if self.exit_code is not None and self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:
                name = f"signal {-self.exit_code}"
            killed = f"{self.who()} was killed by {name}"
            return f"{killed}; {self.message}" if self.message else killed  # e.g. memory's hint
        if self.exit_code is None:  # its exit was never seen; the message says why
            return f"{self.who()} {self.message}"
        note = f" {self.message}" if self.message else ""
        return f"{self.who()} exited with code {self.exit_code}{note}"


def __getattr__(name: str) -> type:
    """``LaunchError`` and ``CellError``, made on first use: each is also torch's
    ``ChildFailedError``, and subclassing it imports torch, which ``import nbaccel`` (the CLI,
    the live view) must not pay for. ``from nbaccel.errors import LaunchError`` and
    ``nbaccel.LaunchError`` give the one class, made once."""
    if name in ("LaunchError", "CellError"):
        _make_launch_errors()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_launch_errors() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    class LaunchError(NbaccelError, ChildFailedError):
        """A launch failed: the first rank's real error, its traceback, and what the others did.

        Also torch's ``ChildFailedError``, so code written for torchrun or Hugging Face
        Accelerate's ``notebook_launcher`` catches it unchanged; ``.failures`` is nbaccel's
        list of ``RankFailure`` (root cause first), and torch's ``get_first_failure`` answers
        with the root cause as torch's ``ProcessFailure``.

        ``results``: {rank: value} of the values that did come back when others could not (a
        value the notebook cannot unpickle); empty when a rank failed."""

        __qualname__ = "LaunchError"  # pickle finds it as nbaccel.errors.LaunchError

        def __init__(
            self,
            summary: str,
            failures: list[RankFailure] | None = None,
            run: object = None,
            stacks: dict | None = None,
            results: dict | None = None,
        ) -> None:
            self.name = "notebook_launcher"  # ChildFailedError's: what failed
            self.failures = failures or []
            self.results = results or {}
            self.run = run  # the launch's records (a Run): what every rank logged before
            # A timeout's {rank: stacks.RankStack or None}: where each unfinished rank was,
            # asked before it was stopped (None: it did not answer).
            self.stacks = stacks or {}
            self.root_cause = self.failures[0] if self.failures else None
            self.rank = self.root_cause.rank if self.root_cause else None
            self.exc_type = self.root_cause.exc_type if self.root_cause else None
            RuntimeError.__init__(self, summary)  # not ChildFailedError's: its own message

        def get_first_failure(self) -> tuple[int, ProcessFailure]:
            """The root cause, as torch's ``(global rank, ProcessFailure)``."""
            root = self.root_cause
            rank = root.rank if root else 0
            code = root.exit_code if root and root.exit_code is not None else 1
            failure = ProcessFailure(rank, (root.pid if root else None) or 0, code, "")
            failure.message = root.describe() if root else str(self)
            return rank, failure

        def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
            return str(self)

        def __reduce__(self):  # the summary alone rebuilds it; the rest is its __dict__
            return (type(self), (str(self),), self.__dict__)

    # One class, even if two threads got here at once: the first one stored wins.
    launch_error = globals().setdefault("LaunchError", LaunchError)

    class CellError(launch_error):
        """A ranks cell failed (``launch/session.py``): a rank raised, died, or (``hung``) did
        not end the cell. A notebook shows the message alone."""

        __qualname__ = "CellError"

        def __init__(
            self,
            summary: str,
            failures: list[RankFailure] | None = None,
            hung: bool = False,
            stacks: dict | None = None,
        ) -> None:
            super().__init__(summary, failures, stacks=stacks)
            self.hung = hung

        def _render_traceback_(self) -> list[str]:  # IPython shows this instead of our frames
            lines = f"{type(self).__name__}: {self}".splitlines()
            return lines + list(getattr(self, "__notes__", []))

    globals().setdefault("CellError", CellError)


def by_priority(failures: list[RankFailure], arrival: list[int]) -> list[RankFailure]:
    """The root cause first: real errors, then hard deaths, then ranks that only lost a peer or
    that the launcher stopped; ties broken by ``arrival``, the ranks in the order they failed."""
    order = {rank: i for i, rank in enumerate(arrival)}
    return sorted(
        failures,
        key=lambda f: (f.secondary, f.exc_type is None, order.get(f.rank, len(order)), f.rank),
    )


def root_cause_report(failures: list[RankFailure], stopped: set[int], finished: list[int]) -> str:
    """torch elastic's "Root Cause (first observed failure)", for a notebook: the first rank's
    error with its own traceback, one line per other rank (``stopped``: by the launcher), and a
    hint when the root cause waited in a collective for ranks that had ``finished``."""
    root = failures[0]
    lines = [root.describe()]
    if root.traceback:
        header = f"Traceback on rank {root.rank} (most recent call last):"
        text = root.traceback.replace("Traceback (most recent call last):", header)
        lines += ["", text.rstrip()]
    others = [
        f.describe() + (" (stopped by nbaccel)" if f.rank in stopped else "") for f in failures[1:]
    ]
    if others:
        lines += ["", "Other ranks:"] + [f"  {o}" for o in others]
    if root.secondary and finished:
        lines += [
            "",
            f"Ranks {finished} had already returned while rank {root.rank} waited for them "
            "in a collective, a desync: the ranks ran different numbers of steps (a different "
            "number of batches, or a loop that stops on one rank's clock or data). Make every "
            "rank stop at the same step.",
        ]
    return "\n".join(lines)


class NotPortedError(ImportError):
    """An Accelerate name nbaccel leaves out on purpose: the message says why, and what to use."""


# What of Accelerate's public surface nbaccel will not offer, and why (README: "Coming from
# Hugging Face Accelerate"). Raised by ``nbaccel`` and ``nbaccel.utils`` when ported code
# imports one of these names, instead of Python's bare "cannot import name".
_BIG_MODEL = (
    "big-model inference (placing a model too large for one device over devices, CPU and "
    "disk) is not part of nbaccel, which trains; import it from accelerate, which works "
    "beside nbaccel"
)
_FP8 = (
    "FP8 training needs Transformer Engine, MS-AMP or torchao on recent GPUs; nbaccel's mixed "
    'precision is "fp16" and "bf16"'
)
_PARALLEL = "nbaccel shares a model with DDP, FSDP2 or DeepSpeed only, not with tensor parallelism"
NOT_PORTED = {
    **dict.fromkeys(
        (
            "init_empty_weights",
            "init_on_device",
            "load_checkpoint_and_dispatch",
            "dispatch_model",
            "infer_auto_device_map",
            "cpu_offload",
            "cpu_offload_with_hook",
            "disk_offload",
            "load_checkpoint_in_model",
        ),
        _BIG_MODEL,
    ),
    **dict.fromkeys(
        ("FP8RecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "AORecipeKwargs"), _FP8
    ),
    **dict.fromkeys(
        ("MegatronLMPlugin", "TorchTensorParallelPlugin", "ParallelismConfig"), _PARALLEL
    ),
    "ProfileKwargs": (
        "nbaccel's time split (run.breakdown(), the live view) shows where time goes; for "
        "torch.profiler's trace, open torch.profiler.profile() around your loop yourself"
    ),
    "TorchDynamoPlugin": (
        "prepare() does not compile; call torch.compile(model) yourself before prepare()"
    ),
    "debug_launcher": (
        "use notebook_launcher(function, num_processes=2, cpu=True), which starts CPU ranks "
        "the same way from a notebook or a script"
    ),
}


def not_ported(module: str, name: str) -> NotPortedError | None:
    """The error for importing ``name`` from ``module`` if nbaccel leaves it out on purpose."""
    if name not in NOT_PORTED:
        return None
    return NotPortedError(
        f"{module}.{name} is Accelerate's and has no nbaccel counterpart: {NOT_PORTED[name]}.",
        name=name,
    )
