"""Time every node of a graph the way a training step runs it: in whole warm passes.

Timing a node alone, or in the first run of a process, measures the allocator as much as the
op: on CPU a fresh output buffer costs page faults that a warm training step does not pay. On
a GPT-2 at width 256 the per-node times of a first run summed to 2.2x the warm forward (a
``pow`` on 8 MiB: 23 ms alone, 0.5 ms in a warm pass), which made pointwise ops look too
expensive to recompute. So the graph is run as a step (forward node by node under an
``Interpreter`` that frees values after their last use, then backward) after one untimed
warm-up step, and each node gets the median of its times over the timed passes.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> gm = trace_module(model, (x,))
    >>> times = time_nodes_in_passes(gm, [x], repeats=2, timer=cpu_timer)
    >>> times["relu"] > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from profiling.measure import loss_of, preserved_state, unflatten_output

__all__ = ["Timer", "cpu_timer", "time_nodes_in_passes", "time_nodes_on_cuda"]

#: Runs a callable once and returns how long it took, in milliseconds.
Timer = Callable[[Callable[[], Any]], float]


def cpu_timer(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn()`` in ms (``time.perf_counter``)."""
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


class _NodeTimer(torch.fx.Interpreter):
    """An interpreter that adds each node's time to ``times_ms``; values are freed after their
    last use, as in the module's own forward."""

    def __init__(self, gm: torch.fx.GraphModule, timer: Timer, times_ms: dict[str, list[float]] | None) -> None:
        super().__init__(gm)
        self.timer = timer
        self.times_ms = times_ms

    def run_node(self, n: torch.fx.Node) -> Any:
        result: Any = None

        def run() -> None:
            nonlocal result
            result = super(_NodeTimer, self).run_node(n)

        if self.times_ms is None or n.op in ("placeholder", "output"):
            run()
        else:
            self.times_ms.setdefault(n.name, []).append(self.timer(run))
        return result


def time_nodes_in_passes(gm: torch.fx.GraphModule, flat_inputs: list[Any], repeats: int,
                         timer: Timer) -> dict[str, float]:
    """Median forward time (ms) of every node of ``gm`` over ``repeats`` warm training steps.

    ``flat_inputs`` are the graph's placeholders in order; ``timer`` measures one call (a
    CUDA-event timer on a GPU, :func:`cpu_timer` on CPU). One untimed step runs first. RNG
    state, buffers and ``.grad`` of ``gm`` are restored afterwards.
    """
    times_ms: dict[str, list[float]] = {}
    with preserved_state(gm):
        for timed in [False] + [True] * max(1, repeats):
            flat_out = _NodeTimer(gm, timer, times_ms if timed else None).run(*flat_inputs, enable_io_processing=False)
            loss_of(unflatten_output(gm, flat_out)).backward()
            del flat_out
            for p in gm.parameters():
                p.grad = None
    return {name: statistics.median(values) for name, values in times_ms.items()}


class _EventRecorder(torch.fx.Interpreter):
    """An interpreter that records a CUDA event before and after each node, without waiting."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = super().run_node(n)
        end.record()
        self.events.append((n.name, start, end))
        return result


def _ms_per_sleep_cycle() -> float:
    """GPU milliseconds one cycle of ``torch.cuda._sleep`` takes on the current device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10**7
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end), 1e-3) / cycles


def time_nodes_on_cuda(gm: torch.fx.GraphModule, flat_inputs: list[Any], repeats: int,
                       max_hold_ms: float = 2000.0) -> dict[str, float]:
    """Median GPU time (ms) of every node of ``gm`` over ``repeats`` warm training steps.

    Running a graph node by node from Python launches kernels more slowly than a compiled
    module's forward, so a GPU timed per node (or one waiting on every launch) mostly measures
    launch gaps. Here the GPU is held by a spin kernel (``torch.cuda._sleep``) for longer than
    the forward takes to launch, so the whole forward is queued before it runs and each node's
    events time its kernels back to back. One untimed step runs first (and sizes the hold). RNG
    state, buffers and ``.grad`` of ``gm`` are restored afterwards.
    """
    times_ms: dict[str, list[float]] = {}
    ms_per_cycle = _ms_per_sleep_cycle()
    launch_ms = max_hold_ms
    with preserved_state(gm):
        for timed in [False] + [True] * max(1, repeats):
            torch.cuda.synchronize()
            if timed:
                torch.cuda._sleep(int(min(max_hold_ms, 1.5 * launch_ms) / ms_per_cycle))
            recorder = _EventRecorder(gm)
            launched = time.perf_counter()
            flat_out = recorder.run(*flat_inputs, enable_io_processing=False)
            if not timed:
                launch_ms = (time.perf_counter() - launched) * 1e3
            loss_of(unflatten_output(gm, flat_out)).backward()
            del flat_out
            torch.cuda.synchronize()
            for p in gm.parameters():
                p.grad = None
            if timed:
                for name, start, end in recorder.events:
                    times_ms.setdefault(name, []).append(start.elapsed_time(end))
    return {name: statistics.median(values) for name, values in times_ms.items()}
