"""Plans held to measured steps: a budget the prediction narrowly refuses met by measuring the
plans that would meet it (:func:`fit_on_measurement`), and a chosen plan checked on the device
before it is returned (:func:`check_on_device`, the loop of :mod:`planner.closed_loop`).

The planner keeps ``safety_margin`` of the budget free for what its memory model does not see,
and its prediction can sit a little above the allocator's figure. So a budget equal to a plan's
own measured peak, such as the peak HuggingFace's every-layer checkpointing reaches, would be
refused although that plan fits (docs/tuning.md#measured_fit_tolerance has one). When the
smallest peak the planner predicts is within
:data:`MEASURED_FIT_TOLERANCE` of the budget, :func:`fit_on_measurement` solves with no
margin, rewrites the graph and measures one training step of each candidate at the allocator
(``torch.profiler`` on CPU, ``max_memory_allocated`` on CUDA); the first whose measured peak is
within the budget is returned, with ``plan.measured_peak_bytes`` set. So a returned plan's
measured peak stays within the budget, and the extra steps are run only for such budgets.

Both take the :class:`planner.planning_steps.PlanningSteps` of the plan: its ``plan`` solves,
its ``measure`` rewrites a copy of the graph and measures its step.

Example:
    >>> import torch
    >>> from planner.capture_options import CaptureOptions
    >>> from planner.planning_steps import PlanningSteps
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    ...                               for _ in range(6)]).train()
    >>> steps = PlanningSteps(model, (torch.randn(256, 64),), budget_gb=1.0,
    ...                       capture_options=CaptureOptions(timing_repeats=1))
    >>> gm = steps.capture()
    >>> graph = steps.profile(gm)
    >>> peak = graph.measured_peak_bytes
    >>> far_below = InfeasibleBudgetError(peak // 4, peak)  # a quarter of the peak: no plan is near it
    >>> fit_on_measurement(steps, gm, graph, far_below) is None
    True
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from planner.budget_plan import hand_plans_to_measure
from planner.closed_loop import measured_plan
from planner.core.costgraph import CostGraph, with_held_bytes
from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import GIB, Plan
from planner.planning_steps import PlanningSteps
from rewrite.segments import apply_plan

__all__ = ["MEASURED_FIT_TOLERANCE", "fit_on_measurement", "measured_floor", "check_on_device"]

log = logging.getLogger(__name__)

#: How far above the budget's room the smallest predicted peak may be for plans to be measured
#: rather than refused: the margin plus the prediction error the profiles are held to
#: (docs/tuning.md#measured_fit_tolerance).
MEASURED_FIT_TOLERANCE = 0.03


def fit_on_measurement(steps: PlanningSteps, gm: Any, graph: CostGraph,
                       refusal: InfeasibleBudgetError) -> tuple[Any, Plan] | None:
    """A rewritten copy of ``gm`` and its plan whose measured step peak is within
    ``refusal.budget_bytes`` (less ``reserve_gb``), or None where no candidate is.

    ``refusal`` is what ``steps.plan(graph)`` raised (``graph``: the profile of ``gm``). The
    candidates, solved with no safety margin: the cheapest plan predicted to fit the room, then
    the plan of the smallest predicted peak. None at once where that peak is more than
    :data:`MEASURED_FIT_TOLERANCE` above the room, for a sharded plan (``world_size`` > 1: one
    process measures no per-rank peak) and for a step with gradients already held. The
    module's example runs it.
    """
    options = steps.plan_options
    if steps.grads_held or options.world_size > 1:
        return None
    reserve_bytes = options.reserve_bytes
    room_bytes = refusal.budget_bytes - reserve_bytes
    # the refusal names the smallest budget with the margin kept; this is the peak it stands for
    lowest_peak_bytes = int((refusal.min_feasible_bytes - reserve_bytes) * (1 - options.safety_margin))
    if room_bytes <= 0 or lowest_peak_bytes > room_bytes * (1 + MEASURED_FIT_TOLERANCE):
        return None
    no_margin = dataclasses.replace(options, safety_margin=0.0)
    tried: set[tuple[Any, ...]] = set()
    for target_bytes in sorted({room_bytes, lowest_peak_bytes}, reverse=True):
        if target_bytes < lowest_peak_bytes:
            continue
        try:
            plan = steps.plan(graph, (target_bytes + reserve_bytes) / GIB, no_margin)
        except InfeasibleBudgetError:
            continue
        if plan.segments in tried:
            continue
        tried.add(plan.segments)
        candidate, measured_bytes = steps.measure(gm, plan)
        log.info("plan predicted at %.4f GiB measured %.4f GiB against a room of %.4f GiB",
                 plan.predicted_peak_bytes / GIB, measured_bytes / GIB, room_bytes / GIB)
        if measured_bytes <= room_bytes:
            return candidate, dataclasses.replace(plan, budget_bytes=refusal.budget_bytes,
                                                  measured_peak_bytes=measured_bytes)
    return None


def measured_floor(steps: PlanningSteps, gm: Any, graph: CostGraph,
                   refusal: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``refusal`` with a floor that plans: the plan solved at the smallest budget ``refusal``
    names is measured (one training step), and where its step peaks above the room that budget
    leaves (the prediction ran low), the budget its measured peak needs is named instead. Itself
    where that plan fits, for a sharded plan or a step with gradients already held (nothing is
    measured there).

    Example:
        >>> import torch
        >>> from planner.capture_options import CaptureOptions
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        ...                               for _ in range(6)]).train()
        >>> steps = PlanningSteps(model, (torch.randn(256, 64),), budget_gb=1e-6,
        ...                       capture_options=CaptureOptions(timing_repeats=1))
        >>> gm = steps.capture()
        >>> graph = steps.profile(gm)
        >>> try:
        ...     steps.plan(graph)
        ... except InfeasibleBudgetError as exc:
        ...     refusal, named = exc, measured_floor(steps, gm, graph, exc)
        >>> named.min_feasible_bytes >= refusal.min_feasible_bytes
        True
    """
    options = steps.plan_options
    if steps.grads_held or options.world_size > 1 or refusal.min_feasible_bytes <= refusal.budget_bytes:
        return refusal
    try:
        plan = steps.plan(graph, refusal.min_feasible_bytes / GIB)
    except InfeasibleBudgetError:
        return refusal
    _, measured_bytes = steps.measure(gm, plan)
    room_bytes = refusal.min_feasible_bytes - options.reserve_bytes
    if measured_bytes <= room_bytes:
        return refusal
    log.info("the plan at the smallest feasible budget predicted %.4f GiB measured %.4f GiB, above its room of "
             "%.4f GiB: naming the budget it needs", plan.predicted_peak_bytes / GIB, measured_bytes / GIB,
             room_bytes / GIB)
    note = (f"the plan at the predicted floor measured {measured_bytes / GIB:.4f} GiB"
            + (f"; {refusal.note}" if refusal.note else ""))
    return InfeasibleBudgetError(refusal.budget_bytes, measured_bytes + options.reserve_bytes, note,
                                 refusal.unoptimized_peak_bytes)


