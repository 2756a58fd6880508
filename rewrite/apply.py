"""Rewrite a captured GraphModule so each planned segment runs under ``torch.utils.checkpoint``.

Each segment becomes a small GraphModule whose inputs are the values it reads from outside
(parameters included) and whose outputs are the values read after it. The main graph calls
``checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=True)`` in its place,
so random ops (dropout) draw the same numbers on recompute and gradients stay bitwise equal.
The segment holder is a plain attribute, not a submodule: ``state_dict()`` keys and parameter
objects stay those of the user's model.

Example:
    >>> import torch
    >>> from planner.plan import Plan, Segment
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    >>> gm = trace_module(model, (torch.randn(2, 4),))
    >>> names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    >>> plan = Plan(0, 0, 0, (Segment(tuple(names[:2]), 0.0, 0),), 0.0, 0.0, 0, "none", 0.0)
    >>> out = apply_plan(gm, plan)(torch.randn(2, 4))
    >>> tuple(out.shape)
    (2, 4)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.errors import PlannerError
from planner.plan import Plan

__all__ = ["apply_plan", "CheckpointedSegment", "CheckpointedModule"]

log = logging.getLogger(__name__)


class CheckpointedSegment:
    """A callable holding one segment's GraphModule; kept out of the module tree on purpose.

    With ``kept_nodes``, the segment runs under a selective checkpoint policy: every op that
    runs inside one of those FX nodes is saved in the forward (``MUST_SAVE``) and replayed from
    that cache in the recompute; all other ops are recomputed. The segment then runs through an
    ``fx.Interpreter`` so the policy knows which FX node an op belongs to.
    """

    def __init__(self, graph_module: torch.fx.GraphModule, kept_nodes: frozenset[str] = frozenset()) -> None:
        self.graph_module = graph_module
        self.kept_nodes = kept_nodes
        self.current_node: str | None = None

    def __call__(self, *args: Any) -> Any:
        if not self.kept_nodes:
            return self.graph_module(*args)
        return _TrackingInterpreter(self).run(*args)

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.current_node in self.kept_nodes:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context(self) -> Any:
        return create_selective_checkpoint_contexts(self.policy)


class _TrackingInterpreter(torch.fx.Interpreter):
    """Runs a segment, telling the segment's policy which FX node is running."""

    def __init__(self, segment: CheckpointedSegment) -> None:
        super().__init__(segment.graph_module)
        self.segment = segment

    def run_node(self, n: torch.fx.Node) -> Any:
        self.segment.current_node = n.name
        try:
            return super().run_node(n)
        finally:
            self.segment.current_node = None


class CheckpointedModule(torch.nn.Module):
    """The module ``optimize`` returns: the rewritten graph in training, the user's own module
    in eval mode (the captured graph is specialised to training, dropout included).

    It shares the graph module's children, parameters and buffers, so ``state_dict()`` keys and
    parameter objects are those of the user's model. ``plan`` says what was decided.
    """

    def __init__(self, graph_module: torch.fx.GraphModule, original: torch.nn.Module, plan: Plan) -> None:
        super().__init__()
        object.__setattr__(self, "graph_module", graph_module)  # not a child: no new state_dict keys
        object.__setattr__(self, "original", original)
        self._modules = graph_module._modules
        self._parameters = graph_module._parameters
        self._buffers = graph_module._buffers
        self.plan = plan
        self.train(original.training)

    def train(self, mode: bool = True) -> "CheckpointedModule":
        super().train(mode)
        self.original.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            return self.graph_module(*args, **kwargs)
        return self.original(*args, **kwargs)


def _checkpointed(segment: CheckpointedSegment, *args: Any) -> Any:
    """Run ``segment`` under non-reentrant checkpoint with the RNG state preserved; a plain
    call when autograd is off (inference pays no recompute)."""
    if not torch.is_grad_enabled():
        return segment(*args)
    if segment.kept_nodes:
        return torch.utils.checkpoint.checkpoint(
            segment, *args, use_reentrant=False, preserve_rng_state=True, context_fn=segment.context
        )
    return torch.utils.checkpoint.checkpoint(segment, *args, use_reentrant=False, preserve_rng_state=True)


def apply_plan(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place so each of ``plan.segments`` is checkpointed; returns ``gm``.

    ``gm`` should be the graph the plan was made from (node names are the join key).
    """
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    for k, segment in enumerate(plan.segments):
        missing = [name for name in segment.node_names if name not in by_name]
        if missing:
            raise PlannerError(f"segment {k} names nodes not in the graph: {missing[:3]}; re-plan on this graph")
        members = [by_name[name] for name in segment.node_names]
        _replace_segment(gm, members, f"checkpoint_segment_{k}", frozenset(segment.kept_nodes))
    graph.lint()
    gm.recompile()
    log.info("checkpointed %d segments (%d nodes)", len(plan.segments), len(plan.recomputed_nodes))
    return gm


def _replace_segment(
    gm: torch.fx.GraphModule, members: list[torch.fx.Node], attr: str, kept_nodes: frozenset[str]
) -> None:
    graph = gm.graph
    inside = set(members)
    inputs: dict[torch.fx.Node, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside:
                inputs[arg] = None
    outputs = [n for n in members if any(user not in inside for user in n.users)]

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in inputs:
        env[arg] = sub.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in members:
        env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    segment = CheckpointedSegment(torch.fx.GraphModule(gm, sub, class_name=attr), kept_nodes)
    setattr(gm, attr, segment)

    last = members[-1]
    with graph.inserting_after(last), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        holder = graph.get_attr(attr)
    with graph.inserting_after(holder):
        call = graph.call_function(_checkpointed, (holder, *inputs))
    anchor = call
    for i, node in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(_getitem, (call, i))
        item.meta = dict(node.meta)
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        anchor = item
    for node in reversed(members):
        graph.erase_node(node)


def _getitem(values: tuple[Any, ...], index: int) -> Any:
    return values[index]
