"""Models ``torch.export`` cannot capture: planned over the ATen ops their eager step dispatches
(:mod:`planner.graph_break_plan`), and where that fails too, or across processes, over
submodule calls (:mod:`planner.module_plan`). :func:`planner.pipeline.optimize` hands a failed
capture here; each path taken is logged once with the reason."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from planner.core.errors import InfeasibleBudgetError, ProfileError, TraceError
from planner.capture_options import CaptureOptions
from planner.core.options import PlanOptions
from planner.graph_break_plan import plan_graph_breaks
from planner.module_plan import plan_modules

__all__ = ["plan_without_capture", "graph_breaks_apply"]

log = logging.getLogger("planner.pipeline")  # the warnings read as optimize's own


def graph_breaks_apply(planning: PlanOptions) -> bool:
    """Whether a model that cannot be captured is planned over the ops of its eager step: one
    process (the module path serves sharded and multi-rank runs, with rank 0's plan on every rank).

    Example:
        >>> graph_breaks_apply(PlanOptions(world_size=2))
        False
    """
    return planning.world_size == 1 and not (dist.is_available() and dist.is_initialized())


def plan_without_capture(model: Any, example_inputs: Any, budget_gb: float, planning: PlanOptions,
                         capture: CaptureOptions, error: TraceError) -> Any:
    """The checkpointed module of the graph-break path or, where it fails, of the module path,
    for a model whose capture failed with ``error``. An infeasible budget is raised as it is; a
    model that runs on neither path raises one :class:`TraceError` naming both failures."""
    first_line = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    if graph_breaks_apply(planning):
        log.warning("%s; planning over the ops of its eager step instead (trace_method='graph-breaks' skips "
                    "the capture)", first_line)
        try:
            return plan_graph_breaks(model, example_inputs, budget_gb, planning, timing_repeats=capture.timing_repeats,
                                     step=capture.step, cache_dir=capture.cache_dir)
        except InfeasibleBudgetError:
            raise
        except Exception as break_exc:  # noqa: BLE001 - any failure of that path leaves the module path
            first_line = f"{first_line}; the graph-break path failed ({type(break_exc).__name__})"
    log.warning("%s; planning over submodule calls instead: a coarser plan (whole modules are checkpointed, "
                "trace_method='modules' skips the capture)", first_line)
    try:
        return plan_modules(model, example_inputs, budget_gb, planning, timing_repeats=capture.timing_repeats,
                            step=capture.step)
    except ProfileError as run_exc:  # the model does not run eagerly either: both failures, one line
        raise TraceError(f"{first_line}; and the module path could not run it: {run_exc}") from error
