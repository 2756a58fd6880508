"""One plan for a budget in GiB from a profile: :func:`plan_for_budget`, what every capture path
(the graph, graph breaks, modules, compile) and the CLI solve with. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math

from planner.core.costgraph import CostGraph, hold_parameter_grads, protect_reads_before_writes, shard_parameters
from planner.core.errors import InfeasibleBudgetError, InputError, PlannerError
from planner.core.options import PlanOptions, check_budget_gb
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.solvers.hand_policies import HAND_PLACED, cheaper_hand_plans, hand_placed_within_noise
from planner.solvers.solve import solve
from planner.solvers.stage_plans import to_plan

__all__ = ["plan_for_budget", "budget_planning_at_least", "hand_plans_to_measure", "MEASURED_HAND_PLANS"]

#: At most this many hand-placed plans refused by the margin are measured after a plan is chosen:
#: each is one more measured training step (docs/tuning.md#measured_hand_plans).
MEASURED_HAND_PLANS = 2


def budget_planning_at_least(planning_bytes: int, reserve_bytes: int, safety_margin: float) -> int:
    """The smallest budget in bytes whose planning room (``plan_for_budget``'s arithmetic,
    floats included) is at least ``planning_bytes``."""
    budget = math.ceil(planning_bytes / (1 - safety_margin)) + reserve_bytes
    while int((budget - reserve_bytes) * (1 - safety_margin)) < planning_bytes:
        budget += 1
    while budget > reserve_bytes + 1 and int((budget - 1 - reserve_bytes) * (1 - safety_margin)) >= planning_bytes:
        budget -= 1
    return budget


def plan_for_budget(graph: CostGraph, budget_gb: float, options: PlanOptions = PlanOptions(), *,
                    grads_held: bool = False) -> Plan:
    """Solve ``graph`` for a budget in GiB with ``options``, keeping ``options.reserve_gb`` and
    ``options.safety_margin`` free.

    The returned plan's ``budget_bytes`` is the user's budget; its predicted peak stays under
    ``(budget - reserve) * (1 - safety_margin)``. An infeasible budget raises
    :class:`InfeasibleBudgetError` naming the smallest ``budget_gb`` (in bytes) that works.

    ``options.world_size`` > 1 plans the per-rank step with parameters and their gradients
    sharded over that many ranks (FSDP / ZeRO-3, see :func:`planner.core.costgraph.shard_parameters`);
    ``grads_held`` plans a step that starts with every ``.grad`` allocated (gradient accumulation).
    With ``options.offload`` the solve may also move held outputs to pinned host memory
    (:mod:`planner.solvers.starts.offload`); a hand-placed plan within the timing noise
    (:func:`planner.solvers.hand_policies.hand_placed_within_noise`) replaces only a plan
    without copies.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 2**20, True),))
        >>> plan_for_budget(g, 1.0, PlanOptions(safety_margin=0.0)).segments
        ()
    """
    budget_bytes = check_budget_gb(budget_gb)
    reserve_bytes = options.reserve_bytes
    if budget_bytes <= reserve_bytes:
        raise InputError(f"reserve_gb={options.reserve_gb} leaves no room inside budget_gb={budget_gb}")
    # a budget of a few bytes leaves none to plan with: the solver then names the smallest that works
    planning_bytes = max(1, int((budget_bytes - reserve_bytes) * (1 - options.safety_margin)))
    # set by the profiler from the captured graph: transformations the user asked for by name
    changes = tuple(graph.metadata.get("computation_changes", ()))
    try:
        graph = shard_parameters(graph, options.world_size)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    if grads_held:
        graph = hold_parameter_grads(graph)
    graph = protect_reads_before_writes(graph)
    try:
        plan = solve(graph, planning_bytes, options.solve_options())
    except InfeasibleBudgetError as exc:
        unoptimized = exc.unoptimized_peak_bytes
        if unoptimized is None:
            unoptimized = graph.measured_peak_bytes or simulate(graph).peak_bytes
        raise InfeasibleBudgetError(budget_bytes, budget_planning_at_least(
            exc.min_feasible_bytes, reserve_bytes, options.safety_margin), exc.note, unoptimized) from None
    if not plan.offloaded:  # a plan of copies is not traded for recompute within the timing noise
        plan = hand_placed_within_noise(graph, plan, planning_bytes)
    return dataclasses.replace(plan, budget_bytes=budget_bytes, computation_changes=changes)


def hand_plans_to_measure(graph: CostGraph, plan: Plan, options: PlanOptions, tolerance: float) -> list[Plan]:
    """The hand-placed plans (every layer, every k-th layer, ...) that cost less than ``plan``
    (:func:`planner.solvers.hand_policies.cheaper_hand_plans`) and were refused only by the
    planning margin: predicted at most ``tolerance`` above the budget less ``reserve_gb``, with no
    ``safety_margin``. At most :data:`MEASURED_HAND_PLANS`, cheapest first, as plans of ``plan``'s
    budget: where the training step can be measured, one of them that measures within the budget
    is the better plan, so a budget equal to every-layer's own measured peak gets every-layer's
    FLOPs, not a dearer plan squeezed under the margin.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 2**20, True),))
        >>> plan = plan_for_budget(g, 1.0)
        >>> hand_plans_to_measure(g, plan, PlanOptions(), 0.03)   # no layers, no hand plans
        []
    """
    room_bytes = plan.budget_bytes - options.reserve_bytes
    prepared = protect_reads_before_writes(shard_parameters(graph, options.world_size))
    hands = cheaper_hand_plans(prepared, plan, int(room_bytes * (1 + tolerance)))[:MEASURED_HAND_PLANS]
    return [dataclasses.replace(
        to_plan(prepared, list(hand.segments), plan.budget_bytes, plan.unoptimized_peak_bytes,
                simulate(prepared, hand.segments).peak_bytes, f"{HAND_PLACED}: {hand.name} (measured)", plan.solve_s),
        computation_changes=plan.computation_changes) for hand in hands]
