"""How ``optimize`` captures and profiles a model: :class:`CaptureOptions`, one frozen object
checked when made, whose fields' defaults ``optimize``'s keywords take.

Example:
    >>> CaptureOptions().trace_method, CaptureOptions(compile=True).compile_backend
    ('export', 'inductor')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from planner.core.errors import InputError
from profiling.measure import TrainingStep
from profiling.trace import TRACE_METHODS
from rewrite.compiled import COMPILE_BACKEND

__all__ = ["CaptureOptions", "CAPTURE_METHODS"]

#: ``trace_method`` values: the capture methods, ``"graph-breaks"`` (the ATen ops of the eager
#: step, :mod:`planner.graph_break_plan`) and ``"modules"``, the module path
#: (:mod:`planner.module_plan`), which need no captured graph.
CAPTURE_METHODS = (*TRACE_METHODS, "graph-breaks", "modules")


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How ``optimize`` captures and profiles the model (its docstring says what each does)."""

    trace_method: str = "export"
    timing_repeats: int = 2
    cache_dir: str | None = None
    progress: bool = False
    simplify_attention_masks: bool = False
    chunk_loss: bool = False
    loss_fn: Callable[[Any], Any] | None = None
    output_held: bool = False
    #: run the step under ``torch.compile``: True (Inductor) or a backend name; False: eagerly
    compile: bool | str = False

    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend the step runs under (:mod:`rewrite.compiled`); None: eagerly."""
        if self.compile is False:
            return None
        return COMPILE_BACKEND if self.compile is True else str(self.compile)

    @property
    def step(self) -> TrainingStep:
        """The training step profiled, planned for and measured."""
        return TrainingStep(self.loss_fn, self.output_held)

    def __post_init__(self) -> None:
        if self.trace_method not in CAPTURE_METHODS:
            raise InputError(f"trace_method must be one of {CAPTURE_METHODS}, got {self.trace_method!r}")
        if isinstance(self.timing_repeats, bool) or not isinstance(self.timing_repeats, int) or \
                self.timing_repeats < 1:
            raise InputError(f"timing_repeats must be a positive integer, got {self.timing_repeats!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InputError(f"loss_fn must be a callable taking the model's output and returning the loss, "
                             f"got {type(self.loss_fn).__name__}")
        if not isinstance(self.output_held, bool):
            raise InputError(f"output_held must be True or False, got {self.output_held!r}")
