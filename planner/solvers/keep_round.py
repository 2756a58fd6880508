"""The keep round of a selective solve: op-level kept outputs on the candidates' segments.

:func:`cheapest_with_kept_outputs` takes the plans a selective :func:`planner.solvers.solve.solve`
found (its selective model's and the segments-only optimum) and lets
:func:`planner.solvers.keep.keep_outputs` keep node outputs inside their segments and in the
finer segments of the smallest-peak plan where the budget is close to that peak; the cheapest
plan wins, so keeping never costs more than the segments-only plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from planner.core.costgraph import CostGraph
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.deadline import SolveDeadline
from planner.solvers.keep import keep_outputs
from planner.solvers.smallest_peak import minimum_peak_plan

__all__ = ["KEEP_FROM_SMALLEST_PEAK_WITHIN", "cheapest_with_kept_outputs"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Budgets within this of the smallest peak keep outputs in its plan (docs/tuning.md#keep_from_smallest_peak_within).
KEEP_FROM_SMALLEST_PEAK_WITHIN = 1.10


def cheapest_with_kept_outputs(
    graph: CostGraph,
    plans: list[Plan],
    budget_bytes: int,
    fallback: Plan | None,
    *,
    max_stages: int,
    solver: str | None,
    time_limit_s: float,
    refine_s: float,
    deadline: SolveDeadline | None = None,
) -> Plan:
    """The cheapest of ``plans`` and of op-level keep decisions (:func:`planner.solvers.keep.keep_outputs`)
    on their segments and on the finer ones of the smallest-peak plan (``fallback``, solved
    here when ``None`` and the budget is within :data:`KEEP_FROM_SMALLEST_PEAK_WITHIN` of the
    smallest-peak ILP's peak), each of whose room below the budget is then filled with kept outputs."""
    if fallback is None:
        rough = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                  refine_s=0, exact=False, lower_by_dp=False)
        if budget_bytes <= KEEP_FROM_SMALLEST_PEAK_WITHIN * rough.predicted_peak_bytes:
            fallback = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                         refine_s=refine_s, lower_by_dp=False)
        else:
            log.info("keep search: the budget is %.2fx the smallest-peak ILP's peak, so its plan is no start",
                     budget_bytes / rough.predicted_peak_bytes)
    starts = [(p.segments, p.solver) for p in plans]
    if fallback is not None and fallback.segments and fallback.predicted_peak_bytes <= budget_bytes:
        starts.append((fallback.segments, fallback.solver))
    best = min(plans, key=lambda p: p.recompute_ms)
    deadline = deadline or SolveDeadline(time.perf_counter(), None)
    for segments, solver_name in starts:
        if not deadline.allows(f"keeping outputs in the plan of {solver_name}"):
            break
        kept_s = deadline.cut(max(refine_s, 1.0))
        kept = keep_outputs(graph, segments, budget_bytes, time_limit_s=kept_s)
        cost = sum(s.recompute_ms for s in kept)
        if kept and cost < best.recompute_ms - 1e-9:
            peak = simulate(graph, kept).peak_bytes
            best = dataclasses.replace(best, budget_bytes=budget_bytes, segments=tuple(kept),
                                       predicted_peak_bytes=peak, optimality_gap=None, hit_time_limit=False,
                                       solver=f"{solver_name} + keep")
    return best
