"""Start: what a person writes by hand (every k-th layer, matmul outputs kept,
:mod:`planner.solvers.hand_policies`), so the plan returned never costs more than one of them
that fits."""

from __future__ import annotations

from planner.core.plan import Plan
from planner.solvers.context import SolveContext
from planner.solvers.hand_policies import hand_placed_candidate

__all__ = ["run"]


def run(ctx: SolveContext) -> Plan | None:
    return hand_placed_candidate(ctx.graph, ctx.budget_bytes, ctx.unoptimized_bytes, ctx.started)
