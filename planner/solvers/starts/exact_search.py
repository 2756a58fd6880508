"""The exact search after the starts: an optimistic memory account over the first model's
stages, solved and checked against the simulator until a plan fits
(:mod:`planner.solvers.relaxation`). It either proves the first model's plan the cheapest over
the stages or finds a cheaper one, also where no start found any. Where no start found a plan
on a graph of 64 compute nodes or more, the smallest peak is found first and a budget below it
is refused at once."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.context import SolveContext
from planner.solvers.refine import ALL_CUTS_BELOW
from planner.solvers.relaxation import search_cheapest
from planner.solvers.smallest_peak import exact_search_on, minimum_peak_plan
from planner.solvers.stage_ilp import MIP_GAP, IlpResult, choose_solver, run_solver
from planner.solvers.stage_plans import stage_segments

__all__ = ["run", "ExactOutcome", "searched_by_default", "cheapest_by_optimistic_account", "EXACT_BY_DEFAULT_BELOW", "EXACT_WHEN_UNUSED",
           "EXACT_IMPROVE_S"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Compute nodes below which the exact search runs by default (docs/tuning.md#exact_by_default_below).
EXACT_BY_DEFAULT_BELOW = 512
#: Share of the budget a plan must leave unused for that default search (docs/tuning.md#exact_when_unused).
EXACT_WHEN_UNUSED = 0.01
#: Seconds the default search may take when a plan is already in hand, so that it can only
#: make that plan cheaper or prove it the cheapest (docs/tuning.md#exact_improve_s).
EXACT_IMPROVE_S = 2.5


@dataclass(frozen=True)
class ExactOutcome:
    """``plan``: the first model's plan (with its gap where the search proved it the cheapest),
    the search's cheaper plan, or None; ``proven_infeasible``: the search proved no plan over the
    stages fits; ``smallest``: the smallest-peak plan where it was found first; ``search_s``: the
    seconds the search was given (the fallback's smallest-peak bisection gets the same)."""

    plan: Plan | None
    proven_infeasible: bool
    smallest: Plan | None
    search_s: float


def run(ctx: SolveContext, cheaper: Plan | None) -> ExactOutcome:
    """The search where it pays (:func:`searched_by_default`), given ``cheaper``, the cheapest
    plan of the starts (its cost is the search's cut-off)."""
    options, first, graph = ctx.options, ctx.first, ctx.graph
    assert first is not None, "the first stage model is solved before the exact search"
    search_s = options.time_limit_s if options.exact else min(options.time_limit_s, options.exact_s)
    smallest: Plan | None = None
    if cheaper is None and options.exact is None and not options.selective and len(graph.compute_nodes) >= ALL_CUTS_BELOW:
        # a budget below the smallest peak is refused at once: proving that no plan fits by
        # the exact search costs far more (docs/design.md#exact-search)
        smallest = minimum_peak_plan(graph, max_stages=options.max_stages, solver=options.solver,
                                     time_limit_s=options.time_limit_s, refine_s=options.refine_s, exact=False)
        if smallest.predicted_peak_bytes > ctx.budget_bytes:
            raise InfeasibleBudgetError(ctx.budget_bytes, smallest.predicted_peak_bytes)
    in_hand = cheaper or smallest
    if in_hand is not None:  # with a plan in hand the search only improves it: bounded by the deadline
        search_s = ctx.deadline.cut(search_s if options.exact else min(search_s, EXACT_IMPROVE_S))
    plan, proven_infeasible = first.plan, False
    if (not options.selective and searched_by_default(graph, options.exact, cheaper, ctx.budget_bytes)
            and (in_hand is None or ctx.deadline.allows("the exact search"))):
        log.info("exact search for a cheaper plan (up to %.0f s): %s", search_s,
                 "the stage models found none" if cheaper is None else
                 f"the ILP's plan leaves {1 - cheaper.predicted_peak_bytes / ctx.budget_bytes:.1%} of the budget unused")
        plan, proven_infeasible = cheapest_by_optimistic_account(
            ctx, first.plan, search_s, incumbent_ms=in_hand.recompute_ms if in_hand is not None else None)
    return ExactOutcome(plan, proven_infeasible, smallest, search_s)


def searched_by_default(graph: CostGraph, exact: bool | None, plan: Plan | None, budget_bytes: int) -> bool:
    """Whether the exact search runs: ``exact``; by default on graphs under 64 compute nodes,
    and on graphs under :data:`EXACT_BY_DEFAULT_BELOW` compute nodes where the starts found no
    ``plan`` or one that leaves more than :data:`EXACT_WHEN_UNUSED` of the budget unused."""
    compute_count = len(graph.compute_nodes)
    if exact is not None or compute_count < ALL_CUTS_BELOW:
        return exact_search_on(graph, exact)
    if compute_count >= EXACT_BY_DEFAULT_BELOW:
        return False
    return plan is None or plan.predicted_peak_bytes < budget_bytes * (1 - EXACT_WHEN_UNUSED)


def cheapest_by_optimistic_account(ctx: SolveContext, plan: Plan | None, time_limit_s: float,
                                   incumbent_ms: float | None = None) -> tuple[Plan | None, bool]:
    """``plan`` (the first model's, or None), or the cheaper plan over the first model's stages
    that :func:`planner.solvers.relaxation.search_cheapest` finds; a plan the search proves the
    cheapest gets the MIP gap as its optimality gap, measured against the simulator's account.
    And whether the search proved that no plan over the stages fits the budget.
    ``incumbent_ms``: the cost of the cheapest plan in hand, found on these or other stages
    (default: ``plan``'s); the search looks only for cheaper ones (a cut-off in its MILP), so
    finding none proves nothing infeasible, and proves ``plan`` the cheapest only when it is
    the plan in hand."""
    assert ctx.first is not None
    name = choose_solver(ctx.options.solver)
    if incumbent_ms is None:
        incumbent_ms = plan.recompute_ms if plan is not None else math.inf
    found = search_cheapest(ctx.graph, ctx.first.model.stages, ctx.budget_bytes, incumbent_ms,
                            lambda prob: run_solver(prob, name, time_limit_s, presolve=False), time_limit_s=time_limit_s)
    log.info("optimistic account: %d candidates, %s", found.candidates,
             "cheaper plan found" if found.runs is not None else "proven" if found.proven else "stopped")
    if found.runs is None:
        if (plan is not None and found.proven and not plan.hit_time_limit
                and incumbent_ms >= plan.recompute_ms - 1e-9):
            plan = dataclasses.replace(plan, optimality_gap=MIP_GAP)
        return plan, plan is None and found.proven and incumbent_ms == math.inf
    segments = stage_segments(ctx.graph, ctx.first.model, found.runs)
    label = f"{plan.solver if plan is not None else name} + exact"
    return ctx.plan_of(segments, simulate(ctx.graph, segments).peak_bytes, label,
                       IlpResult(found.runs, label, MIP_GAP if found.proven else None, found.hit_time_limit)), False
