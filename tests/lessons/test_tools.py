"""The lessons' measuring of work run in threads and in processes (lesson 1's GIL section),
checked apart from the lesson that shows it."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from nbaccel.errors import NbaccelError
from nbaccel.lessons.tools import WorkerTimes, python_work, time_workers

STEPS = 2_000_000  # about 0.1 s of Python per worker here


def sum_of_squares(n: int) -> int:
    """What python_work(n) computes, by the formula."""
    return (n - 1) * n * (2 * n - 1) // 6 % 1_000_003


@pytest.mark.parametrize("n", [0, 1, 4, 1000, 123_457])
def test_python_work_is_the_sum_of_squares_modulo_a_prime(n):
    assert python_work(n) == sum_of_squares(n)


def test_cores_busy_is_cpu_seconds_per_wall_second():
    times = WorkerTimes("threads", (1, 2), (0, 0), (0.5, 0.25), wall_seconds=0.5)
    assert times.cores_busy == 1.5


def test_two_threads_under_one_gil_keep_at_most_one_core_busy_with_python():
    times = time_workers(python_work, STEPS, workers=2, kind="threads")
    assert times.results == (sum_of_squares(STEPS),) * 2, "each thread does all the work"
    assert len(set(times.ids)) == 2 and threading.get_ident() not in times.ids
    assert all(cpu > 0 for cpu in times.cpu_seconds)
    # One runs Python while the other waits, so their CPU seconds add up to about the wall
    # time. Were a thread's clock its process's (time.process_time()), each would count both
    # threads and this would be near 2.
    assert times.cores_busy <= 1.15, times


class OneWorks:
    """The first thread to call it does the work; the others wait for that without using a CPU
    (blocked on an event)."""

    def __init__(self) -> None:
        self.first, self.done = threading.Lock(), threading.Event()

    def __call__(self, steps: int) -> int | None:
        if self.first.acquire(blocking=False):
            try:
                return python_work(steps)
            finally:
                self.done.set()
        assert self.done.wait(timeout=120), "the working thread hung"  # catches a hang only
        return None


def test_a_threads_cpu_seconds_count_its_own_work_only():
    """One thread works while the other waits for it: the waiting one used next to no CPU time.
    With a process's clock (time.process_time()) each would count the working one's seconds.
    The verdict does not rest on the machine's speed or load: a blocked thread runs nothing."""
    times = time_workers(OneWorks(), STEPS, workers=2)
    assert set(times.results) == {None, sum_of_squares(STEPS)}
    waited, worked = sorted(times.cpu_seconds)
    assert worked > 0 and waited < worked / 10, times


@pytest.mark.multiprocess
def test_processes_each_do_the_work_in_an_interpreter_of_their_own():
    times = time_workers(python_work, STEPS, workers=2, kind="processes")
    assert times.results == (sum_of_squares(STEPS),) * 2
    assert len(set(times.ids)) == 2 and os.getpid() not in times.ids
    # A process of one thread uses at most one CPU second per wall second: the wall time spans
    # every worker's work, not only the overlap of the two
    assert 0 < max(times.cpu_seconds) <= 1.1 * times.wall_seconds, times
    assert not multiprocessing.active_children()


@pytest.mark.multiprocess
def test_a_process_may_return_any_value_a_string_too():
    assert time_workers(str, 5, workers=1, kind="processes").results == ("5",)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kind must be 'threads' or 'processes', not 'fibres'"):
        time_workers(python_work, 10, kind="fibres")
    with pytest.raises(ValueError, match="workers must be at least 1, not 0"):
        time_workers(python_work, 10, workers=0)


def test_a_process_is_not_given_a_function_it_cannot_import():
    def local():
        return 0

    def in_a_notebook():
        return 0

    in_a_notebook.__module__ = "__main__"  # as a function defined in a notebook's cell is
    for fn in (local, in_a_notebook, lambda: 0):
        with pytest.raises(TypeError, match=r"cannot .* define it in a module, e\.g\. nbaccel"):
            time_workers(fn, kind="processes")
    assert not multiprocessing.active_children()


def test_a_failing_thread_raises_its_own_exception():
    with pytest.raises(TypeError, match="'str' object cannot be interpreted as an integer"):
        time_workers(python_work, "many", kind="threads")


@pytest.mark.multiprocess
def test_a_failing_process_raises_with_its_traceback_and_leaves_no_child():
    with pytest.raises(NbaccelError, match=r"worker process \d failed:\n(.|\n)*TypeError: 'str'"):
        time_workers(python_work, "many", kind="processes")
    assert not multiprocessing.active_children()
