"""Which inputs of a node get its output's gradient itself in the backward, no new buffer
(``CostNode.grad_shared_inputs``).

Autograd's formula for an add passes the output's gradient on to both operands unchanged, a
clone's to its input, a subtraction's to its first operand; the engine allocates a new
gradient only where an operand's shape or dtype differs from the output's (it reduces or casts
it). A full ``sum`` hands its input an expanded view of the scalar's gradient. Counting each of
these as a new gradient buffer over-predicts the backward by an activation at every residual
add. The simulator holds one buffer for the names that share it
(:class:`planner.core.memory_account.MemoryAccount`), and sums a later gradient into it out
of place while another name still holds it, as autograd does.

An expanded view is no dense buffer: autograd sums a later gradient into it out of place
whoever holds it, which the simulator does not model, so a ``sum``'s (and a criterion's) input
shares its gradient only where nothing else reads it.

Example:
    >>> import torch
    >>> class Residual(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return (x + self.linear(x)).sum()
    >>> gm = torch.export.export(Residual(), (torch.randn(2, 4),), strict=False).module()
    >>> values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    >>> {n.name: grad_shared_inputs(n, values) for n in gm.graph.nodes if n.op == "call_function"}
    {'linear': (), 'add': ('x', 'linear'), 'sum_1': ('add',)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

__all__ = ["grad_shared_inputs", "only_reader", "is_expanded_view"]

_aten = torch.ops.aten
#: ops whose backward gives each listed operand the output's gradient itself
_PASSED_ON: dict[Any, tuple[int, ...]] = {
    _aten.add.Tensor: (0, 1),
    _aten.sub.Tensor: (0,),
    _aten.clone.default: (0,),
}
#: ops whose backward gives their input an expanded view of the output's gradient
_EXPANDED: frozenset[Any] = frozenset({_aten.sum.default})


def only_reader(producer: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``node`` is the only node that reads ``producer``'s value.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); y = g.call_function(torch.neg, (x,))
        >>> only_reader(x, y)
        True
    """
    return set(producer.users) == {node}


def is_expanded_view(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a view of a smaller buffer (an expanded scalar): its storage holds
    fewer bytes than its elements.

    Example:
        >>> is_expanded_view(torch.ones(()).expand(4, 4)), is_expanded_view(torch.ones(4, 4))
        (True, False)
    """
    return grad.untyped_storage().nbytes() < grad.numel() * grad.element_size()


def _same_tensor_kind(value: Any, output: Any) -> bool:
    return (isinstance(value, torch.Tensor) and isinstance(output, torch.Tensor)
            and value.shape == output.shape and value.dtype == output.dtype)


def grad_shared_inputs(node: torch.fx.Node, values: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of ``node``'s inputs that get its output's gradient itself in the backward
    (see the module docstring); ``values`` holds each node's value by name (a tensor, real or
    fake). See the module docstring for an example."""
    if node.op != "call_function":
        return ()
    output = values.get(node.name)
    if node.target in _PASSED_ON:
        if node.kwargs.get("alpha", 1) != 1 and node.target is _aten.add.Tensor:
            positions: tuple[int, ...] = (0,)
        else:
            positions = _PASSED_ON[node.target]
        operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        if len(operands) != len(set(operands)):
            return ()  # x + x: the two gradients are summed into a new buffer
        return tuple(arg.name for i, arg in enumerate(node.args[:2])
                     if i in positions and isinstance(arg, torch.fx.Node)
                     and _same_tensor_kind(values.get(arg.name), output))
    if node.target in _EXPANDED and node.args and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        if only_reader(source, node) and isinstance(values.get(source.name), torch.Tensor):
            return (source.name,)
    return ()
