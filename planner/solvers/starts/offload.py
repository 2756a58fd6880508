"""The solve's offload step (``SolveOptions.offload``): held outputs to pinned host memory where
that predicts less extra step time than recompute alone.

It runs once the cheapest plan of recompute is chosen, not as one of the starts of
:data:`planner.solvers.solve.STARTS`: :func:`planner.solvers.offload.offload_plan` works around a
plan's segments, and the plan it does best from is the cheapest the starts, the exact search
and the cost search found together, which no single start sees. Its candidates, compared by
:attr:`planner.core.plan.Plan.extra_time_ms` (recompute plus the copies the compute waits for),
the earlier on a tie:

1. the chosen plan of recompute, where one fits;
2. the offload start around it (around the smallest-peak plan where none fits);
3. *every held output offloaded*: every layer checkpointed and every output the step holds
   from the forward to the backward offloaded (what ``save_on_cpu`` around gradient
   checkpointing does), so the solve never predicts more than that where it fits.

Where none fits, :class:`InfeasibleBudgetError` names the smallest peak the recompute plans and
these offloads reach. Where ``max_solve_s`` is spent before the step starts and a plan of
recompute fits, that plan is returned without offloads; where none fits, the step runs
regardless, as the only way to a plan.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.options import SolveOptions
    >>> from planner.solvers.context import SolveContext
    >>> def relu(name, src, k):
    ...     return CostNode(name, "relu", input_names=(src,), output_storages=(k,), saved_storages=(k,),
    ...                     output_bytes=1000, requires_grad=True, time_ms=1.0)
    >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)), relu("a", "x", 2),
    ...                relu("b", "a", 3), relu("c", "b", 4), relu("d", "c", 5)),
    ...               tuple(Storage(k, 1000, k == 1) for k in range(1, 6)), output_names=("d",), step_ms=12.0)
    >>> ctx = SolveContext.begin(g, 6000, SolveOptions(offload=True, host_bandwidth_gbps=1e-3))
    >>> plan = run(ctx, None)   # no plan of recompute given: from the smallest-peak plan
    >>> plan.offloaded, plan.extra_time_ms, plan.predicted_peak_bytes <= 6000
    (('a',), 0.0, True)
"""

from __future__ import annotations

import dataclasses
import logging
import math

from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.offload import OffloadSimulation, OffloadSpec
from planner.core.options import SolveOptions
from planner.core.plan import Plan, Segment
from planner.solvers.context import SolveContext
from planner.solvers.hand_policies import HAND_PLACED, hand_placed_plans
from planner.solvers.offload import offload_everything, offload_floor, offload_plan, with_offloads
from planner.solvers.smallest_peak import minimum_peak_plan

