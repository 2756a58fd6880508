"""The capture path of ``ckpt-planner report`` and ``check``: one profile of the model, from
the captured graph where ``torch.export`` captures it, else (as ``optimize`` does) over the
ATen ops of its eager step (the graph-break path, :mod:`planner.graph_break_plan`), else over
its submodule calls (the module path, :mod:`planner.module_plan`); and the plan of a budget on
that profile. ``--trace-method`` picks a path directly. Which path made the figures is
:attr:`Profiled.capture`, and a fallback logs one warning naming the capture failure.

The commands solve on the one profile at every budget (predictions, as on the captured graph);
``ckpt-planner plan`` and ``optimize`` also measure the planned step on the fallback paths.
It needs torch; :mod:`planner.cli` imports it inside the commands that run a model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.fx

from planner.budget_plan import plan_for_budget
from planner.core.costgraph import CostGraph
from planner.core.errors import InputError, ProfileError, TraceError
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.graph_break_plan import graph_break_plan
from profiling.graph_breaks import profile_op_stream
from profiling.measure import StepInputs, TrainingStep
from profiling.module_costgraph import module_cost_graph
from profiling.module_profile import profile_modules
from profiling.module_runs import with_runs

__all__ = ["Profiled", "UNCAPTURED_PATHS", "profile_on_a_path", "plan_on", "labelled", "check_method_applies"]

log = logging.getLogger(__name__)

#: the paths that need no captured graph, in the order a failed capture tries them
UNCAPTURED_PATHS = ("graph-breaks", "modules")


@dataclasses.dataclass(frozen=True)
class Profiled:
    """One profile of the model and the path that made it."""

    graph: CostGraph
    #: ``"graph"`` (the captured graph), ``"graph-breaks"`` or ``"modules"``
    capture: str
    #: the captured ``GraphModule`` (``capture == "graph"``), else None
    captured: Any = None
    #: the first line of the capture failure that sent the model down this path; "" where none did
    capture_failure: str = ""


def check_method_applies(trace_method: str, module: Any) -> None:
    """Refuse, in one line, a ``--trace-method`` other than ``export`` for a saved ``.pt2``
    (``module`` a ``GraphModule``): it is a captured graph already, planned as exported."""
    if trace_method != "export" and isinstance(module, torch.fx.GraphModule):
        raise InputError(f"--trace-method {trace_method}: a .pt2 is a captured graph and is planned as exported; "
                         f"--trace-method applies to a save_pretrained directory, a pickled module or an entry point")


def profile_on_a_path(module: Any, inputs: StepInputs, trace_method: str, *, capture: Callable[[], Any],
                      profile: Callable[[Any], CostGraph], step: TrainingStep, timing_repeats: int | None = None,
                      fake_only: str | None = None) -> Profiled:
    """Profile ``module`` on the path ``trace_method`` names: a capture method (``export``,
    ``symbolic_trace``) runs ``capture()`` and ``profile(captured)``, and where the capture
    fails, the graph-break path, then the module path (one warning each); ``graph-breaks`` or
    ``modules`` take that path directly.

    Raises:
        InputError: the capture failed and ``fake_only`` names the option that needs a captured
            graph (the fallback paths run real steps).
        TraceError: the capture failed and neither fallback path could run the model (both
            failures named).
    """
    if trace_method in UNCAPTURED_PATHS:
        return Profiled(_uncaptured_profile(module, inputs, trace_method, step, timing_repeats), trace_method)
    try:
        captured = capture()
    except TraceError as exc:
        failure = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if fake_only:
            raise InputError(f"{failure}; {fake_only} plans on fake tensors, which needs a captured graph: drop "
                             f"{fake_only} to plan over the model's eager step instead") from exc
        return _fallback(module, inputs, step, timing_repeats, failure, exc)
    return Profiled(profile(captured), "graph", captured=captured)


def _fallback(module: Any, inputs: StepInputs, step: TrainingStep, timing_repeats: int | None, failure: str,
              error: TraceError) -> Profiled:
    """The graph-break path's profile or, where it fails, the module path's."""
    log.warning("%s; planning over the ops of its eager step instead (--trace-method graph-breaks skips the "
                "capture)", failure)
    try:
        return Profiled(_uncaptured_profile(module, inputs, "graph-breaks", step, timing_repeats), "graph-breaks",
                        capture_failure=failure)
    except Exception as break_exc:  # noqa: BLE001 - any failure of that path leaves the module path
        reason = f"{failure}; the graph-break path failed ({type(break_exc).__name__})"
    log.warning("%s; planning over submodule calls instead: a coarser plan (whole modules are checkpointed, "
                "--trace-method modules skips the capture)", reason)
    try:
        return Profiled(_uncaptured_profile(module, inputs, "modules", step, timing_repeats), "modules",
                        capture_failure=failure)
    except ProfileError as run_exc:  # the model does not run eagerly either: both failures, one line
        raise TraceError(f"{reason}; and the module path could not run it: {run_exc}") from error


def _uncaptured_profile(module: Any, inputs: StepInputs, path: str, step: TrainingStep,
                        timing_repeats: int | None) -> CostGraph:
    """The graph-break or module path's profile, its metadata saying what it ran on."""
    if path == "graph-breaks":
        graph = profile_op_stream(module, inputs, timing_repeats=timing_repeats, step=step)
    else:
        graph = with_runs(module_cost_graph(profile_modules(module, inputs, timing_repeats=timing_repeats,
                                                            step=step)))
    device = next((str(t.device) for t in (*module.parameters(), *inputs.tensors())), "cpu")
    return dataclasses.replace(graph, metadata={"device": device, "mode": "measured", "step": step.describe(),
                                                **graph.metadata, "capture": path})


def plan_on(graph: CostGraph, budget_gb: float, options: PlanOptions) -> Plan:
    """The plan of ``budget_gb`` on a profile, labelled with the path that made the profile
    (``graph.metadata["capture"]``; the graph-break path's plans are segments only, as
    :func:`planner.graph_break_plan.graph_break_plan` makes them)."""
    if graph.metadata.get("capture") == "graph-breaks":
        return graph_break_plan(graph, budget_gb, options)
    return labelled(plan_for_budget(graph, budget_gb, options), graph)


def labelled(plan: Plan, graph: CostGraph) -> Plan:
    """``plan`` (made on ``graph`` by any solve, a sweep's too) labelled with the path that made
    ``graph``: ``plan.capture``, the graph-break path's subgraphs, the measured unoptimized peak."""
    capture = str(graph.metadata.get("capture") or "graph")
    if capture == "graph":
        return plan
    return dataclasses.replace(plan, capture=capture, subgraphs=int(graph.metadata.get("subgraphs", 1)),
                               measured_unoptimized_peak_bytes=graph.measured_peak_bytes)
