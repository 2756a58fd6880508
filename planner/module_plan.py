"""The module path: plan a model that ``torch.export`` cannot capture over its submodule calls.

:func:`plan_modules` profiles the model at ``nn.Module`` granularity
(:mod:`profiling.module_profile`), solves the module-level :class:`CostGraph` with the same
solvers as the graph path (:func:`planner.pipeline.plan_for_budget`), and applies the plan by
checkpointing the chosen submodule calls (:mod:`rewrite.module_checkpoint`). The module-level
replay cannot see every temporary, so the returned module's step is measured: a plan measured
above the budget is solved again holding the difference all step (a warning says so), and a
budget the module path cannot meet raises :class:`InfeasibleBudgetError` naming the smallest
budget it met. It needs torch; ``planner.pipeline`` imports it.

Example:
    >>> import torch
    >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
    >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
    >>> opt = plan_modules(model, (torch.randn(64, 32),), budget_gb=1.0, timing_repeats=1)
    >>> opt.plan.capture, opt.checkpointed
    ('modules', ())
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from planner.core.costgraph import CostGraph, Storage
from planner.core.errors import InfeasibleBudgetError
from planner.core.options import PlanOptions, check_budget_gb
from planner.core.plan import GIB, Plan
from planner.core.units import MIB
from planner.core.plan import Segment
from planner.core.simulate import simulate
from planner.budget_plan import plan_for_budget
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes
from profiling.module_costgraph import module_cost_graph
from profiling.module_profile import profile_modules
from profiling.module_runs import with_runs
from rewrite.module_checkpoint import ModuleCheckpointedModule
from planner.capture_options import CaptureOptions

__all__ = ["plan_modules", "MAX_TIGHTENINGS"]

log = logging.getLogger(__name__)

#: Times a plan measured above its budget is solved again with the overshoot held all step.
MAX_TIGHTENINGS = 3


def _checkpointed_paths(graph: CostGraph, plan: Plan) -> tuple[str, ...]:
    """Module paths of the planned units; a run's node name (``run:<first>..<last>``) as it is."""
    return tuple(name if name.startswith("run:") else graph.node(name).module
                 for seg in plan.segments for name in seg.node_names)


def _holding(graph: CostGraph, extra_bytes: int) -> CostGraph:
    key = max(s.key for s in graph.storages) + 1
    return dataclasses.replace(graph, storages=(*graph.storages, Storage(key, int(extra_bytes), True)))


def _budget_for(peak_bytes: int, options: PlanOptions) -> int:
    """The smallest budget whose planning room (after reserve and margin) holds ``peak_bytes``."""
    return int(peak_bytes / (1 - options.safety_margin)) + 1 + options.reserve_bytes


def plan_modules(model: Any, example_inputs: Any, budget_gb: float, options: PlanOptions = PlanOptions(), *,
                 timing_repeats: int | None = CaptureOptions.timing_repeats, step: Any = None) -> Any:
    """Plan ``model`` at module granularity for ``budget_gb`` and return the checkpointed module
    (:class:`rewrite.module_checkpoint.ModuleCheckpointedModule`) whose measured step peak is
    within the budget. ``step`` (a :class:`profiling.measure.TrainingStep`; None: the default)
    is the training step profiled and measured.

    Raises:
        InfeasibleBudgetError: no plan over the model's submodule calls fits; the message names
            the smallest budget the module path met.
    """
    step = step if step is not None else TrainingStep()
    budget_bytes = check_budget_gb(budget_gb)
    room_bytes = budget_bytes - options.reserve_bytes
    inputs = StepInputs.from_example(example_inputs)
    graph = with_runs(module_cost_graph(profile_modules(model, inputs, timing_repeats=timing_repeats, step=step)))
    solved_on = graph
    for attempt in range(MAX_TIGHTENINGS + 1):
        try:
            plan = plan_for_budget(solved_on, budget_gb, options)
        except InfeasibleBudgetError as exc:
            return _smallest_fitting(model, inputs, graph, options, exc, budget_bytes, step)
        opt, measured = _applied(model, inputs, graph, plan, step)
        if measured <= room_bytes:
            log.info("module plan: %d of %d units checkpointed, measured peak %.4f GiB of %.4f GiB budget",
                     len(opt.checkpointed), sum(n.recomputable for n in graph.compute_nodes), measured / GIB,
                     budget_bytes / GIB)
            return opt
        over = max(measured - plan.predicted_peak_bytes, measured - room_bytes, 1)
        log.warning("module plan measured %.4f GiB, above the %.4f GiB budget (predicted %.4f GiB): solving "
                    "again with %.1f MiB more held (%d of %d)", measured / GIB, budget_bytes / GIB,
                    plan.predicted_peak_bytes / GIB, over / MIB, attempt + 1, MAX_TIGHTENINGS)
        solved_on = _holding(solved_on, over)
    return _smallest_fitting(model, inputs, graph, options, None, budget_bytes, step)


