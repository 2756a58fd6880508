"""How ``optimize`` captures and profiles a model: :class:`CaptureOptions`, one frozen object
checked when made, whose fields' defaults ``optimize``'s keywords take. It imports no torch,
so the command line reads its fields for its flags without loading torch.

Example:
    >>> CaptureOptions().trace_method, CaptureOptions(compile=True).compile_backend
    ('export', 'inductor')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planner.core.errors import InputError
from planner.core.options import COMPILE_BACKEND, TRACE_METHODS, option

if TYPE_CHECKING:
    from profiling.measure import TrainingStep

__all__ = ["CaptureOptions", "CAPTURE_METHODS"]

#: ``trace_method`` values: the capture methods, ``"graph-breaks"`` (the ATen ops of the eager
#: step, :mod:`planner.graph_break_plan`) and ``"modules"``, the module path
#: (:mod:`planner.module_plan`), which need no captured graph.
CAPTURE_METHODS = (*TRACE_METHODS, "graph-breaks", "modules")


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How ``optimize`` captures and profiles the model: each field's default and one-line help
    are declared here once (``optimize``'s docstring says more about each)."""

    trace_method: str = option("export", "how the forward is captured: export or symbolic_trace (one graph; where "
                                         "capture fails, graph-breaks, then modules), graph-breaks (the ops of the "
                                         "eager step, for models with graph breaks) or modules (submodule calls, "
                                         "coarser)")
    timing_repeats: int | None = option(None, "warm training steps each node is timed in, more while they disagree "
                                              "(None: the captured step's memory pass alone on CPU, two on CUDA and "
                                              "on the graph-break and module paths)")
    cache_dir: str | None = option("auto", "a folder for profiles (auto: $CKPT_PLANNER_CACHE_DIR or "
                                           "~/.cache/ckpt-planner/profiles; None: none): the same model again "
                                           "skips profiling and gets the same plan")
    progress: bool = option(False, "draw a tqdm bar while profiling")
    simplify_attention_masks: bool = option(False, "pass is_causal instead of a constant causal mask to attention "
                                                   "where the model passes the mask: a faster kernel, but other "
                                                   "rounding and attention-dropout stream than the model's own "
                                                   "(labelled in the output)")
    chunk_loss: bool = option(False, "let the plan compute the output head and cross-entropy loss in row chunks "
                                     "under checkpoint where that pays (a lower floor on language models): another "
                                     "summation order, so the loss and gradients agree to rtol 1e-5, not bit for "
                                     "bit (labelled in the output)")
    loss_fn: Callable[[Any], Any] | None = option(None, "the criterion the loop applies to the model's output, "
                                                        "profiled as part of the step (default: the output's loss "
                                                        "field, else the sum of its outputs)")
    output_held: bool = option(False, "plan for a training loop that keeps the model's output alive through the "
                                      "backward (default: the output is dropped once the loss is taken, as in "
                                      "model(**batch).loss.backward() and the HF Trainer)")
    compile: bool | str = option(False, "plan for a training step run under torch.compile (Inductor unless a "
                                         "backend is named): the plan honoured inside one compiled graph and checked "
                                         "on the compiled step's measured peak (one compile per plan checked)")

    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend the step runs under (:mod:`rewrite.compiled`); None: eagerly."""
        if self.compile is False:
            return None
        return COMPILE_BACKEND if self.compile is True else str(self.compile)

    @property
    def step(self) -> TrainingStep:
        """The training step profiled, planned for and measured."""
        from profiling.measure import TrainingStep

        return TrainingStep(self.loss_fn, self.output_held)

    def __post_init__(self) -> None:
        if self.trace_method not in CAPTURE_METHODS:
            raise InputError(f"trace_method must be one of {CAPTURE_METHODS}, got {self.trace_method!r}")
        if self.timing_repeats is not None and (isinstance(self.timing_repeats, bool) or
                                                not isinstance(self.timing_repeats, int) or self.timing_repeats < 1):
            raise InputError(f"timing_repeats must be a positive integer or None, got {self.timing_repeats!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InputError(f"loss_fn must be a callable taking the model's output and returning the loss, "
                             f"got {type(self.loss_fn).__name__}")
        if not isinstance(self.output_held, bool):
            raise InputError(f"output_held must be True or False, got {self.output_held!r}")
