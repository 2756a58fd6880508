"""Notice, at run time, a training loop that holds the output a plan assumed freed.

A plan made for the default step (``output_held=False``) counts the module's output only
until the loss is taken. A loop that keeps it (``out = opt(x); loss = crit(out, y);
loss.backward()`` with ``out`` still alive) holds those bytes through the whole backward, and
the measured peak can pass the budget. :class:`HeldOutputCheck` keeps a weak reference to each
output tensor and registers a gradient hook on it: the hook runs in the backward once every
function that saved the tensor (the criterion's, a later layer's) has run and released it, so
a tensor still alive then is the loop's. It warns once, with the bytes over the plan and the
option that fixes it. A training loop does the same thing every step, so it watches the first
:data:`WATCHED_FIRST_CALLS` calls and every :data:`WATCH_EVERY_CALLS`-th after them: the
weak reference and hook cost tens of microseconds a call right after a backward, a few percent of
a small model's step (docs/tuning.md#watch_every_calls).

Example:
    >>> import torch, warnings
    >>> check = HeldOutputCheck()
    >>> out = torch.nn.Linear(4, 4)(torch.randn(3, 4))
    >>> check.watch(out)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out.sum().backward()        # ``out`` is still held here
    >>> "output_held=True" in str(caught[0].message)
    True
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from planner.core.units import format_bytes

__all__ = ["HeldOutputCheck", "WatchesHeldOutput", "WATCHED_FIRST_CALLS", "WATCH_EVERY_CALLS"]

#: Calls watched one by one from the first: a loop that holds the output is caught at once.
WATCHED_FIRST_CALLS = 8
#: After the first calls, every this many-th call is watched: a loop that holds the output only
#: on some steps (logging every n steps) is still caught, at a sixteenth of the cost.
WATCH_EVERY_CALLS = 16


class HeldOutputCheck:
    """Warns once when output tensors outlive the loss into the backward (see module docs)."""

    #: training calls seen (a class default: a check saved without it reads 0)
    calls = 0

    def __init__(self) -> None:
        self.warned = False

    def watch(self, output: Any) -> None:
        """Watch the non-scalar differentiable tensors of ``output`` (the loss is held by design)
        on the calls it samples (see module docs)."""
        self.calls += 1
        if self.warned or (self.calls > WATCHED_FIRST_CALLS and self.calls % WATCH_EVERY_CALLS):
            return
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            leaves: list[Any] = [output]
        elif isinstance(output, dict) and all(isinstance(v, torch.Tensor) or v is None for v in output.values()):
            leaves = list(output.values())  # a ModelOutput or a dict of tensors: no pytree walk every step
        else:
            leaves = tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.numel() > 1]
        if not tensors:
            return
        for t in tensors:
            t.register_hook(self._hook(weakref.ref(t)))

    def _hook(self, ref: "weakref.ref[torch.Tensor]") -> Any:
        """A gradient hook that warns if the tensor behind ``ref`` is still alive when it runs:
        by then every backward function that saved it has run and released it, so only the
        loop can be holding it."""

        def check(grad: torch.Tensor) -> None:
            held = ref()
            if held is None or self.warned:
                return
            self.warned = True
            size_bytes = held.untyped_storage().nbytes()
            warnings.warn(
                f"the training loop holds the module's output through the backward (a {tuple(held.shape)} tensor, "
                f"{format_bytes(size_bytes)} the plan counted as freed once the loss was taken): the peak can pass "
                f"the budget by that much; drop the output before backward(), or plan with output_held=True",
                stacklevel=2)

        return check


class WatchesHeldOutput:
    """For the modules that wrap a model (the captured graph, the module path, the graph-break
    path): :meth:`watch_output` watches a training call's output where the plan counted it
    freed once the loss was taken, with one :class:`HeldOutputCheck` per module. ``planner.enable``
    calls it on the output of the model's own forward."""

    def planned_output_held(self) -> bool:
        """Whether the plan was made for a loop that keeps the output through the backward (its
        profile's ``output_held``; True without a profile: nothing to watch)."""
        graph = self.__dict__.get("cost_graph")
        return True if graph is None else bool(graph.output_held)

    def watch_output(self, output: Any) -> None:
        """Watch ``output`` of a training call (see :class:`HeldOutputCheck`) unless the plan
        assumed it held."""
        if self.planned_output_held():
            return
        check = self.__dict__.get("_held_output_check")
        if check is None:  # also a module saved before it had one
            check = HeldOutputCheck()
            object.__setattr__(self, "_held_output_check", check)
        check.watch(output)
