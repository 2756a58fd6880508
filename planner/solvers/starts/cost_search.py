"""After the choice: the cost search's local moves judged by the simulator
(:func:`planner.solvers.refine.refine_segments`) on the chosen plan, and, where no start found a
plan, the smallest-peak plan as the fallback."""

from __future__ import annotations

import dataclasses

from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.context import SolveContext
from planner.solvers.refine import refine_segments
from planner.solvers.smallest_peak import exact_search_on, minimum_peak_plan
from planner.solvers.starts.exact_search import ExactOutcome

__all__ = ["refined", "fallback_plan"]


def refined(ctx: SolveContext, plan: Plan, on_stages: bool) -> Plan:
    """``plan`` improved by the cost search where that saves recompute time. A plan a stage
    model found (``on_stages``) is searched only with ``options.polish``, within the deadline:
    on real models the moves reach parts of the graph where the memory model has been less
    exact; any other plan gets ``options.refine_s``. The ILP's gap no longer bounds a changed
    plan, so it is then reported as unknown."""
    options = ctx.options
    if not on_stages:
        refine_s = options.refine_s
    else:
        refine_s = ctx.deadline.cut(options.refine_s) if options.polish and ctx.deadline.allows("the cost search") \
            else 0.0
    if refine_s > 0 and plan.segments and not any(s.selective for s in plan.segments):
        segments = refine_segments(ctx.graph, plan.segments, ctx.budget_bytes, time_limit_s=refine_s)
        cost = sum(s.recompute_ms for s in segments)
        if cost < plan.recompute_ms - 1e-9:
            peak = simulate(ctx.graph, segments).peak_bytes
            plan = dataclasses.replace(plan, segments=tuple(segments), predicted_peak_bytes=peak,
                                       optimality_gap=None, solver=f"{plan.solver} + refine")
    return dataclasses.replace(plan, solve_s=ctx.elapsed_s())


def fallback_plan(ctx: SolveContext, outcome: ExactOutcome) -> tuple[Plan | None, Plan]:
    """Where no start found a plan: the smallest-peak plan, made cheaper by the cost search when
    it fits, and that smallest-peak plan itself (the selective round starts from it). A plan
    that does not fit raises :class:`InfeasibleBudgetError` naming its peak; a selective solve
    returns None instead, since the segments-only solve can meet a budget its model misses."""
    options = ctx.options
    # within max_solve_s: the smallest peak found by then is what the refusal names
    fallback = outcome.smallest or minimum_peak_plan(
        ctx.graph, max_stages=options.max_stages, solver=options.solver,
        time_limit_s=ctx.deadline.cut(options.time_limit_s), refine_s=ctx.deadline.cut(options.refine_s),
        exact=exact_search_on(ctx.graph, options.exact), exact_s=ctx.deadline.cut(outcome.search_s),
        infeasible_bytes=ctx.budget_bytes if outcome.proven_infeasible else 0, lower_by_dp=not options.selective)
    if fallback.predicted_peak_bytes > ctx.budget_bytes:
        if not options.selective:
            raise InfeasibleBudgetError(ctx.budget_bytes, fallback.predicted_peak_bytes)
        return None, fallback
    # the fallback minimised the peak, so no gap on the recompute cost is known
    plan = dataclasses.replace(fallback, budget_bytes=ctx.budget_bytes, optimality_gap=None)
    return refined(ctx, plan, on_stages=False), fallback
