"""Measure each dispatched op's forward and backward peak allocation in one eager training step.

The graph-break profile (:mod:`profiling.graph_breaks`) names the k-th op the model dispatches
``op<k>_<name>``. One step runs under ``torch.profiler`` with ``profile_memory=True`` and each
op wrapped in a ``record_function`` range, so its forward window is that range; the autograd
sequence numbers created between the end of the previous op and the end of this one are its
autograd nodes, whose ``evaluate_function`` events in the backward are its backward window. A
window's peak is the highest running allocation total inside it minus the total at its start,
as :mod:`profiling.temporaries` measures the nodes of a captured graph. On CPU the same
step's highest running total is the step's peak, as :func:`profiling.measure.measure_step_peak_bytes`
measures it, so the profile runs no step of its own for it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> from profiling.measure import StepInputs, measure_step_peak_bytes
    >>> inputs = StepInputs.from_example((torch.randn(4, 8),))
    >>> peaks = measure_op_peaks(model, inputs)
    >>> peaks.forward[2] >= 4 * 8 * 4, 1 in peaks.backward
    (True, True)
    >>> peaks.step_peak_bytes == measure_step_peak_bytes(model, inputs)
    True
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from profiling.measure import (StepInputs, TrainingStep, allocation_events, device_of, memory_profile,
                               preserved_state, profiled_step_peak_bytes)
from profiling.op_counting import UNCOUNTED_OPS
from profiling.temporaries import walk_events, window_peaks

__all__ = ["OpPeaks", "measure_op_peaks"]

_PREFIX = "opnode::"
_BACKWARD = "autograd::engine::evaluate_function:"


class _Labelled(TorchDispatchMode):
    """Wraps each counted op of the forward in a profiler range and notes its sequence numbers.

    A custom ``autograd.Function`` makes its autograd node before its forward runs, and its
    forward's ops run with grad disabled (they make no node of their own): the node that
    appears in the window of such an op belongs to the Function, whose backward runs when the
    gradient reaches the Function's output, the output of its last op. Its window is given to
    that op (the last of the grad-disabled run)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.sequences: list[tuple[int, int, int]] = []
        self._since = int(torch._C._autograd._get_sequence_nr())
        self._function: tuple[int, int] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func) in UNCOUNTED_OPS:
            return func(*args, **kwargs)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self.close_function()
        index = self.count
        self.count += 1
        with torch.profiler.record_function(f"{_PREFIX}{index}"):
            out = func(*args, **kwargs)
        now = int(torch._C._autograd._get_sequence_nr())
        if not grad_enabled and now > self._since and self._function is None:
            self._function = (self._since, now)
        else:
            self.sequences.append((self._since, now, index))
        self._since = now
        return out

    def close_function(self) -> None:
        """Give a custom Function's node to the last op its forward ran."""
        if self._function is not None:
            self.sequences.append((*self._function, max(self.count - 1, 0)))
            self._function = None


class OpPeaks(NamedTuple):
    """What one measured step gives the op-stream profile."""

    #: per model op index, the bytes allocated at its forward's high point
    forward: dict[int, int]
    #: per model op index, the bytes allocated at its backward's high point
    backward: dict[int, int]
    #: the step's peak at the allocator on CPU (None on CUDA, where the profiler's running total
    #: is not what ``max_memory_allocated`` reports)
    step_peak_bytes: int | None


def measure_op_peaks(model: torch.nn.Module, inputs: StepInputs, step: TrainingStep = TrainingStep()) -> OpPeaks:
    """Each model op's forward and backward peaks in one training step, and on CPU the step's peak."""
    labels = _Labelled()
    on_cpu = device_of(model, inputs).type == "cpu"
    with preserved_state(model):
        with memory_profile() as prof:
            with labels:
                output = model(*inputs.args, **inputs.kwargs)
            labels.close_function()
            loss = step.loss(output)
            if not step.output_held:
                output = None
            loss.backward()
            del output, loss
        step_peak_bytes = profiled_step_peak_bytes(model, inputs, prof) if on_cpu else None
    events = walk_events(list(prof.profiler.kineto_results.experimental_event_tree()))
    peak_in = window_peaks(allocation_events(prof, "cpu" if not torch.cuda.is_available() else "cuda"))

    forward: dict[int, int] = {}
    for event in events:
        if event.name.startswith(_PREFIX):
            forward[int(event.name[len(_PREFIX):])] = peak_in(event.start_time_ns, event.end_time_ns)
    labels.sequences.sort()
    starts = [lo for lo, _, _ in labels.sequences]
    windows: dict[int, tuple[int, int]] = {}
    for event in events:
        if not event.name.startswith(_BACKWARD):
            continue
        seq = getattr(event.extra_fields, "sequence_number", -1)
        at = bisect.bisect_right(starts, seq) - 1 if seq is not None and seq >= 0 else -1
        if at < 0 or not labels.sequences[at][0] <= seq < labels.sequences[at][1]:
            continue
        index = labels.sequences[at][2]
        lo, hi = windows.get(index, (event.start_time_ns, event.end_time_ns))
        windows[index] = (min(lo, event.start_time_ns), max(hi, event.end_time_ns))
    return OpPeaks(forward, {index: peak_in(lo, hi) for index, (lo, hi) in windows.items()}, step_peak_bytes)
