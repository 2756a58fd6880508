"""A pytest helper for teams that prefer a test to a CLI check.

    from planner.testing import assert_peak_memory

    def test_training_step_fits():
        model, batch = build_model(), make_batch()
        assert_peak_memory(model, batch, max_gb=6)

The peak is predicted from tensor sizes on fake tensors (the same bytes on every machine,
op-internal temporaries left out), so the test is deterministic and allocates nothing big.
"""

from __future__ import annotations

from typing import Any

from planner.core.errors import InputError
from planner.core.options import check_budget_gb
from planner.core.plan import GIB
from planner.core.costgraph import CostGraph
from planner.core.simulate import peak_by_kind, simulate
from profiling.profile import profile_graph
from profiling.trace import trace_module
from profiling.validate import check_model_and_inputs
from planner.core.units import MIB

__all__ = ["predicted_peak_bytes", "assert_peak_memory"]


def _fake_profile(model: Any, example_inputs: Any) -> CostGraph:
    return profile_graph(trace_module(model, example_inputs), example_inputs, fake=True)


def predicted_peak_bytes(model: Any, example_inputs: Any) -> tuple[int, dict[str, int]]:
    """Predicted unoptimized training-step peak and the saved activation bytes per node."""
    graph = _fake_profile(model, example_inputs)
    return simulate(graph).peak_bytes, graph.saved_bytes_by_node()


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / MIB:.1f} MiB"


def assert_peak_memory(model: Any, example_inputs: Any, max_gb: float, *, top: int = 5) -> int:
    """Fail with ``AssertionError`` when one training step of ``model`` would peak above ``max_gb`` GiB.

    Returns the predicted peak in bytes. The failure message says where the step peaks, splits
    the peak by kind (parameters and buffers, inputs, parameter gradients, activations,
    activation gradients, temporaries: :func:`planner.core.simulate.peak_by_kind`), largest
    first, and names the nodes saving the most.

    Arguments are checked first, as :func:`planner.optimize` checks its own: a ``max_gb`` that is
    not a positive finite number of GiB, or a model in eval mode, raises
    :class:`planner.core.errors.InputError` (a ``ValueError``) instead of a test that passes or fails
    for the wrong reason.

    Example:
        >>> import torch
        >>> assert_peak_memory(torch.nn.Linear(8, 8), (torch.randn(4, 8),), max_gb=0.001)
        836
        >>> assert_peak_memory(torch.nn.Linear(8, 8), (torch.randn(4, 8),), max_gb="1")
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: max_gb must be a number of GiB, got the string '1': pass max_gb=1 (a float, not a str)
    """
    limit = check_budget_gb(max_gb, "max_gb")
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise InputError(f"top must be a non-negative integer, got {top!r}")
    check_model_and_inputs(model, example_inputs)
    graph = _fake_profile(model, example_inputs)
    result = simulate(graph)
    peak = result.peak_bytes
    if peak > limit:
        kinds = sorted(((size, kind) for kind, size in peak_by_kind(graph).items() if size), reverse=True)
        split = ", ".join(f"{kind} {_mib(size)} ({size / max(peak, 1):.0%})" for size, kind in kinds)
        largest = sorted(graph.saved_bytes_by_node().items(), key=lambda kv: -kv[1])[:top]
        names = ", ".join(f"{name} {_mib(size)}" for name, size in largest)
        raise AssertionError(
            f"predicted training-step peak {peak / GIB:.4f} GiB exceeds max_gb={max_gb} "
            f"({peak} > {limit} bytes), at the {result.peak_phase} of {result.peak_node or 'the step'}: {split}; "
            f"largest saved activations: {names or 'none'}"
        )
    return peak