__all__ = ["run", "every_output_offloaded", "smallest_offload_peak", "EVERY_OUTPUT_OFFLOADED"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: The name of candidate 3 (its plan's solver is ``"hand-placed: every layer, every held output offloaded"``).
EVERY_OUTPUT_OFFLOADED = "every layer, every held output offloaded"


def every_output_offloaded(graph: CostGraph, spec: OffloadSpec,
                           limit_bytes: float = math.inf) -> tuple[tuple[Segment, ...], OffloadSimulation] | None:
    """Every layer checkpointed (the hand-placed ``"every layer"`` plan) and every held output
    offloaded over ``spec``'s link: its segments and its replay; None where the graph has no
    layers, the outputs need more pinned host memory than ``spec`` allows, or the replay peaks
    above ``limit_bytes``."""
    every = next((hand for hand in hand_placed_plans(graph) if hand.name == "every layer"), None)
    if every is None:
        return None
    result = offload_everything(graph, every.segments, spec, limit_bytes=limit_bytes)
    if result is None or result.peak_bytes > limit_bytes:
        return None
    return every.segments, result


def smallest_offload_peak(graph: CostGraph, smallest: Plan, options: SolveOptions) -> int:
    """The smallest peak of the offload step's plans as far as it is known: ``smallest`` (the
    smallest-peak plan of recompute, :func:`planner.solvers.smallest_peak.minimum_peak_plan`),
    that plan with its held outputs offloaded (:func:`planner.solvers.offload.offload_floor`),
    and every held output offloaded around every layer, over ``options``' host link: the
    smallest budget a solve with ``offload`` names when it refuses one.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> def relu(name, src, k):
        ...     return CostNode(name, "relu", input_names=(src,), output_storages=(k,), saved_storages=(k,),
        ...                     output_bytes=1000, requires_grad=True, time_ms=1.0, recomputable=False)
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)), relu("a", "x", 2),
        ...                relu("b", "a", 3), relu("c", "b", 4), relu("d", "c", 5)),
        ...               tuple(Storage(k, 1000, k == 1) for k in range(1, 6)), output_names=("d",), step_ms=12.0)
        >>> smallest = minimum_peak_plan(g)   # nothing can be recomputed
        >>> smallest.predicted_peak_bytes, smallest_offload_peak(g, smallest, SolveOptions(host_bandwidth_gbps=1e-3))
        (7000, 6000)
    """
    spec = options.offload_spec()
    every = every_output_offloaded(graph, spec)
    return min(smallest.predicted_peak_bytes, offload_floor(graph, smallest.segments, spec),
               *([every[1].peak_bytes] if every is not None else []))


def run(ctx: SolveContext, chosen: Plan | None, refused: InfeasibleBudgetError | None = None) -> Plan:
    """The candidate of least predicted extra time (module docstring); ``chosen``: the solve's
    plan of recompute, None where none fits the budget (``refused``: its refusal, if any).

    Raises:
        InfeasibleBudgetError: no candidate fits; it names the smallest of ``refused``'s budget,
            :func:`smallest_offload_peak` and candidate 3's peak.
    """
    spec = ctx.options.offload_spec()
    smallest: Plan | None = None
    base = chosen
    if base is None:
        options = ctx.options
        smallest = base = minimum_peak_plan(
            ctx.graph, max_stages=options.max_stages, solver=options.solver,
            time_limit_s=ctx.deadline.cut(options.time_limit_s), refine_s=ctx.deadline.cut(options.refine_s),
            exact=False, lower_by_dp=not options.selective)
    if chosen is not None and not ctx.deadline.allows("the offload step"):
        return chosen  # max_solve_s is spent: the plan of recompute stands
    candidates = [plan for plan in (chosen, offload_plan(ctx.graph, ctx.budget_bytes, base, spec),
                                    _every_output_offloaded_plan(ctx, spec)) if plan is not None]
    if not candidates:
        assert smallest is not None  # a chosen plan fits the budget
        floor = smallest_offload_peak(ctx.graph, smallest, ctx.options)
        raise InfeasibleBudgetError(ctx.budget_bytes, min(floor, refused.min_feasible_bytes) if refused else floor)
    best = min(candidates, key=lambda plan: plan.extra_time_ms)
    if best is not chosen:
        log.info("offload step: %s, %.2f ms extra (%.2f recompute + %.2f of copies), %.1f MiB to host memory",
                 best.solver, best.extra_time_ms, best.recompute_ms, best.exposed_transfer_ms,
                 best.offloaded_bytes / 2**20)
    return dataclasses.replace(best, budget_bytes=ctx.budget_bytes, solve_s=ctx.elapsed_s())


def _every_output_offloaded_plan(ctx: SolveContext, spec: OffloadSpec) -> Plan | None:
    """Candidate 3 as a plan of this solve, where it fits the budget."""
    found = every_output_offloaded(ctx.graph, spec, ctx.budget_bytes)
    if found is None:
        return None
    segments, result = found
    base = ctx.plan_of(segments, result.peak_bytes, HAND_PLACED)
    return with_offloads(base, segments, result, f"{HAND_PLACED}: {EVERY_OUTPUT_OFFLOADED}")
