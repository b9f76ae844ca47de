"""Hugging Face Accelerate itself in the lessons: its interactive ``accelerate config`` answered
from a cell, and what its CPU paths need, each step named with the versions it was checked on.

* ``answer_accelerate_config(answers, path)`` runs the real ``accelerate config`` in a
  pseudo-terminal and types the answers, as a learner would in a terminal. A notebook's ``!``
  cannot: the command reads its menus key by key from a terminal, so with its answers piped in
  it stops at the first menu (``termios.error: (25, 'Inappropriate ioctl for device')``), and
  without them it waits for keys that never come.
* ``preload_for_notebook_launcher()``: what each process of Accelerate's ``notebook_launcher``
  would otherwise import for itself, imported once in the kernel that it forks.
* ``deepspeed_accelerator(zero_stage, ...)``: Accelerate's ``Accelerator`` with its
  ``DeepSpeedPlugin``, on GPUs and on CPU processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from nbaccel.errors import NbaccelError

# accelerate config's menus (accelerate/commands/menu, 1.15): a line of dashes, the question,
# a hint, the options (the current one after an arrow), then the cursor is hidden and the menu
# reads one key at a time: a digit moves to that option, Enter ("\r") chooses it.
MENU_HINT = "Please select a choice"
HIDE_CURSOR = "\x1b[?25l"
ARROW = "➔"
DOWN = "\x1b[B"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Any question accelerate config waits on: a menu, or a field such as "...? [yes/NO]: "
ANY_QUESTION = re.compile(rf"{MENU_HINT}|(?<!\x1b)\[[^\[\]\n]*\]: ?$")
KEY_PAUSE = 0.1  # s: a menu turns the terminal raw (flushing what was typed) just before it reads


class ConfigAnswerError(NbaccelError):
    """``accelerate config`` asked something the answers do not cover, or failed."""


def answer_accelerate_config(
    answers: Sequence[tuple[str, str]], config_file: str | os.PathLike, timeout: float = 60
) -> list[tuple[str, str]]:
    """Run ``accelerate config --config_file CONFIG_FILE`` and answer its questions in order.

    ``answers``: ``(question, answer)`` pairs, the question as any part of what Accelerate
    prints, the answer as you would type it, or for a menu the option's text
    (``("Which type of machine are you using?", "multi-GPU")``). Returns the questions as
    Accelerate asked them, each with its answer. Raises ``ConfigAnswerError`` naming the question
    it asked instead of the next one expected, or its output when it failed.
    """
    try:
        import pexpect
    except ImportError as err:
        raise ImportError(
            "answering accelerate config needs pexpect (IPython installs it on Linux and "
            "macOS): %pip install pexpect in the notebook"
        ) from err
    command = ["-m", "accelerate.commands.accelerate_cli", "config", "--config_file"]
    child = pexpect.spawn(
        sys.executable,
        [*command, os.fspath(config_file)],
        encoding="utf-8",
        timeout=timeout,
        dimensions=(24, 200),  # one line per option
    )
    asked = []
    try:
        for question, reply in answers:
            found = _expect(child, [re.escape(question), ANY_QUESTION], question, pexpect)
            if found == 1:
                raise ConfigAnswerError(
                    f"accelerate config asked {_last_question(child)!r} where the answers "
                    f"expected {question!r}: add its answer, in the order it is asked"
                )
            shown = _last_line(child.before + child.after + child.buffer.split("\n")[0])
            if child.before.rstrip("\r").endswith("-" * 20):  # a menu draws a line above it
                _choose(child, question, reply, pexpect)
            else:
                child.sendline(reply)
                _expect(child, [re.escape(reply) + r"\r?\n"], f"{reply!r} shown", pexpect)
            asked.append((shown, reply))
        saved = "accelerate configuration saved at"
        if _expect(child, [re.escape(saved), ANY_QUESTION], "the end", pexpect) == 1:
            raise ConfigAnswerError(
                f"accelerate config asked {_last_question(child)!r} after the last answer: "
                "add its answer at the end"
            )
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    if child.exitstatus != 0:
        raise ConfigAnswerError(f"accelerate config exited with status {child.exitstatus}")
    return asked


def _expect(child: Any, patterns: list[str], waiting_for: str, pexpect: Any) -> int:
    try:
        return child.expect(patterns)
    except (pexpect.EOF, pexpect.TIMEOUT) as err:
        what = "ended" if isinstance(err, pexpect.EOF) else "stopped answering"
        tail = ANSI.sub("", child.before or "")[-600:]
        raise ConfigAnswerError(
            f"accelerate config {what} before {waiting_for!r}; its last output:\n{tail}"
        ) from None


def _last_line(text: str) -> str:
    lines = [
        ANSI.sub("", line).lstrip("-").strip() for line in text.replace("\r", "\n").split("\n")
    ]
    return next((line for line in reversed(lines) if line), "")


def _last_question(child: Any) -> str:
    text = ANSI.sub("", child.before + child.after)
    if MENU_HINT in child.after:
        text = text[: text.rindex(MENU_HINT)]
    return _last_line(text)


def _choose(child: Any, question: str, reply: str, pexpect: Any) -> None:
    """Move to ``reply`` among the menu's options and press Enter."""
    _expect(child, [re.escape(HIDE_CURSOR)], f"the options of {question!r}", pexpect)
    lines = [ANSI.sub("", line).strip() for line in child.before.split("\n")]
    lines = [line for line in lines if line and not line.startswith(MENU_HINT)]
    options = [line.removeprefix(ARROW).strip() for line in lines]
    if reply not in options:
        raise ConfigAnswerError(f"{question!r} offers {options}, not {reply!r}")
    moves = options.index(reply) - next(i for i, line in enumerate(lines) if line[0] == ARROW)
    if moves:
        # a digit jumps to its option; past 9, the down arrow moves one at a time
        keys = str(options.index(reply)) if options.index(reply) < 10 else DOWN * moves
        _press(child, keys, re.escape(reply), pexpect)
    _press(child, "\r", re.escape(reply) + r"\S*\r?\n", pexpect)


