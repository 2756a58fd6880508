"""The examples in the planner's docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import planner

MODULES = sorted(info.name for info in pkgutil.iter_modules(planner.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"planner.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in planner.{name} failed"
