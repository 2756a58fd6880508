"""Start: the first model's plan on finer stages (:func:`planner.solvers.finer_rounds.on_finer_stages`),
from its plan at the budget, or from its raised-target plan where it found none there."""

from __future__ import annotations

from planner.core.plan import Plan
from planner.solvers.context import SolveContext
from planner.solvers.finer_rounds import on_finer_stages

__all__ = ["run"]


def run(ctx: SolveContext) -> Plan | None:
    options, first = ctx.options, ctx.first
    assert first is not None, "the first stage model is solved before the other starts"
    if not (options.finer_s > 0 and options.finer_rounds > 0):
        return None
    start = first.plan if first.plan is not None else first.raised
    if start is None or not ctx.deadline.allows("the finer rounds"):
        return None
    return on_finer_stages(ctx.graph, start, len(first.stages), ctx.budget_bytes, ctx.unoptimized_bytes,
                           selective=options.selective, solver=options.solver,
                           time_limit_s=ctx.deadline.cut(ctx.finer_limit_s), max_attempts=options.max_attempts,
                           started=ctx.started, rounds=options.finer_rounds, by_chain_dp=ctx.by_chain_dp)
