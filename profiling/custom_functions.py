"""Custom ``torch.autograd.Function`` calls captured as one node each, their own backward kept.

A capture records the ops a Function's ``forward`` runs, not the Function: differentiated,
those ops give autograd's derivative of the forward, not the Function's own ``backward``
(another formula and other rounding, or another gradient altogether: a straight-through
estimator, a clipped or scaled gradient). Within :func:`custom_functions_as_ops`, every
Function outside torch is applied through one operator, ``ckpt_planner::autograd_function``,
which ``torch.export`` records as a single node: at run time that node applies the Function
itself, so the captured step computes, saves and differentiates exactly what the eager step
does (the profiler sees what the Function saves; a checkpointed segment recomputes it by
applying it again).

A call is made opaque when its outputs are tensors (one, or a tuple or list of them) that are
neither its inputs nor views; its other arguments are constants of the capture, as they are
to any captured op. Any other call runs inline as before, and is named in the list the
context yields, so that the capture can refuse it.

Example:
    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x.clone()
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return 2 * grad
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Twice.apply(torch.tanh(x)).sum()
    >>> with custom_functions_as_ops() as inline:
    ...     gm = torch.export.export(M(), (torch.randn(3),), strict=False).module()
    >>> inline, sum(n.target is AUTOGRAD_FUNCTION for n in gm.graph.nodes)
    ([], 1)
    >>> x = torch.randn(3, requires_grad=True)
    >>> gm(x).backward()   # the Function's own (doubled) gradient
    >>> torch.allclose(x.grad, 2 * (1 - torch.tanh(x.detach()) ** 2))
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["AUTOGRAD_FUNCTION", "custom_functions_as_ops", "function_of"]

log = logging.getLogger(__name__)

_LIBRARY = torch.library.Library("ckpt_planner", "FRAGMENT")
_LIBRARY.define("autograd_function(int key, Tensor[] tensors) -> Tensor[]")

#: the operator a captured graph applies each custom Function through
AUTOGRAD_FUNCTION = torch.ops.ckpt_planner.autograd_function.default

_APPLY = torch.autograd.Function.__dict__["apply"]


class _NotOpaque(Exception):
    """A call whose outputs cannot be an operator's (not tensors, inputs or views)."""


@dataclasses.dataclass(frozen=True)
class _FunctionCall:
    """One call site's Function and its arguments less the tensors (the operator's input)."""

    function: type
    spec: pytree.TreeSpec
    constants: tuple[Any, ...]
    tensor_slots: tuple[int, ...]

    def apply(self, tensors: list[torch.Tensor]) -> Any:
        leaves = list(self.constants)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return _APPLY.__func__(self.function, *args, **kwargs)


# Keyed by a hash of what the call is, so that the same model captured again (in this process or
# another) gives the same graph code, which the profile cache's fingerprint reads.
_CALLS: dict[int, _FunctionCall] = {}
_OUTPUT_SPECS: dict[int, pytree.TreeSpec] = {}


def function_of(key: int) -> type:
    """The Function the ``autograd_function`` node of ``key`` applies.

    Example:
        >>> function_of(-1)
        Traceback (most recent call last):
        ...
        KeyError: -1
    """
    return _CALLS[key].function


def _same_call(a: _FunctionCall, b: _FunctionCall) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - constants whose == is no bool (arrays): not known equal
        return False


def _key_of(call: _FunctionCall) -> int:
    what = f"{call.function.__module__}.{call.function.__qualname__}|{call.spec}|{call.constants!r}"
    key = int.from_bytes(hashlib.sha256(what.encode()).digest()[:7], "big")
    while key in _CALLS and not _same_call(_CALLS[key], call):  # another class of the same name
        key += 1
    return key


def _outputs(key: int, out: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise _NotOpaque("its outputs are not all tensors")
    if any(t is i for t in leaves for i in tensors) or any(t._is_view() for t in leaves):
        raise _NotOpaque("an output is an input or a view")
    _OUTPUT_SPECS[key] = spec
    return leaves


def _autograd_kernel(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # at the Autograd key: the Function's own apply builds its autograd node, as in eager
    return _outputs(key, _CALLS[key].apply(tensors), tensors)


def _below_autograd_kernel(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return _outputs(key, _CALLS[key].apply(tensors), tensors)


_LIBRARY.impl("autograd_function", _autograd_kernel, "Autograd")
_LIBRARY.impl("autograd_function", _below_autograd_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("ckpt_planner::autograd_function", _below_autograd_kernel, lib=_LIBRARY)


@contextlib.contextmanager
def custom_functions_as_ops() -> Iterator[list[type]]:
    """Within the context, each custom Function (outside torch) applies through
    :data:`AUTOGRAD_FUNCTION`, a node of its own in a capture; the context yields the Functions
    that ran inline instead (outputs not plain new tensors: see the module docstring), in call
    order. See the module docstring for an example."""
    inline: list[type] = []

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch."):
            return _APPLY.__func__(cls, *args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        constants = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        call = _FunctionCall(cls, spec, constants, slots)
        key = _key_of(call)
        _CALLS[key] = call
        try:
            outputs = AUTOGRAD_FUNCTION(key, [leaves[i] for i in slots])
        except _NotOpaque as why:
            log.debug("custom autograd.Function %s runs inline: %s", cls.__qualname__, why)
            inline.append(cls)
            return _APPLY.__func__(cls, *args, **kwargs)
        return pytree.tree_unflatten(list(outputs), _OUTPUT_SPECS[key])

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield inline
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]
