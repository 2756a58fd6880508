"""The graph-break path: plan a model ``torch.export`` cannot capture over the ATen ops its step runs.

:func:`plan_graph_breaks` profiles the step op by op (:mod:`profiling.graph_breaks`: the Python
between graph breaks runs as it is and shows only as opaque tensor entries), solves that
:class:`CostGraph` with the same solvers and hand-placed candidates as the graph path
(:func:`planner.pipeline.plan_for_budget`), and returns the model with the plan's op ranges
checkpointed (:mod:`rewrite.graph_breaks`). Its step is measured: a plan measured above the
budget is solved again holding the difference all step (up to ``MAX_TIGHTENINGS`` times), and
where no plan fits with it held, the smallest-peak plan is measured before the budget is refused.
It needs torch; ``planner.pipeline`` imports it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
    >>> opt = plan_graph_breaks(model, (torch.randn(64, 32),), budget_gb=1.0, timing_repeats=1)
    >>> opt.plan.capture, opt.plan.subgraphs, opt.regions
    ('graph-breaks', 1, ())
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from planner.core.costgraph import CostGraph, with_held_bytes
from planner.core.errors import InfeasibleBudgetError, InputError
from planner.core.options import PlanOptions, check_budget_gb
from planner.core.plan import GIB, Plan
from planner.core.simulate import simulate
from planner.budget_plan import plan_for_budget
from planner.graph_break_layers import cheaper_module_layers
from planner.solvers.hand_policies import hand_placed_plans
from profiling.graph_breaks import profile_op_stream
from profiling.measure import StepInputs, TrainingStep, device_of, measure_step_peak_bytes
from rewrite.graph_breaks import BreakCheckpointedModule, input_signature, segment_regions
from rewrite.region_overhead import measured_range_overhead_ms_per_op
from planner.capture_options import CaptureOptions

__all__ = ["plan_graph_breaks", "graph_break_plan", "MAX_TIGHTENINGS", "MEASURED_FIT_TOLERANCE",
           "MAX_MEASURED_CANDIDATES"]

log = logging.getLogger(__name__)

#: Times a plan measured above its budget is solved again with the overshoot held all step.
MAX_TIGHTENINGS = 3

#: A budget the prediction refuses by at most this share is tried on measured steps: the
#: op-level replay holds some saved tensors a little longer than the allocator sees them.
MEASURED_FIT_TOLERANCE = 0.15

#: At most this many plans are measured for a budget the prediction refuses.
MAX_MEASURED_CANDIDATES = 4


def graph_break_plan(graph: CostGraph, budget_gb: float, options: PlanOptions = PlanOptions()) -> Plan:
    """``graph`` (an op-stream profile) solved for ``budget_gb``, labelled with its capture.

    Example:
        >>> import torch
        >>> from profiling.graph_breaks import profile_op_stream
        >>> g = profile_op_stream(torch.nn.Linear(4, 4), (torch.randn(2, 4),), timing_repeats=1)
        >>> graph_break_plan(g, 1.0).capture
        'graph-breaks'
    """
    plan = plan_for_budget(graph, budget_gb, dataclasses.replace(options, selective=False))
    return dataclasses.replace(plan, capture="graph-breaks", subgraphs=int(graph.metadata.get("subgraphs", 1)),
                               measured_unoptimized_peak_bytes=graph.measured_peak_bytes)


def plan_graph_breaks(model: Any, example_inputs: Any, budget_gb: float, options: PlanOptions = PlanOptions(), *,
                      timing_repeats: int | None = CaptureOptions.timing_repeats, step: Any = None,
                      cache_dir: str | None = None) -> Any:
    """Plan ``model`` over the ATen ops of its step for ``budget_gb`` and return the checkpointed
    module (:class:`rewrite.graph_breaks.BreakCheckpointedModule`) whose measured step peak is
    within the budget. Inputs of another shape are profiled and planned again on first use.
    Where every k-th layer checkpointed as whole module calls is predicted cheaper than the op
    ranges and measures within the budget, that module is returned instead
    (:func:`planner.graph_break_layers.cheaper_module_layers`).
    ``cache_dir``: where op-stream profiles are kept (:func:`profiling.graph_breaks.profile_op_stream`;
    None: not kept).

    Raises:
        InfeasibleBudgetError: no plan over the op stream fits; the message names the smallest
            budget that does.
    """
    step = step if step is not None else TrainingStep()
    budget_bytes = check_budget_gb(budget_gb)
    if options.world_size != 1:
        raise InputError(f"the graph-break path plans one process: world_size must be 1, got {options.world_size}")
    inputs = StepInputs.from_example(example_inputs)
    room_bytes = budget_bytes - options.reserve_bytes
    graph = _op_stream_profile(model, inputs, timing_repeats, step, cache_dir)
    try:
        plan, regions = _planned(model, inputs, graph, budget_gb, options, step)
    except InfeasibleBudgetError:  # every k-th layer as module calls may still fit
        layers = cheaper_module_layers(model, inputs, step, graph, budget_bytes, room_bytes, MEASURED_FIT_TOLERANCE)
        if layers is None:
            raise
        return layers
    layers = cheaper_module_layers(model, inputs, step, graph, budget_bytes, room_bytes, MEASURED_FIT_TOLERANCE,
                                   than=plan)
    if layers is not None:  # whole layers as module calls: no op replayed in Python
        return layers

    def replan(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        other = StepInputs(tuple(args), dict(kwargs))
        other_graph = _op_stream_profile(model, other, timing_repeats, step, cache_dir)
        return (*_planned(model, other, other_graph, budget_gb, options, step), other_graph)

    return BreakCheckpointedModule(model, plan, regions, cost_graph=graph,
                                   expected_ops=graph.metadata.get("op_names"),
                                   signature=input_signature(inputs.args, inputs.kwargs), replan=replan)


def _op_stream_profile(model: Any, inputs: Any, timing_repeats: int | None, step: Any, cache_dir: str | None) -> CostGraph:
    """The op-stream profile of ``model``'s step on ``inputs``, with each op of a recomputed range
    priced for its recording and replay in Python."""
    graph = profile_op_stream(model, inputs, timing_repeats=timing_repeats, step=step, cache_dir=cache_dir)
    graph = dataclasses.replace(graph, range_overhead_ms_per_node=measured_range_overhead_ms_per_op(
        device_of(model, inputs)), range_end_saves_held=True)
    log.info("graph-break profile: %d ops in %d subgraphs, unoptimized peak %.4f GiB measured, %.4f ms per op "
             "recorded in a checkpointed range", graph.metadata["model_ops"], graph.metadata["subgraphs"],
             (graph.measured_peak_bytes or 0) / GIB, graph.range_overhead_ms_per_node)
    return graph


def _planned(model: Any, inputs: Any, graph: CostGraph, budget_gb: float, options: PlanOptions,
             step: Any) -> tuple[Plan, tuple[tuple[int, int], ...]]:
    """The measured plan for ``inputs`` solved on their op-stream profile ``graph``, and its op ranges."""
    room_bytes = check_budget_gb(budget_gb) - options.reserve_bytes
    expected = graph.metadata.get("op_names")

    def measured(plan: Plan) -> tuple[tuple[tuple[int, int], ...], int]:
        regions = segment_regions(plan)
        probe = BreakCheckpointedModule(model, plan, regions, expected_ops=expected)
        return regions, measure_step_peak_bytes(probe, inputs, step)

    held_bytes = 0
    for attempt in range(MAX_TIGHTENINGS + 1):
        solved_on = with_held_bytes(graph, held_bytes) if held_bytes else graph
        try:
            plan = graph_break_plan(solved_on, budget_gb, options)
        except InfeasibleBudgetError as refusal:
            if held_bytes:  # the budget's own plan measured over: the smallest-peak plan may still fit
                floor = _smallest_peak_plan(graph, options)
                if floor is not None:
                    regions, peak_bytes = measured(floor)
                    log.info("graph-break plan: the smallest-peak plan (predicted %.4f GiB) measured %.4f GiB "
                             "against the %.4f GiB budget", floor.predicted_peak_bytes / GIB, peak_bytes / GIB,
                             budget_gb)
                    if peak_bytes <= room_bytes:
                        return (dataclasses.replace(floor, budget_bytes=check_budget_gb(budget_gb),
                                                    measured_peak_bytes=peak_bytes), regions)
            fitted = _fitting_on_measurement(graph, budget_gb, options, refusal, measured, room_bytes)
            if isinstance(fitted, int):  # the smallest-peak plan measured above the floor the prediction named
                raise InfeasibleBudgetError(refusal.budget_bytes, max(refusal.min_feasible_bytes, fitted),
                                            "the smallest-peak plan measured above its prediction",
                                            refusal.unoptimized_peak_bytes) from None
            if fitted is None:
                raise
            return fitted
        regions, peak_bytes = measured(plan)
        if peak_bytes <= room_bytes:
            log.info("graph-break plan: %d op ranges, measured peak %.4f GiB of %.4f GiB budget (predicted %.4f GiB)",
                     len(regions), peak_bytes / GIB, budget_gb, plan.predicted_peak_bytes / GIB)
            return dataclasses.replace(plan, measured_peak_bytes=peak_bytes), regions
        over = max(peak_bytes - plan.predicted_peak_bytes, peak_bytes - room_bytes, 1)
        log.warning("graph-break plan measured %.4f GiB, above the %.4f GiB budget (predicted %.4f GiB): solving "
                    "again with %.1f MiB more held (%d of %d)", peak_bytes / GIB, budget_gb,
                    plan.predicted_peak_bytes / GIB, over / 2**20, attempt + 1, MAX_TIGHTENINGS)
        held_bytes += over
    raise InfeasibleBudgetError(check_budget_gb(budget_gb), peak_bytes + options.reserve_bytes,
                                "the graph-break path's plans were measured above the budget",
                                graph.measured_peak_bytes)


def _plan_at_floor(graph: CostGraph, floor_bytes: int, options: PlanOptions) -> Plan | None:
    """``graph`` solved at the smallest budget a refusal named, ``floor_bytes`` (None where that
    budget does not plan either): the smallest-peak plan."""
    try:
        return graph_break_plan(graph, floor_bytes / GIB, options)
    except InfeasibleBudgetError:
        return None


def _smallest_peak_plan(graph: CostGraph, options: PlanOptions) -> Plan | None:
    """The plan at the smallest budget the solver names for ``graph`` (None where it names none
    that plans). A plan the budget's solve chose can measure well above its prediction; the
    smallest-peak plan is the last one the budget may still hold."""
    try:
        graph_break_plan(graph, (options.reserve_bytes + 1) / GIB, options)
    except InfeasibleBudgetError as refusal:
        return _plan_at_floor(graph, refusal.min_feasible_bytes, options)
    return None  # a step that fits one byte past the reserve has no smaller peak to find


def _fitting_on_measurement(graph: CostGraph, budget_gb: float, options: PlanOptions, refusal: InfeasibleBudgetError,
                            measured: Any, room_bytes: int) -> tuple[Plan, tuple[tuple[int, int], ...]] | int | None:
    """Where the prediction refuses the budget (it can sit above the allocator's figure), the
    hand-placed plans (cheapest first) and the smallest-peak plan predicted within
    :data:`MEASURED_FIT_TOLERANCE` of it, measured: the first whose step fits. Where none fits
    (or the budget is further below), and the smallest-peak plan measured above the floor the
    refusal names, the budget that plan needs (its measured peak plus ``reserve_gb``): the
    refusal then names a floor that plans. Else None."""
    budget_bytes = check_budget_gb(budget_gb)
    if refusal.min_feasible_bytes > budget_bytes * (1 + MEASURED_FIT_TOLERANCE):
        # far below: nothing to try here, but the floor to name is the smallest-peak plan's
        # measured need where that is above its prediction, so that the budget named plans
        smallest_plan = _plan_at_floor(graph, refusal.min_feasible_bytes, options)
        if smallest_plan is None:
            return None
        needs = measured(smallest_plan)[1] + options.reserve_bytes
        return needs if needs > refusal.min_feasible_bytes else None
    candidates: list[Plan] = []
    for hand in sorted(hand_placed_plans(graph), key=lambda h: sum(s.recompute_flops for s in h.segments)):
        if not any(s.kept_nodes for s in hand.segments) and \
                simulate(graph, hand.segments).peak_bytes <= budget_bytes * (1 + MEASURED_FIT_TOLERANCE):
            candidates.append(Plan(budget_bytes, simulate(graph, hand.segments).peak_bytes,
                                   refusal.unoptimized_peak_bytes or 0, hand.segments, graph.forward_ms,
                                   graph.step_ms, graph.forward_flops, f"hand-placed (measured): {hand.name}", 0.0,
                                   capture="graph-breaks", subgraphs=int(graph.metadata.get("subgraphs", 1)),
                                   measured_unoptimized_peak_bytes=graph.measured_peak_bytes))
    smallest = _plan_at_floor(graph, refusal.min_feasible_bytes, options)
    if smallest is None:
        log.debug("no plan at the solver's own smallest budget")
    else:
        smallest = dataclasses.replace(smallest, budget_bytes=budget_bytes)
        candidates.append(smallest)
    # the smallest-peak plan is measured even when the hand plans fill the candidates
    measuring = candidates[:MAX_MEASURED_CANDIDATES - 1] + candidates[-1:] \
        if len(candidates) > MAX_MEASURED_CANDIDATES else candidates
    smallest_needs: int | None = None
    for plan in measuring:
        regions, peak_bytes = measured(plan)
        if plan is smallest:
            smallest_needs = peak_bytes + options.reserve_bytes
        if peak_bytes <= room_bytes:
            log.info("graph-break plan: %s, predicted %.4f GiB, measured %.4f GiB of %.4f GiB budget", plan.solver,
                     plan.predicted_peak_bytes / GIB, peak_bytes / GIB, budget_gb)
            return dataclasses.replace(plan, measured_peak_bytes=peak_bytes), regions
        log.debug("%s: measured %d bytes, above the room of %d", plan.solver, peak_bytes, room_bytes)
    if smallest_needs is not None and smallest_needs > refusal.min_feasible_bytes:
        return smallest_needs
    return None