def _applied(model: Any, inputs: Any, graph: CostGraph, plan: Plan, step: Any) -> tuple[Any, int]:
    """The checkpointed module for ``plan`` and its measured step peak."""
    plan = dataclasses.replace(plan, capture="modules")
    opt = ModuleCheckpointedModule(model, plan, _checkpointed_paths(graph, plan), cost_graph=graph)
    return opt, measure_step_peak_bytes(opt, inputs, step)


def _every_unit_plan(graph: CostGraph, budget_bytes: int) -> Plan:
    """Every checkpointable unit checkpointed, as a plan of ``graph``."""
    units = [n for n in graph.compute_nodes if n.recomputable]
    segments = tuple(Segment((n.name,), n.time_ms, n.flops) for n in units)
    return Plan(budget_bytes=budget_bytes, predicted_peak_bytes=simulate(graph, segments).peak_bytes,
                unoptimized_peak_bytes=simulate(graph).peak_bytes, segments=segments, forward_ms=graph.forward_ms,
                step_ms=graph.step_ms, forward_flops=graph.forward_flops, solver="every unit", solve_s=0.0,
                measured_unoptimized_peak_bytes=graph.measured_peak_bytes, capture="modules")


def _smallest_fitting(model: Any, inputs: Any, graph: CostGraph, options: PlanOptions,
                      exc: InfeasibleBudgetError | None, budget_bytes: int, step: Any) -> Any:
    """Where no solved plan was measured within the budget: the solver's smallest-peak plan
    (the module-level replay holds a unit's saved tensors through its whole backward, so it can
    overestimate; measured, that plan may fit) or every unit checkpointed, whichever is measured
    within the budget first. Otherwise :class:`InfeasibleBudgetError` naming the budget that
    holds the lower of their measured peaks: passed back, one of the two fits it."""
    candidates: list[Plan] = []
    if exc is not None:
        try:
            smallest = plan_for_budget(graph, exc.min_feasible_bytes / GIB, options)
            candidates.append(dataclasses.replace(smallest, budget_bytes=budget_bytes))
        except InfeasibleBudgetError:
            log.debug("the solver found no plan at its own smallest budget on the unheld profile")
    candidates.append(_every_unit_plan(graph, budget_bytes))
    measured_bytes = []
    for plan in candidates:
        opt, measured = _applied(model, inputs, graph, plan, step)
        if measured <= budget_bytes - options.reserve_bytes:
            log.info("module plan: %s, predicted %.4f GiB but measured %.4f GiB of %.4f GiB budget",
                     "the smallest-peak plan" if plan.solver != "every unit" else "every unit checkpointed",
                     plan.predicted_peak_bytes / GIB, measured / GIB, budget_bytes / GIB)
            return opt
        measured_bytes.append(measured)
    raise InfeasibleBudgetError(budget_bytes, _budget_for(min(measured_bytes), options),
                                unoptimized_peak_bytes=graph.measured_peak_bytes)
