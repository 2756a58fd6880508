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

:func:`loss_tail` finds those ops: where the step takes the loss from the output's ``loss``
field, the output has other tensors, and the ops only the loss needs come after every other op.
:class:`LossSplitStep` runs the graph as two graph modules, each compiled on its own, called in
a row from Python (no Dynamo graph break: Dynamo resuming a graph module's frame after a break
crashed the process on some runs). The split changes no op: each graph runs the ops it holds,
in the graph's order.

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
    >>> x, y = torch.randn(4, 8), torch.randint(0, 16, (4,))
    >>> gm = trace_module(Model(), (x, y))
    >>> [str(n.target) for n in loss_tail(gm)]
    ['aten.cross_entropy_loss.default']
    >>> step = LossSplitStep(gm, loss_tail(gm))
    >>> torch.equal(step(x, y)["loss"], gm(x, y)["loss"])
    True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_unflatten

from profiling.measure import StepInputs, TrainingStep, flat_graph_inputs, unflatten_output
from rewrite.attach import _resolve

__all__ = ["loss_tail", "LossSplitStep"]

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


def loss_tail(gm: torch.fx.GraphModule, step: TrainingStep = TrainingStep()) -> list[torch.fx.Node]:
    """The ops only ``gm``'s loss needs, in graph order, where they come after every other op and
    the step takes the loss from the output's ``loss`` field (``step.loss_fn`` None) beside other
    output tensors; else an empty list. See the module example."""
    if step.loss_fn is not None:
        return []  # the loss is taken outside the graph, from the outputs it reads
    index = _loss_leaf(gm)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = tree_leaves(output.args)
    if index is None or not isinstance(leaves[index], torch.fx.Node):
        return []
    loss = leaves[index]
    others = [leaf for i, leaf in enumerate(leaves) if i != index and isinstance(leaf, torch.fx.Node)
              and leaf.op in _COMPUTE_OPS]
    if not others or loss.op not in _COMPUTE_OPS:
        return []
    needed_by_others = _ancestors(others)
    needed_by_loss = _ancestors([loss])
    compute = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS]
    last_shared = max(i for i, n in enumerate(compute) if n in needed_by_others)
    tail = compute[last_shared + 1:]
    if not tail or tail[-1] is not loss or any(n not in needed_by_loss for n in tail):
        log.debug("no split before the loss: the ops only the loss needs are not the graph's last")
        return []
    if any(user.op != "output" and user not in tail for node in tail for user in node.users):
        return []
    return tail


class LossSplitStep(torch.nn.Module):
    """``gm`` run as two graph modules: ``head`` (every op but ``tail``), then ``tail`` (the ops only
    the loss needs, :func:`loss_tail`), taking what they read from ``head``'s outputs, the graph's
    inputs and ``gm``'s attributes. Called as ``gm`` is, it returns what ``gm`` returns;
    :meth:`compiled` compiles each part on its own. See the module example."""

    def __init__(self, gm: torch.fx.GraphModule, tail: list[torch.fx.Node]) -> None:
        super().__init__()
        object.__setattr__(self, "gm", gm)  # not a submodule: the graph's state stays the user's
        in_tail = set(tail)
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        head_graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op != "output" and node not in in_tail:
                env[node] = head_graph.node_copy(node, lambda n: env[n])
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        read = [n for n in gm.graph.nodes if n not in in_tail and n.op not in ("output", "placeholder", "get_attr")
                and any(user in in_tail or user is output for user in n.users)]
        head_graph.output(tuple(env[n] for n in read))
        head = torch.fx.GraphModule(gm, head_graph)
        # the head reads parameters through the graph's own module tree (the user's, once attached)
        head._modules, head._parameters, head._buffers = gm._modules, gm._parameters, gm._buffers

        def source(node: torch.fx.Node) -> tuple[str, Any]:
            """Where a value the tail or the output reads comes from."""
            if node.op == "placeholder":
                return "input", placeholders.index(node)
            if node.op == "get_attr":
                return "attr", node.target
            return "head", read.index(node)

        tail_graph = torch.fx.Graph()
        tail_env: dict[torch.fx.Node, torch.fx.Node] = {}
        #: where each of the tail's inputs comes from: ("input", index), ("attr", name) or ("head", index)
        self._tail_sources: list[tuple[str, Any]] = []
        for node in tail:
            for value in node.all_input_nodes:
                if value not in tail_env:
                    tail_env[value] = tail_graph.placeholder(value.name)
                    self._tail_sources.append(source(value))
            tail_env[node] = tail_graph.node_copy(node, lambda n: tail_env[n])
        tail_graph.output(tail_env[tail[-1]])
        self.head: torch.nn.Module = head
        self.tail: torch.nn.Module = torch.fx.GraphModule(torch.nn.Module(), tail_graph)
        #: each output leaf: ("loss", None), ("constant", value), or where it comes from
        self._out_leaves: list[tuple[str, Any]] = [
            ("loss", None) if leaf is tail[-1] else source(leaf) if isinstance(leaf, torch.fx.Node)
            else ("constant", leaf) for leaf in tree_leaves(output.args)]

    def compiled(self, backend: Any) -> "LossSplitStep":
        """This step with ``head`` and ``tail`` each under ``torch.compile(backend=backend)``, in place."""
        self.head = torch.compile(self.head, backend=backend)
        self.tail = torch.compile(self.tail, backend=backend)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = flat_graph_inputs(self.gm, StepInputs(args, kwargs))
        head_out = self.head(*flat)

        def value(kind: str, where: Any) -> Any:
            if kind == "input":
                return flat[where]
            if kind == "attr":
                return _resolve(self.gm, where)
            return head_out[where] if kind == "head" else where

        loss = self.tail(*(value(kind, where) for kind, where in self._tail_sources))
        return unflatten_output(self.gm, [loss if kind == "loss" else value(kind, where)
                                          for kind, where in self._out_leaves])

