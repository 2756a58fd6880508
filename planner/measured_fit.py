"""Meet a budget the prediction narrowly refuses, by measuring the plans that would meet it.

The planner keeps ``safety_margin`` of the budget free for what its memory model does not see,
and its prediction can sit a little above the allocator's figure. So a budget equal to a plan's
own measured peak, such as the peak HuggingFace's every-layer checkpointing reaches, would be
refused although that plan fits (docs/tuning.md#measured_fit_tolerance has one). When the
smallest peak the planner predicts is within
:data:`MEASURED_FIT_TOLERANCE` of the budget, :func:`plan_fitting_on_measurement` solves with no
margin, rewrites the graph and measures one training step of each candidate at the allocator
(``torch.profiler`` on CPU, ``max_memory_allocated`` on CUDA); the first whose measured peak is
within the budget is returned, with ``plan.measured_peak_bytes`` set. So a returned plan's
measured peak stays within the budget, and the extra steps are run only for such budgets.

Example:
    >>> import torch
    >>> from planner.core.errors import InfeasibleBudgetError
    >>> from planner.pipeline import plan_for_budget
    >>> from profiling import profile_graph, trace_module
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    ...                               for _ in range(6)]).train()
    >>> x = torch.randn(256, 64)
    >>> gm = trace_module(model, (x,))
    >>> graph = profile_graph(gm, (x,), timing_repeats=1)
    >>> plan_at = lambda budget_gb, options: plan_for_budget(graph, budget_gb, options)
    >>> peak = graph.measured_peak_bytes
    >>> far_below = InfeasibleBudgetError(peak // 4, peak)  # a quarter of the peak: no plan is near it
    >>> plan_fitting_on_measurement(gm, (x,), far_below, PlanOptions(), plan_at) is None
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from planner.core.errors import InfeasibleBudgetError
from planner.core.options import PlanOptions
from planner.core.plan import GIB, Plan
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes
from rewrite.segments import apply_plan, module_copy

__all__ = ["MEASURED_FIT_TOLERANCE", "plan_fitting_on_measurement"]

log = logging.getLogger(__name__)

#: How far above the budget's room the smallest predicted peak may be for plans to be measured
#: rather than refused: the margin plus the prediction error the profiles are held to
#: (docs/tuning.md#measured_fit_tolerance).
MEASURED_FIT_TOLERANCE = 0.03


def plan_fitting_on_measurement(gm: Any, example_inputs: Any, refusal: InfeasibleBudgetError, options: PlanOptions,
                                plan_at: Callable[[float, PlanOptions], Plan], *,
                                grads_held: bool = False, step: Any = None) -> tuple[Any, Plan] | None:
    """A rewritten copy of ``gm`` and its plan whose measured step peak is within
    ``refusal.budget_bytes`` (less ``options.reserve_gb``), or None where no candidate is.

    ``refusal`` is what ``plan_at(budget_gb, options)`` (a solve of a profile of ``gm``, such
    as :func:`planner.pipeline.plan_for_budget`) raised. The candidates, solved with no safety margin:
    the cheapest plan predicted to fit the room, then the plan of the smallest predicted peak.
    None at once where that peak is more than :data:`MEASURED_FIT_TOLERANCE` above the room, for
    a sharded plan (``world_size`` > 1: one process measures no per-rank peak) and for a step
    with gradients already held. ``step`` (a :class:`profiling.measure.TrainingStep`; None: the
    default) is the training step measured.
    """
    if grads_held or options.world_size > 1:
        return None
    reserve_bytes = options.reserve_bytes
    room_bytes = refusal.budget_bytes - reserve_bytes
    # the refusal names the smallest budget with the margin kept; this is the peak it stands for
    lowest_peak_bytes = int((refusal.min_feasible_bytes - reserve_bytes) * (1 - options.safety_margin))
    if room_bytes <= 0 or lowest_peak_bytes > room_bytes * (1 + MEASURED_FIT_TOLERANCE):
        return None
    no_margin = dataclasses.replace(options, safety_margin=0.0)
    inputs = StepInputs.from_example(example_inputs)
    tried: set[tuple[Any, ...]] = set()
    for target_bytes in sorted({room_bytes, lowest_peak_bytes}, reverse=True):
        if target_bytes < lowest_peak_bytes:
            continue
        try:
            plan = plan_at((target_bytes + reserve_bytes) / GIB, no_margin)
        except InfeasibleBudgetError:
            continue
        if plan.segments in tried:
            continue
        tried.add(plan.segments)
        candidate = apply_plan(module_copy(gm), plan)
        measured_bytes = measure_step_peak_bytes(candidate, inputs, step if step is not None else TrainingStep())
        log.info("plan predicted at %.4f GiB measured %.4f GiB against a room of %.4f GiB",
                 plan.predicted_peak_bytes / GIB, measured_bytes / GIB, room_bytes / GIB)
        if measured_bytes <= room_bytes:
            return candidate, dataclasses.replace(plan, budget_bytes=refusal.budget_bytes,
                                                  measured_peak_bytes=measured_bytes)
    return None
