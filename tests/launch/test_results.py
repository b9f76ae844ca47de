"""What comes back from the workers: values, even when one cannot; errors, whatever their class
does; ``SystemExit`` with its message and code (issue 31).

Real launches of 2 CPU ranks. Functions and classes are defined inside the tests, as in notebook
cells, so they travel by value.
"""

from __future__ import annotations

import sys

import pytest

from nbaccel import LaunchError, notebook_launcher
from nbaccel.launch.protocol import ExceptionData, type_name

pytestmark = pytest.mark.multiprocess
HANG = 120  # seconds: a launch that takes this long is hung, not slow


def _launch(function, **options):
    return notebook_launcher(function, num_processes=2, cpu=True, timeout=HANG, **options)


def _value_that_only_lives_in_workers(rank: int):
    """Rank 1 returns a value that pickles in the worker and fails to unpickle in the launching
    process, as a prepared model does (its unpickling asks for the process group)."""
    import os

    def rebuild():
        if "RANK" not in os.environ:  # the launching process: no worker environment here
            raise ValueError("Default process group has not been initialized")
        return "rebuilt"

    class Prepared:
        def __reduce__(self):
            return rebuild, ()

    return Prepared() if rank == 1 else {"rank": rank}


def test_a_prepared_model_is_named_with_what_to_return_instead():
    def train():
        import torch

        from nbaccel import Accelerator

        accelerator = Accelerator()
        model = accelerator.prepare(torch.nn.Linear(2, 2))
        result = model if accelerator.rank == 1 else {"rank": accelerator.rank}
        accelerator.wait_for_everyone()
        return result

    with pytest.raises(LaunchError, match=r"rank 1 returned a \S*DistributedDataParallel") as e:
        _launch(train, return_all=True)
    assert "accelerator.unwrap_model(model).state_dict()" in str(e.value)
    assert "process group" in str(e.value)  # why it could not be rebuilt
    assert e.value.rank == 1 and e.value.results == {0: {"rank": 0}}
    assert e.value.run.results == {0: {"rank": 0}}


def test_a_value_that_cannot_come_back_is_an_error_and_the_others_survive():
    def work():
        import os

        return _value_that_only_lives_in_workers(int(os.environ["RANK"]))

    with pytest.raises(LaunchError, match=r"rank 1 returned a \S*Prepared that cannot") as e:
        _launch(work, return_all=True)
    assert "ValueError: Default process group has not been initialized" in str(e.value)
    assert "state_dict" in str(e.value) and ".results" in str(e.value)
    assert e.value.results == {0: {"rank": 0}} and e.value.exc_type == "ValueError"
    assert [f.rank for f in e.value.failures] == [1]


def test_a_value_that_cannot_come_back_is_not_restarted():
    def work():
        import os

        return _value_that_only_lives_in_workers(int(os.environ["RANK"]))

    with pytest.raises(LaunchError, match="a value that cannot come back") as e:
        _launch(work, return_all=True, max_restarts=1)
    assert "rank 1 returned a" in str(e.value) and e.value.results == {0: {"rank": 0}}


def test_one_process_here_names_an_unprintable_error():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    def fail():
        raise Unprintable("x")

    with pytest.raises(LaunchError, match=r"rank 0 .* raised .*Unprintable: .*Unprintable\('x'\)"):
        notebook_launcher(fail, num_processes=1, cpu=True)


@pytest.mark.parametrize(
    "code, expected",
    [("config file missing", "exited with code 1: config file missing"), (3, "exited with code 3")],
)
def test_one_process_here_keeps_a_system_exits_message_and_code(code, expected):
    def leave():
        raise SystemExit(code)

    with pytest.raises(LaunchError, match=rf"rank 0 \(pid \d+\) {expected} \(traceback above\)"):
        notebook_launcher(leave, num_processes=1, cpu=True)
    assert notebook_launcher(lambda: sys.exit(0), num_processes=1, cpu=True) is None


def test_only_the_values_the_call_returns_can_fail_it():
    def work():
        import os

        return _value_that_only_lives_in_workers(int(os.environ["RANK"]))

    from nbaccel import Run

    run = Run()
    assert _launch(work, run=run) == {"rank": 0}  # rank 1's value is not returned
    assert run.results == {0: {"rank": 0}}  # nor kept: it cannot be rebuilt here


def test_an_exception_whose_str_and_repr_raise_is_still_named():
    def fail():
        import os

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no str")

            def __repr__(self):
                raise RuntimeError("no repr")

        Unprintable.__module__ = "not_importable_in_the_kernel"  # its class cannot come back
        if os.environ["RANK"] == "1":
            raise Unprintable()

    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) raised \S*fail.<locals>.Unpr") as e:
        _launch(fail)
    shown = e.value.failures[0].traceback.splitlines()[-1]
    assert shown.startswith("not_importable_in_the_kernel.") and "fail.<locals>.Unpr" in shown
    assert shown.endswith(": <unprintable Unprintable>")


def test_an_exception_whose_str_raises_falls_back_to_its_repr():
    class Loud(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    class Text(str):  # a str subclass would not unpickle where its class is missing
        pass

    class Odd(Exception):
        def __str__(self):
            return Text("odd text")

    assert ExceptionData.of(Loud("x")).message == "Loud('x')"
    assert type_name(Loud()) == f"{__name__}.{Loud.__qualname__}" and type_name(1) == "int"
    message = ExceptionData.of(Odd()).message
    assert message == "odd text" and type(message) is str


@pytest.mark.parametrize(
    ("exit_with", "match"),
    [
        ('"config file missing"', r"rank 1 \(pid \d+\) exited with code 1: config file missing"),
        ("3", r"rank 1 \(pid \d+\) exited with code 3\n"),
    ],
)
def test_system_exit_keeps_its_message_and_code(exit_with, match):
    source = "def leave():\n    import os, sys\n    if os.environ['RANK'] == '1':\n"
    source += f"        sys.exit({exit_with})\n    return 0\n"
    scope: dict = {}
    exec(compile(source, "<cell>", "exec"), scope)

    with pytest.raises(LaunchError, match=match) as e:
        _launch(scope["leave"])
    assert e.value.rank == 1 and e.value.exc_type == "SystemExit"
    assert e.value.root_cause.exit_code == int(exit_with if exit_with.isdigit() else 1)
    assert "in leave" in str(e.value)  # where it was raised


def test_sys_exit_0_on_one_rank_is_one_warning(capfd):
    def leave():
        import os
        import sys

        if os.environ["RANK"] == "1":
            sys.exit(0)
        return "done"

    assert _launch(leave, return_all=True) == ["done", None]
    warnings = [line for line in capfd.readouterr().err.splitlines() if "sys.exit(0)" in line]
    assert len(warnings) == 1 and "rank 1 left through sys.exit(0)" in warnings[0]


def test_returning_normally_is_not_reported(capfd):
    assert _launch(lambda: "done") == "done"
    assert "sys.exit" not in capfd.readouterr().err
