"""The examples in the docstrings of the planner, the profiler and the rewrite run and print what
they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[1]
#: models the benchmarks measure, as the tuning notes name them
_MODEL_NAMES = re.compile(r"GPT-?2|\bLlama|\bBERT\b|\bT5\b|residual MLP|quality models|H100 profiles", re.IGNORECASE)


def test_tuning_links_name_a_section():
    headings = {line.lstrip("#").strip().strip("`").lower().replace(" ", "-")
                for line in (ROOT / "docs" / "tuning.md").read_text().splitlines() if line.startswith("#")}
    broken = [(str(path.relative_to(ROOT)), anchor) for package in ("planner", "profiling", "rewrite")
              for path in sorted((ROOT / package).rglob("*.py"))
              for anchor in re.findall(r"tuning\.md#([\w-]+)", path.read_text()) if anchor.lower() not in headings]
    assert not broken, f"links to no section of docs/tuning.md: {broken}"


def test_the_solver_side_recites_no_benchmark_runs():
    """A comment says why the code is as it is; the runs that chose it are in docs/tuning.md."""
    found = [f"{path.relative_to(ROOT)}:{number}" for layer in ("core", "solvers", "bounds", "milp")
             for path in sorted((ROOT / "planner" / layer).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if _MODEL_NAMES.search(line) and ">>>" not in line and "..." not in line[:20]]
    assert not found, f"benchmark models named in the solver side (move the figures to docs/tuning.md): {found}"
