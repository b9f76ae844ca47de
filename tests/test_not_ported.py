"""Accelerate's names that nbaccel leaves out on purpose: importing one says why and what to use
(``errors.NOT_PORTED``), where Python alone would say only "cannot import name"."""

from __future__ import annotations

import importlib

import pytest

import nbaccel
from nbaccel.errors import NOT_PORTED, NotPortedError


@pytest.mark.parametrize("module", ["nbaccel", "nbaccel.utils"])
@pytest.mark.parametrize("name", sorted(NOT_PORTED))
def test_importing_a_name_left_out_says_why(module, name):
    with pytest.raises(ImportError) as caught:
        exec(f"from {module} import {name}", {})
    assert isinstance(caught.value, NotPortedError)
    assert f"{module}.{name}" in str(caught.value) and NOT_PORTED[name] in str(caught.value)


def test_the_names_left_out_are_accelerates_and_not_nbaccels():
    accelerate = pytest.importorskip("accelerate")
    utils = importlib.import_module("accelerate.utils")
    for name in NOT_PORTED:
        assert hasattr(accelerate, name) or hasattr(utils, name), name
        assert name not in nbaccel.__all__ and name not in nbaccel.utils.__all__, name


def test_other_missing_names_keep_pythons_errors():
    assert not hasattr(nbaccel, "no_such_name")
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'") as caught:
        exec("from nbaccel import no_such_name", {})
    assert not isinstance(caught.value, NotPortedError)


def test_the_accelerators_profiler_context_says_what_to_use():
    with pytest.raises(NotImplementedError, match=r"torch\.profiler\.profile\(\)"):
        nbaccel.Accelerator(live=False).profile()