def _press(child: Any, keys: str, echo: str, pexpect: Any) -> None:
    """Type ``keys`` once the menu reads; once more if the terminal flushed them unread (a menu
    empties what was typed as it turns the terminal raw), which it shows by not redrawing."""
    for _ in range(2):
        time.sleep(KEY_PAUSE)
        child.send(keys)
        with contextlib.suppress(pexpect.TIMEOUT):
            child.expect(echo, timeout=5)
            return
    raise ConfigAnswerError(f"accelerate config's menu did not take {keys!r}")


def preload_for_notebook_launcher() -> None:
    """Import once, in this kernel, what every process of Accelerate's ``notebook_launcher``
    would import for itself: it forks the kernel, so its processes start with the kernel's
    modules. Changes no number a run computes.

    * ``torch._dynamo``: torch 2.13 imports it when the first optimizer is built (seconds);
    * DeepSpeed, when installed and no GPU is: Accelerate 1.15's ``unwrap_model`` imports it to
      recognise a DeepSpeed engine, and DeepSpeed 0.19, finding no GPU on import, warns on every
      process ("Setting accelerator to CPU..."). Its own variable ``DS_ACCELERATOR=cpu`` names
      the device instead (and DeepSpeed's import sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``).
      With a GPU nothing of DeepSpeed's is imported here: the kernel must not touch CUDA
      before Accelerate forks it.
    """
    import torch
    import torch._dynamo

    if torch.cuda.device_count() == 0 and importlib.util.find_spec("deepspeed") is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401


@contextlib.contextmanager
def _no_transformers_handoff() -> Iterator[None]:
    """Accelerate 1.15's ``DeepSpeedPlugin`` hands its config to transformers while it is built
    (``set_deepspeed_weakref``, in accelerate/utils/dataclasses.py), which transformers reads
    only to build its own models under ZeRO 3. Its first step asks for transformers' version,
    which raises ``PackageNotFoundError`` where transformers is not installed, and imports
    transformers (seconds in every process) where it is. A model of one's own needs neither:
    skipped while the plugin and the ``Accelerator`` are built, restored after."""
    from accelerate.utils import DeepSpeedPlugin

    handoff = DeepSpeedPlugin.set_deepspeed_weakref
    DeepSpeedPlugin.set_deepspeed_weakref = lambda self: None
    try:
        yield
    finally:
        DeepSpeedPlugin.set_deepspeed_weakref = handoff


def deepspeed_accelerator(zero_stage: int, **options: Any) -> Any:
    """Accelerate's ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=...), **options)``
    (gradient clipping at 1.0, nbaccel's default), in a launched process, on GPUs or CPUs.

    On CPU processes (checked with accelerate 1.15, DeepSpeed 0.19, torch 2.13):

    * Accelerate finds no process-group backend for DeepSpeed without a GPU:
      ``InitProcessGroupKwargs(backend="gloo")`` names one;
    * ``ACCELERATE_USE_CPU``, which nbaccel's launcher sets for CPU workers, sends Accelerate
      down its CPU path, which has no DeepSpeed: it is removed from this process's environment;
    * DeepSpeed names its device from ``DS_ACCELERATOR`` (``cpu``), or guesses and warns;
    * DeepSpeed still calls two ``torch.distributed`` collectives that torch renamed; their
      deprecation warnings are silenced in this process.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    handlers = None
    if os.environ.pop("ACCELERATE_USE_CPU", None) or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        handlers = [InitProcessGroupKwargs(backend="gloo")]
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    with _no_transformers_handoff():
        plugin = DeepSpeedPlugin(zero_stage=zero_stage, gradient_clipping=1.0)
        return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=handlers, **options)
