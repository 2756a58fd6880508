"""Start: the chain DP's plan at targets raised above the budget that still fits it
(:func:`planner.solvers.stage_plans.loosened_plan`, solved with the first model), where it differs
from the plan at the budget."""

from __future__ import annotations

from planner.core.plan import Plan
from planner.solvers.context import SolveContext

__all__ = ["run"]


def run(ctx: SolveContext) -> Plan | None:
    first = ctx.first
    assert first is not None, "the first stage model is solved before the other starts"
    return first.raised if first.raised is not first.plan else None
