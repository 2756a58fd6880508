"""The examples in the docstrings of the planner, the profiler and the rewrite run and print what
they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import planner
import profiling
import rewrite

MODULES = sorted(info.name for package in (planner, profiling, rewrite)
                 for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
