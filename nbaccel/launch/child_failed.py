"""The error a failed launch raises: nbaccel's ``LaunchError``, and torch's ``ChildFailedError``.

Code written for torchrun or Hugging Face Accelerate's ``notebook_launcher`` catches
``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``; nbaccel's own code
catches ``nbaccel.LaunchError``. A launch whose workers raised, died, timed out or lost their
fork server raises this class, which is both, so both kinds of ``except`` work unchanged.

It lives here, not in ``errors.py``: subclassing torch's class imports torch, and ``errors.py``
is imported by the CLI and the modules that must start without it. The name is kept
(``LaunchError``), so the cell shows the same error name it always did; ``.failures`` stays
nbaccel's list of ``RankFailure`` (root cause first), and torch's ``get_first_failure`` answers
with the root cause as torch's ``ProcessFailure``.
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from .. import errors


class LaunchError(errors.LaunchError, ChildFailedError):
    """A launch's workers failed: ``nbaccel.LaunchError``, and torch's ``ChildFailedError``."""

    def __init__(self, summary: str, *args, name: str = "notebook_launcher", **kwargs) -> None:
        errors.LaunchError.__init__(self, summary, *args, **kwargs)
        self.name = name  # ChildFailedError's: what failed

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

    def __reduce__(self):  # pickles as the plain nbaccel.LaunchError would
        return (type(self), (str(self),), self.__dict__)
