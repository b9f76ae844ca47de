"""The exceptions nbaccel raises at run time.

Bad arguments raise the builtin ``ValueError``/``TypeError``; failures that happen while the
library works (a checkpoint that cannot be loaded, a worker that crashed) raise these.
"""

from __future__ import annotations


class NbaccelError(RuntimeError):
    """Base class of nbaccel's run-time errors."""


class CheckpointError(NbaccelError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the objects it is loaded into.

    Also a ``ValueError``, since the bad value is the checkpoint path handed to ``load_state``.
    """
