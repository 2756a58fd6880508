"""Plans for many budgets from one profile: the memory/overhead Pareto front.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> plans = sweep(g, points=4)
    >>> [p.recompute_ms for p in plans] == sorted((p.recompute_ms for p in plans), reverse=True)
    True
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.options import PlanOptions, with_overrides
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.solve import minimum_peak_plan, solve
from planner.solvers.starts.offload import smallest_offload_peak
from planner.core.units import MIB

__all__ = ["sweep", "pareto_front", "SWEEP_MAX_SOLVE_S", "SWEEP_TIME_LIMIT_S"]

log = logging.getLogger(__name__)

#: Seconds each budget of a sweep improves its plan for when the caller sets no bound: a sweep is
#: an overview, and must not take minutes where one plan takes seconds.
SWEEP_MAX_SOLVE_S = 5.0
#: Seconds each ILP of a sweep may run (the smallest-peak search's included) when the caller's
#: limit is longer: one stuck MILP solve must not hold the whole sweep.
SWEEP_TIME_LIMIT_S = 10.0


def sweep(
    graph: CostGraph,
    budgets_bytes: Sequence[int] | None = None,
    options: PlanOptions | None = None,
    *,
    points: int = 8,
    **overrides: Any,
) -> list[Plan]:
    """One plan per budget, smallest budget first; infeasible budgets are skipped.

    Without ``budgets_bytes``, ``points`` budgets are spread evenly from the smallest feasible
    peak to the unoptimized peak (with ``offload``, from the smallest peak offloading reaches:
    :func:`planner.solvers.starts.offload.smallest_offload_peak`). Costs (predicted extra step
    time, copies the compute waits for included) never rise with the budget: when a budget's
    own plan costs more than a smaller budget's, the cheaper plan (which fits the larger budget
    too) is used for it. As in :func:`planner.pipeline.plan_for_budget`, each plan's predicted peak stays
    ``safety_margin`` below its budget (allocator rounding the profile does not see).
    ``options`` (:class:`planner.core.options.PlanOptions`, or its fields by name in
    ``overrides``) are each solve's; ``max_solve_s`` bounds each budget's solve (:func:`planner.solvers.solve.solve`; default
    :data:`SWEEP_MAX_SOLVE_S`), and each ILP runs for at most :data:`SWEEP_TIME_LIMIT_S`.
    """
    options = with_overrides(options if options is not None else PlanOptions(), overrides)
    safety_margin = options.safety_margin
    options = dataclasses.replace(
        options, time_limit_s=min(options.time_limit_s, SWEEP_TIME_LIMIT_S),
        max_solve_s=SWEEP_MAX_SOLVE_S if options.max_solve_s is None else options.max_solve_s)
    if budgets_bytes is None:
        if points < 2:
            raise ValueError("points must be at least 2")
        # the margin sits below each budget: the ends are the smallest feasible and the
        # unoptimized peaks plus their margin (and a few bytes for rounding)
        smallest = minimum_peak_plan(graph, options.solve_options())
        floor = smallest_offload_peak(graph, smallest, options) if options.offload else smallest.predicted_peak_bytes
        low = math.ceil(floor / (1 - safety_margin)) + 2
        high = math.ceil(simulate(graph).peak_bytes / (1 - safety_margin)) + 2
        if low >= high:
            log.warning("sweep: no plan peaks below the unoptimized %.1f MiB (nothing in this graph can be "
                        "recomputed for less memory): one budget", high / MIB)
        budgets_bytes = sorted({round(low + (high - low) * i / (points - 1)) for i in range(points)})
    plans: list[Plan] = []
    for n, budget in enumerate(sorted(budgets_bytes), start=1):
        try:
            plan = solve(graph, int(budget * (1 - safety_margin)), options.solve_options())
            plan = dataclasses.replace(plan, budget_bytes=int(budget))
            if plans and plans[-1].extra_time_ms < plan.extra_time_ms:
                plan = dataclasses.replace(plans[-1], budget_bytes=int(budget))
            plans.append(plan)
        except InfeasibleBudgetError:
            log.warning("sweep: no plan fits %.1f MiB; that budget is left out", budget / MIB)
        log.info("sweep: %d/%d budgets solved", n, len(budgets_bytes))
    return plans


def pareto_front(plans: Sequence[Plan]) -> list[Plan]:
    """The plans no other plan beats on both predicted peak and extra step time (recompute plus
    exposed copies), by peak."""
    front: list[Plan] = []
    for plan in sorted(plans, key=lambda p: (p.predicted_peak_bytes, p.extra_time_ms)):
        if not front or plan.extra_time_ms < front[-1].extra_time_ms:
            front.append(plan)
    return front
