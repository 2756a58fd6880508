"""Automatic activation-checkpoint planning.

The solver side (``CostGraph``, ``Plan``, ``simulate``, ``solve``) imports only the standard
library, PuLP and numpy, and nothing from torch. ``optimize`` needs torch and is loaded on
first use.

Example:
    >>> import planner
    >>> sorted(planner.__all__)[:3]
    ['CostGraph', 'CostNode', 'InfeasibleBudgetError']
"""

from __future__ import annotations

from typing import Any

# First, before any module below imports PuLP: load it and drop the tracebacks it keeps, which
# would otherwise pin the frames (and the locals) of whoever imports planner first.
from planner.milp.pulp_tracebacks import release_pulp_import_tracebacks  # isort: skip

release_pulp_import_tracebacks()

from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.errors import InfeasibleBudgetError, InputError, PlannerError, ProfileError, SolverError, TraceError
from planner.core.plan import Plan, Segment
from planner.bounds.reach import RecomputeBound, recompute_bound
from planner.core.simulate import SimulationResult, simulate
from planner.solvers.solve import available_solvers, minimum_peak_plan, solve

__all__ = [
    "CostGraph",
    "CostNode",
    "InfeasibleBudgetError",
    "InputError",
    "Plan",
    "PlannerError",
    "ProfileError",
    "RecomputeBound",
    "Segment",
    "SimulationResult",
    "SolverError",
    "Storage",
    "TraceError",
    "available_solvers",
    "disable",
    "enable",
    "minimum_peak_plan",
    "optimize",
    "recompute_bound",
    "simulate",
    "solve",
]


def __getattr__(name: str) -> Any:
    if name == "optimize":
        from planner.pipeline import optimize

        return optimize
    if name in ("enable", "disable"):
        from planner.integrations import inplace

        return getattr(inplace, name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
