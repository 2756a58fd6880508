"""Time each ATen op a model's forward dispatches, in warm training steps.

The graph-break profile (:mod:`profiling.graph_breaks`) needs a forward time per op to price
its recompute. After one untimed warm-up step, ``repeats`` training steps run with a light
dispatch mode that times every counted op of the forward (the k-th op is ``op<k>``); each op
gets the median over its twins, the ops of the same function on the same shapes (one per
layer), and over the passes, less the mode's own cost per op (the cheapest op's median: a view,
which costs next to nothing without the mode). The unoptimized step's time is the median of as
many plain steps, run between the timed ones.

Example:
    >>> import torch
    >>> from profiling.measure import StepInputs
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    >>> times_ms, step_ms = time_ops(model, StepInputs.from_example((torch.randn(32, 64),)), repeats=1)
    >>> len(times_ms), step_ms > 0
    (3, True)
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from profiling.measure import StepInputs, TrainingStep, preserved_state, run_step
from profiling.op_counting import UNCOUNTED_OPS

__all__ = ["time_ops"]


class _OpTimer(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.times_ms: list[float] = []
        self.keys: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func) in UNCOUNTED_OPS:
            return func(*args, **kwargs)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        self.times_ms.append((time.perf_counter() - started) * 1e3)
        shapes = tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        self.keys.append((str(func), shapes))
        return out


class _Timed(torch.nn.Module):
    """``model`` whose forward runs under ``timer``."""

    def __init__(self, model: torch.nn.Module, timer: _OpTimer) -> None:
        super().__init__()
        self.model = model
        self.timer = timer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer:
            return self.model(*args, **kwargs)


def time_ops(model: torch.nn.Module, inputs: StepInputs, step: TrainingStep = TrainingStep(),
             repeats: int = 2, *, warm_up: bool = True) -> tuple[list[float], float]:
    """Per counted op of the forward, its time in ms; and the unoptimized step's time in ms.
    ``warm_up``: run an untimed step first, so the allocator's buffers exist (False where the
    caller has just run steps of the model)."""
    passes: list[_OpTimer] = []
    step_times_ms: list[float] = []
    with preserved_state(model):
        if warm_up:
            run_step(model, inputs, step)
        for _ in range(max(1, repeats)):
            started = time.perf_counter()
            run_step(model, inputs, step)
            step_times_ms.append((time.perf_counter() - started) * 1e3)
            timer = _OpTimer()
            run_step(_Timed(model, timer), inputs, step)
            passes.append(timer)
    first = passes[0]
    agreeing = [p for p in passes if p.keys == first.keys]
    pooled: dict[tuple[str, tuple[Any, ...]], list[float]] = {}
    for timed in agreeing:
        for key, ms in zip(timed.keys, timed.times_ms):
            pooled.setdefault(key, []).append(ms)
    medians = {key: statistics.median(values) for key, values in pooled.items()}
    overhead_ms = min(medians.values(), default=0.0)
    floor_ms = 1e-4
    return [max(medians[key] - overhead_ms, floor_ms) for key in first.keys], statistics.median(step_times_ms)
