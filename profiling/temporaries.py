"""Measure the memory each node needs while it runs, beyond what it keeps.

An op can allocate more than its outputs: ``cross_entropy_loss`` runs ``log_softmax`` and
``nll_loss`` inside one FX node, and its backward holds two gradients of the logits' size at
once. The simulator cannot see those from tensor sizes alone, so they are measured: the graph
runs one forward plus backward under ``torch.profiler`` with ``profile_memory=True``, each FX
node wrapped in a ``record_function`` range. A node's forward window is its range; its
backward window spans the autograd functions whose sequence numbers its forward ops created.
For each window the result is the highest running allocation total reached inside it, minus
the total at its start.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> from profiling.measure import StepInputs
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> fwd, bwd = measure_node_peaks(trace_module(model, (x,)), StepInputs.from_example((x,)))
    >>> fwd["relu"] >= 4 * 8 * 4
    True
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
import torch.fx

from profiling.measure import StepInputs, loss_of, preserved_state, unflatten_output

__all__ = ["measure_node_peaks"]

_PREFIX = "fxnode::"
_BACKWARD = "autograd::engine::evaluate_function:"


class _LabelledInterpreter(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        with torch.profiler.record_function(_PREFIX + n.name):
            return super().run_node(n)


def _walk(roots: list[Any]) -> list[Any]:
    out, stack = [], list(roots)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


def measure_node_peaks(gm: torch.fx.GraphModule, inputs: StepInputs) -> tuple[dict[str, int], dict[str, int]]:
    """Per node name: peak bytes allocated during its forward, and during its backward."""
    from profiling.profile import flat_graph_inputs

    flat = flat_graph_inputs(gm, inputs)
    with preserved_state(gm), torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        flat_out = _LabelledInterpreter(gm).run(*flat, enable_io_processing=False)
        output = unflatten_output(gm, flat_out)
        loss_of(output).backward()
        del output, flat_out

    events = _walk(list(prof.profiler.kineto_results.experimental_event_tree()))
    allocations = sorted(
        (e.start_time_ns, int(e.extra_fields.alloc_size)) for e in events if str(e.tag).endswith("Allocation")
    )
    times = [t for t, _ in allocations]
    running: list[int] = []
    total = 0
    for _, delta in allocations:
        total += delta
        running.append(total)

    def peak_in(start_ns: int, end_ns: int) -> int:
        lo = bisect.bisect_left(times, start_ns)
        hi = bisect.bisect_right(times, end_ns)
        before = running[lo - 1] if lo > 0 else 0
        if hi <= lo:
            return 0
        return max(0, max(running[lo:hi]) - before)

    forward: dict[str, int] = {}
    node_of_sequence: dict[int, str] = {}
    for event in events:
        if event.name.startswith(_PREFIX):
            name = event.name[len(_PREFIX):]
            forward[name] = peak_in(event.start_time_ns, event.end_time_ns)
            for child in _walk(list(event.children)):
                seq = getattr(child.extra_fields, "sequence_number", -1)
                if seq is not None and seq >= 0:
                    node_of_sequence.setdefault(seq, name)
    windows: dict[str, tuple[int, int]] = {}
    for event in events:
        if event.name.startswith(_BACKWARD):
            seq = getattr(event.extra_fields, "sequence_number", -1)
            name = node_of_sequence.get(seq)
            if name is None:
                continue
            lo, hi = windows.get(name, (event.start_time_ns, event.end_time_ns))
            windows[name] = (min(lo, event.start_time_ns), max(hi, event.end_time_ns))
    backward = {name: peak_in(lo, hi) for name, (lo, hi) in windows.items()}
    return forward, backward
