"""Compile a step whose graph computes its own loss as two graphs: the model, then its loss.

A compiled graph is one autograd function, and autograd hands such a function a gradient for
every output that requires grad: for an output the loss does not read (a language model's
logits, returned beside the loss it computed from them) that gradient is a tensor of zeros of
the output's size, made at the start of the backward and held through it. The step the user
runs eagerly makes no such tensor, and neither does ``torch.compile(model)`` where the model's
loss function breaks the graph (HF's does on some models). Split before the ops only the loss
needs, the first graph's outputs are what the loss reads, each with its real gradient: measured
on a 4-layer GPT-2 and a Llama-style model (vocabulary 4096, batch 4 x 256), the compiled step
peaks 16 MiB lower, the logits' bytes (docs/memory.md#compiled-steps).

:func:`split_before_loss` inserts that split (a ``torch._dynamo.graph_break()`` call) into a
captured graph where its loss is an output beside others and the ops only the loss needs come
last. The split changes no op: each graph runs the ops it holds, in the same order.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> class Model(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.head = torch.nn.Linear(8, 16)
    ...     def forward(self, x, y):
    ...         logits = self.head(x)
    ...         return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}
    >>> gm = trace_module(Model(), (torch.randn(4, 8), torch.randint(0, 16, (4,))))
    >>> split_before_loss(gm)
    True
    >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-2:]
    [<function graph_break at ...>, <OpOverload(op='aten.cross_entropy_loss', overload='default')>]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_unflatten

from profiling.measure import TrainingStep

__all__ = ["split_before_loss", "is_split_before_loss"]

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def _loss_leaf(gm: torch.fx.GraphModule) -> int | None:
    """The position, among the graph's output leaves, of the output's ``loss`` field (the loss
    :func:`profiling.measure.loss_of` takes); None where the output has none."""
    spec = getattr(gm, "_out_spec", None)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if spec is None:
        return None
    try:
        structure = tree_unflatten(list(range(len(tree_leaves(output.args)))), spec)
        index = structure["loss"] if isinstance(structure, Mapping) or hasattr(structure, "keys") else None
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    return index if isinstance(index, int) else None


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def is_split_before_loss(gm: torch.fx.GraphModule) -> bool:
    """Whether :func:`split_before_loss` split ``gm``.

    Example:
        >>> is_split_before_loss(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
        False
    """
    return any(n.op == "call_function" and n.target is torch._dynamo.graph_break for n in gm.graph.nodes)


def split_before_loss(gm: torch.fx.GraphModule, step: TrainingStep = TrainingStep()) -> bool:
    """Insert a graph break before the ops only ``gm``'s loss needs, in place; whether it did.

    It splits where the step takes the loss from the output's ``loss`` field (``step.loss_fn``
    None), the output has other tensors, and the ops only the loss needs (not those the other
    outputs need) come after every other op. Done already, it does nothing more. See the module
    example."""
    if is_split_before_loss(gm):
        return True
    if step.loss_fn is not None:
        return False  # the loss is taken outside the graph, from the outputs it reads
    index = _loss_leaf(gm)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = tree_leaves(output.args)
    if index is None or not isinstance(leaves[index], torch.fx.Node):
        return False
    loss = leaves[index]
    others = [leaf for i, leaf in enumerate(leaves) if i != index and isinstance(leaf, torch.fx.Node)
              and leaf.op in _COMPUTE_OPS]
    if not others:
        return False
    needed_by_others = _ancestors(others)
    needed_by_loss = _ancestors([loss])
    compute = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS]
    last_shared = max(i for i, n in enumerate(compute) if n in needed_by_others)
    tail = compute[last_shared + 1:]
    if not tail or tail[-1] is not loss or any(n not in needed_by_loss for n in tail):
        log.debug("no split before the loss: the ops only the loss needs are not the graph's last")
        return False
    with gm.graph.inserting_before(tail[0]):
        gm.graph.call_function(torch._dynamo.graph_break, ())
    gm.recompile()
    log.debug("compiled step split before its loss: %d ops in the loss's graph", len(tail))
    return True