@dataclasses.dataclass(frozen=True)
class _Device:
    """The closed loop's device (:class:`planner.closed_loop.DeviceStep`): ``gm`` rewritten and
    measured, ``graph`` solved again for the budget of ``budget_bytes``."""

    steps: PlanningSteps
    gm: Any
    graph: CostGraph
    budget_bytes: int

    def measure(self, plan: Plan) -> tuple[Any, int]:
        return self.steps.measure(self.gm, plan)

    def resolve(self, held_bytes: int, extra_room_bytes: int) -> Plan:
        margin = self.steps.plan_options.safety_margin
        budget_gb = self.steps.budget_gb + extra_room_bytes / (1 - margin) / GIB
        solved = self.steps.plan(with_held_bytes(self.graph, held_bytes), budget_gb)
        return dataclasses.replace(solved, budget_bytes=self.budget_bytes)

    def smallest(self) -> Plan:
        try:
            solved = self.steps.plan(self.graph, 1 / GIB)  # below any plan: the refusal names the floor
        except InfeasibleBudgetError as refusal:
            solved = self.steps.plan(self.graph, refusal.min_feasible_bytes / GIB)
        return dataclasses.replace(solved, budget_bytes=self.budget_bytes)


def check_on_device(steps: PlanningSteps, gm: Any, plan: Plan, graph: CostGraph) -> tuple[Any, Plan]:
    """``gm`` rewritten for the plan to return and that plan, with ``measured_peak_bytes`` set:
    ``plan`` (solved on ``graph``, the profile of ``gm``) checked by measuring its step, and
    corrected where the measurement says so (:func:`planner.closed_loop.measured_plan`; the
    hand-placed plans the margin refused, within :data:`MEASURED_FIT_TOLERANCE`, are measured
    too).

    Example:
        >>> import torch
        >>> from planner.planning_steps import PlanningSteps
        >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0)
        >>> gm = steps.capture()
        >>> graph = steps.profile(gm)
        >>> module, plan = check_on_device(steps, gm, steps.plan(graph), graph)
        >>> plan.measured_peak_bytes == graph.measured_peak_bytes   # nothing recomputed: the profiled step
        True

    Raises:
        InfeasibleBudgetError: every plan tried measured above the budget's room.
    """
    options = steps.plan_options
    room_bytes = plan.budget_bytes - options.reserve_bytes
    margin_bytes = int(room_bytes * options.safety_margin)
    device = _Device(steps, gm, graph, plan.budget_bytes)
    try:
        module, checked = measured_plan(plan, room_bytes, margin_bytes, device, graph.measured_peak_bytes,
                                        hand_plans_to_measure(graph, plan, options, MEASURED_FIT_TOLERANCE))
    except InfeasibleBudgetError as exc:
        raise exc.with_unoptimized_peak(graph.measured_peak_bytes) from None
    return (module if module is not None else apply_plan(gm, checked)), checked
