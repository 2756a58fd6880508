"""What each step of ``optimize`` needs, in one object: :class:`PlanningSteps` holds the model,
its example inputs, the budget and the options of one plan, and its methods are the stages of
the pipeline on them: ``capture()``, ``profile(gm)``, ``plan(graph)`` and ``measure(gm, plan)``.
The steps that follow a solve (the loss-chunk choice, the fit on measurement, the check on the
device, the compiled plan) take a ``PlanningSteps`` and call these methods, so each names what
it does with the model rather than receiving it as a callback.

:func:`plan_if_the_step_fits` is the first step of a plan: the unoptimized step is measured;
where it fits the plan is empty and nothing is profiled, and where it does not, the same
measurement is the profile's memory pass. Its log lines, and
:func:`log_plan`'s, go to ``planner.pipeline``: they read as ``optimize``'s own.

Example:
    >>> import torch
    >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0)
    >>> gm = steps.capture()
    >>> steps.plan(steps.profile(gm)).recomputed_nodes
    ()
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, NamedTuple

from planner.budget_plan import plan_for_budget
from planner.capture_options import CaptureOptions
from planner.core.costgraph import CostGraph
from planner.core.options import PlanOptions, check_budget_gb
from planner.core.plan import GIB, Plan
from profiling.cache import cached_profile_graph
from profiling.measure import StepInputs, measure_step_peak_bytes
from profiling.profile import measure_unoptimized_step
from profiling.temporaries import NodePeaks
from profiling.trace import trace_module
from rewrite.segments import apply_plan, module_copy

__all__ = ["PlanningSteps", "StepFit", "planning_room_bytes", "plan_if_the_step_fits", "log_plan"]

log = logging.getLogger("planner.pipeline")  # the plan's lines read as optimize's own


def planning_room_bytes(budget_bytes: int, options: PlanOptions) -> int:
    """The bytes a plan for ``budget_bytes`` may peak at: the budget less ``options.reserve_gb``,
    less ``options.safety_margin`` of what is left.

    Example:
        >>> planning_room_bytes(2000, PlanOptions(reserve_gb=0.0, safety_margin=0.25))
        1500
    """
    return int((budget_bytes - options.reserve_bytes) * (1 - options.safety_margin))


@dataclasses.dataclass(frozen=True)
class PlanningSteps:
    """The model, example inputs, budget and options of one plan, with the stages of the
    pipeline as methods: what every step of ``optimize`` needs.

    Example:
        >>> import torch
        >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0)
        >>> gm = steps.capture()
        >>> graph = steps.profile(gm)
        >>> module, peak_bytes = steps.measure(gm, steps.plan(graph))
        >>> abs(peak_bytes - graph.measured_peak_bytes) <= graph.measured_peak_bytes // 100   # the profiled step
        True
    """

    model: Any
    example_inputs: Any
    #: the user's budget in GiB, ``reserve_gb`` included
    budget_gb: float
    plan_options: PlanOptions = PlanOptions()
    capture_options: CaptureOptions = CaptureOptions()
    #: plan a step that starts with every parameter's ``.grad`` allocated (gradient accumulation)
    grads_held: bool = False

    @property
    def step_inputs(self) -> StepInputs:
        """The example inputs as the measured training step takes them."""
        return StepInputs.from_example(self.example_inputs)

    def capture(self) -> Any:
        """The model captured as a GraphModule (:func:`profiling.trace.trace_module`); each call
        is a new capture."""
        return trace_module(self.model, self.example_inputs, method=self.capture_options.trace_method,
                            simplify_attention_masks=self.capture_options.simplify_attention_masks)

    def profile(self, gm: Any, node_peaks: NodePeaks | None = None) -> CostGraph:
        """The profile of ``gm``'s training step, through the profile cache where one is set;
        ``node_peaks``: its memory pass, measured already (:func:`plan_if_the_step_fits`)."""
        options = self.capture_options
        return cached_profile_graph(gm, self.example_inputs, options.cache_dir, timing_repeats=options.timing_repeats,
                                    progress=options.progress, step=options.step, node_peaks=node_peaks)

    def plan(self, graph: CostGraph, budget_gb: float | None = None, options: PlanOptions | None = None) -> Plan:
        """``graph`` solved for ``budget_gb`` (None: the step's budget) with ``options`` (None: the
        step's), for a step with gradients held where ``grads_held``
        (:func:`planner.budget_plan.plan_for_budget`)."""
        return plan_for_budget(graph, self.budget_gb if budget_gb is None else budget_gb,
                               self.plan_options if options is None else options, grads_held=self.grads_held)

    def measure(self, gm: Any, plan: Plan) -> tuple[Any, int]:
        """A copy of ``gm`` rewritten for ``plan``, and the peak bytes of its training step
        measured at the allocator."""
        module = apply_plan(module_copy(gm), plan)
        return module, measure_step_peak_bytes(module, self.step_inputs, self.capture_options.step)


class StepFit(NamedTuple):
    """What measuring the unoptimized step said: the empty plan where it fits the budget (else
    None), and the per-node peaks the measurement gave, for the profile (None on CUDA)."""

    plan: Plan | None
    node_peaks: NodePeaks | None


def plan_if_the_step_fits(steps: PlanningSteps, gm: Any) -> StepFit:
    """Measure one step of ``gm`` (nothing recomputed): the empty plan where it fits the planning
    room (:func:`planning_room_bytes`), so a roomy budget needs no profile and no solve; else no
    plan, and on CPU the step's per-node peaks, which the profile then takes as its memory pass
    (:func:`profiling.profile.measure_unoptimized_step`).

    Example:
        >>> import torch
        >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0)
        >>> fit = plan_if_the_step_fits(steps, steps.capture())
        >>> fit.plan.segments, fit.plan.measured_peak_bytes == fit.plan.unoptimized_peak_bytes
        ((), True)
    """
    started = time.perf_counter()
    budget_bytes = check_budget_gb(steps.budget_gb)
    room_bytes = planning_room_bytes(budget_bytes, steps.plan_options)
    peak_bytes, node_peaks = measure_unoptimized_step(gm, steps.step_inputs, steps.capture_options.step)
    if peak_bytes > room_bytes:
        log.debug("the unoptimized step peaks at %.4f GiB, above the room of %.4f GiB: planning", peak_bytes / GIB,
                  room_bytes / GIB)
        return StepFit(None, node_peaks)
    log.info("plan: the unoptimized step's measured peak %.4f GiB fits the %.4f GiB budget: nothing to recompute, "
             "nothing profiled", peak_bytes / GIB, budget_bytes / GIB)
    return StepFit(Plan(budget_bytes=budget_bytes, predicted_peak_bytes=peak_bytes, unoptimized_peak_bytes=peak_bytes,
                        segments=(), forward_ms=0.0, step_ms=0.0, forward_flops=0,
                        solver="none (the measured unoptimized step fits)", solve_s=time.perf_counter() - started,
                        measured_unoptimized_peak_bytes=peak_bytes, measured_peak_bytes=peak_bytes,
                        computation_changes=tuple(gm.meta.get("computation_changes", ()))), None)


def log_plan(plan: Plan, *, measured: bool) -> None:
    """The plan's one INFO line: its measured peak where ``measured`` (the step was measured
    on the device), else its predicted peak.

    Example:
        >>> log_plan(Plan(budget_bytes=2**30, predicted_peak_bytes=2**29, unoptimized_peak_bytes=2**30,
        ...               segments=(), forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="-", solve_s=0.0),
        ...          measured=False)
    """
    if measured:
        assert plan.measured_peak_bytes is not None
        log.info("plan: measured peak %.3f GiB of %.3f GiB budget (predicted %.3f GiB), %d segments",
                 plan.measured_peak_bytes / GIB, plan.budget_bytes / GIB, plan.predicted_peak_bytes / GIB,
                 len(plan.segments))
    else:
        log.info("plan: predicted peak %.3f GiB of %.3f GiB budget, %d segments",
                 plan.predicted_peak_bytes / GIB, plan.budget_bytes / GIB, len(plan.segments))
