"""Choose the segments to recompute: :func:`solve`, the planner's one entry point, reads as its
strategy: the starts in :data:`STARTS`, the exact search, and the cheapest plan that fits.

The graph is reduced to stages (:mod:`planner.core.stages`) and a linear memory account over their
chain (:mod:`planner.solvers.stage_model`), solved by the chain DP or as an ILP
(:mod:`planner.solvers.stage_plans`, :mod:`planner.solvers.stage_ilp`). Each start
(:mod:`planner.solvers.starts`) turns such models, or a rule, into a plan; every plan is replayed
by :func:`planner.core.simulate.simulate`, the judge. A budget no plan fits raises
:class:`InfeasibleBudgetError` naming the smallest peak found (:mod:`planner.solvers.smallest_peak`).
See docs/design.md#how-the-planner-decides.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> plan = solve(g, budget_bytes=9 * 2**20)
    >>> plan.predicted_peak_bytes <= 9 * 2**20 < simulate(g).peak_bytes
    True
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.options import SolveOptions, with_overrides
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.context import SolveContext, Start, checked_budget_bytes, cheapest
from planner.solvers.keep_round import cheapest_with_kept_outputs
from planner.solvers.smallest_peak import minimum_peak_plan
from planner.solvers.stage_ilp import MIP_GAP, available_solvers
from planner.solvers.starts import exact_search, finer_rounds, first_model, hand_placed, raised_target, short_segments
from planner.solvers.starts import offload as offload_step
from planner.solvers.starts.cost_search import fallback_plan, refined

__all__ = ["solve", "STARTS", "SolveOptions", "minimum_peak_plan", "available_solvers", "MIP_GAP"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: The starts after the first stage model, in precedence order (the earlier wins a tie).
STARTS: tuple[Start, ...] = (
    Start("finer rounds", finer_rounds.run),
    Start("short segments", short_segments.run),
    Start("raised target", raised_target.run),
    Start("hand-placed", hand_placed.run, on_stages=False),
)


def solve(graph: CostGraph, budget_bytes: int, options: SolveOptions | None = None, **overrides: Any) -> Plan:
    """The least-recompute plan whose simulated peak is at most ``budget_bytes``.

    ``options`` (:class:`SolveOptions`; its fields say what each does) or its fields by name in
    ``overrides``. The first stage model is solved, then every start of :data:`STARTS`; the exact
    search may find a cheaper plan or prove the first one the cheapest; the cheapest plan
    found is polished by the cost search, or, where none fits, the smallest-peak plan is the
    fallback. With ``selective``, op-level keep decisions follow on the chosen segments and on
    the segments-only optimum (:mod:`planner.solvers.keep_round`). With ``offload``, the
    offload step (:mod:`planner.solvers.starts.offload`) then compares that plan with held
    outputs moved to pinned host memory, by predicted extra step time
    (:attr:`planner.core.plan.Plan.extra_time_ms`).

    Raises:
        InfeasibleBudgetError: no plan found fits; the error names the smallest peak reached.
        SolverError: no solver is installed, or it found nothing in ``time_limit_s``.
    """
    options = with_overrides(options, overrides)
    ctx = SolveContext.begin(graph, checked_budget_bytes(budget_bytes), options)
    if ctx.unoptimized_bytes <= ctx.budget_bytes:
        return dataclasses.replace(ctx.plan_of([], ctx.unoptimized_bytes, "none"), solve_s=0.0)
    if not options.offload:
        return _recompute_plan(ctx)
    chosen: Plan | None = None
    refused: InfeasibleBudgetError | None = None
    try:
        chosen = _recompute_plan(ctx)
    except InfeasibleBudgetError as exc:  # offloading may still meet the budget
        refused = exc
    return offload_step.run(ctx, chosen, refused)


def _recompute_plan(ctx: SolveContext) -> Plan:
    """The cheapest plan of recompute the starts, the exact search and the cost search find,
    or the smallest-peak plan where none fits; with ``selective``, outputs kept inside it."""
    options = ctx.options
    ctx.first = first_model.run(ctx)
    found = [(start.run(ctx), start.on_stages) for start in STARTS]
    outcome = exact_search.run(ctx, cheapest([ctx.first.plan, *(plan for plan, _ in found)]))
    candidates = [(plan, on_stages) for plan, on_stages in
                  [(outcome.plan, ctx.first.plan is not None), *found] if plan is not None]
    fallback: Plan | None = None
    if candidates:
        chosen, on_stages = min(candidates, key=lambda candidate: candidate[0].recompute_ms)
        plan: Plan | None = refined(ctx, chosen, on_stages)
    else:
        plan, fallback = fallback_plan(ctx, outcome)
    if options.selective:
        plan = _with_kept_outputs(ctx, plan, fallback)
    if ctx.deadline.reached():
        log.info("max_solve_s=%g s reached after %.1f s: the plan is the cheapest found by then (%.2f ms)",
                 options.max_solve_s, ctx.elapsed_s(), plan.recompute_ms)
        plan = dataclasses.replace(plan, hit_time_limit=True)
    return plan


def _with_kept_outputs(ctx: SolveContext, plan: Plan | None, fallback: Plan | None) -> Plan:
    """The cheapest of ``plan`` (the selective model's segments), the segments-only optimum
    and the smallest-peak plan ``fallback``, each with outputs kept where that saves time: the
    selective model's segments are not always as cheap as the segments-only optimum. When
    keeping pays nowhere this is the segments-only optimum."""
    options = ctx.options
    try:
        plain: Plan | None = solve(ctx.graph, ctx.budget_bytes, dataclasses.replace(
            options, selective=False, offload=False, max_solve_s=ctx.deadline.left_s_or_none()))
    except InfeasibleBudgetError:
        if plan is None:
            raise
        plain = None
    kept = cheapest_with_kept_outputs(ctx.graph, [p for p in (plan, plain) if p is not None], ctx.budget_bytes,
                                      fallback, max_stages=options.max_stages, solver=options.solver,
                                      time_limit_s=options.time_limit_s, refine_s=options.refine_s,
                                      deadline=ctx.deadline)
    return dataclasses.replace(kept, solve_s=ctx.elapsed_s())
