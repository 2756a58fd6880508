"""Notice, at run time, a training loop that holds the output a plan assumed freed.

A plan made for the default step (``output_held=False``) counts the module's output only
until the loss is taken. A loop that keeps it (``out = opt(x); loss = crit(out, y);
loss.backward()`` with ``out`` still alive) holds those bytes through the whole backward, and
the measured peak can pass the budget. :class:`HeldOutputCheck` keeps a weak reference to each
output tensor and registers a gradient hook on it: the hook runs in the backward once every
function that saved the tensor (the criterion's, a later layer's) has run and released it, so
a tensor still alive then is the loop's. It warns once, with the bytes over the plan and the option that fixes it. A weak
reference and a hook per output tensor cost nothing measurable.

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

__all__ = ["HeldOutputCheck"]



class HeldOutputCheck:
    """Warns once when output tensors outlive the loss into the backward (see module docs)."""

    def __init__(self) -> None:
        self.warned = False

    def watch(self, output: Any) -> None:
        """Watch the non-scalar differentiable tensors of ``output`` (the loss is held by design)."""
        if self.warned or not torch.is_grad_enabled():
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
