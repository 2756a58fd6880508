"""Capture a module as an FX graph and measure what each node costs.

``trace_module`` captures, ``profile_graph`` turns the captured graph into a
:class:`planner.CostGraph`, and ``measure`` holds the allocator-level measurements used to
validate predictions.
"""

from profiling.measure import StepInputs, TrainingStep, measure_step_flops, measure_step_peak_bytes, run_step
from profiling.profile import profile_graph
from profiling.trace import trace_module

__all__ = [
    "StepInputs",
    "TrainingStep",
    "trace_module",
    "profile_graph",
    "run_step",
    "measure_step_peak_bytes",
    "measure_step_flops",
]
