"""Rewrite a captured GraphModule so each planned segment runs under ``torch.utils.checkpoint``.

Each segment becomes a small GraphModule whose inputs are the values it reads from outside
(parameters included) and whose outputs are the values read after it. The main graph calls
``checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=True)`` in its place,
so random ops (dropout) draw the same numbers on recompute and gradients stay bitwise equal.
The segment holder is a plain attribute, not a submodule: ``state_dict()`` keys and parameter
objects stay those of the user's model.

Example:
    >>> import torch
    >>> from planner.core.plan import Plan, Segment
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

import copy
import logging
import warnings
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.core.errors import PlannerError
from planner.core.plan import Plan
from profiling.batch_norm_updates import RUN_ONCE_OPS, merge_batch_norm_updates
from profiling.inplace_activations import restore_inplace_activations
from rewrite.operator_calls import call_operators_directly

__all__ = ["apply_plan", "CheckpointedSegment", "checkpointed_call", "PRISTINE_GRAPH", "copy_graph", "fresh_copy", "module_copy"]

log = logging.getLogger(__name__)

#: ``gm.meta`` key of the graph as captured, before segments were rewritten.
PRISTINE_GRAPH = "checkpoint_planner_pristine_graph"


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    with warnings.catch_warnings():  # torch's own pytree spec copy warns about LeafSpec
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(graph)


def fresh_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with the graph ``gm`` had before :func:`apply_plan` rewrote it."""
    pristine = gm.meta.get(PRISTINE_GRAPH)
    if pristine is None:
        raise PlannerError("this module was built without its graph as captured; re-plan with optimize()")
    return module_copy(gm, pristine)


def module_copy(gm: torch.fx.GraphModule, graph: torch.fx.Graph | None = None) -> torch.fx.GraphModule:
    """A new GraphModule running a copy of ``graph`` (default: ``gm``'s) on ``gm``'s own
    parameters and buffers, called as ``gm`` is called: a plan can rewrite it and leave ``gm`` be."""
    fresh = torch.fx.GraphModule(gm, copy_graph(gm.graph if graph is None else graph))
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(fresh, attr, getattr(gm, attr))
    return fresh


class CheckpointedSegment:
    """A callable holding one segment's GraphModule; kept out of the module tree on purpose.

    With ``kept_nodes``, the segment runs under a selective checkpoint policy: every op that
    runs inside one of those FX nodes is saved in the forward (``MUST_SAVE``) and replayed from
    that cache in the recompute; all other ops are recomputed. The segment's graph then takes
    the segment itself as its first input and sets :attr:`in_kept_node` around each kept node
    (:func:`_enter_kept_node`, :func:`_leave_kept_node`), which the policy reads. (Running the
    graph through an ``fx.Interpreter`` to know the current node cost 15 us per node and pass
    on CPU; the markers cost nothing measurable.)
    """

    def __init__(self, graph_module: torch.fx.GraphModule, kept_nodes: frozenset[str] = frozenset()) -> None:
        self.graph_module = graph_module
        self.kept_nodes = kept_nodes
        self.in_kept_node = False

    def __call__(self, *args: Any) -> Any:
        # ``forward`` itself, not the module call: a recompute that stops early ends in an
        # exception, and GraphModule's call wrapper walks its traceback through linecache on
        # every one (docs/tuning.md#segment_overhead_ms); the module has no hooks to run
        forward = self.graph_module.forward
        if not self.kept_nodes:
            return forward(*args)
        self.in_kept_node = False  # a step that raised inside a kept node left it set
        return forward(self, *args)

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if self.in_kept_node else CheckpointPolicy.PREFER_RECOMPUTE

    def context(self) -> Any:
        return create_selective_checkpoint_contexts(self.policy)


def _enter_kept_node(segment: CheckpointedSegment) -> None:
    segment.in_kept_node = True


def _leave_kept_node(segment: CheckpointedSegment) -> None:
    segment.in_kept_node = False


@torch.compiler.disable
def checkpointed_call(segment: CheckpointedSegment, *args: Any) -> Any:
    """Run ``segment`` under non-reentrant checkpoint with the RNG state preserved; a plain
    call when autograd is off (inference pays no recompute).

    Under ``torch.compile`` each segment runs eagerly (a graph break): compiled, the partitioner
    saved more than the plan (measured: 3.10 MB against the eager plan's 2.45 MB on a small MLP)
    and compiled random ops do not replay eager RNG state. The code between segments compiles.
    """
    if not torch.is_grad_enabled():
        return segment(*args)
    if segment.kept_nodes:
        return torch.utils.checkpoint.checkpoint(
            segment, *args, use_reentrant=False, preserve_rng_state=True, context_fn=segment.context
        )
    return torch.utils.checkpoint.checkpoint(segment, *args, use_reentrant=False, preserve_rng_state=True)


def apply_plan(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place so each of ``plan.segments`` is checkpointed; returns ``gm``.

    ``gm`` should be the graph the plan was made from (node names are the join key). A copy of
    the graph as it was is kept in ``gm.meta``, to re-apply the plan with FSDP unit hooks.
    """
    gm.meta[PRISTINE_GRAPH] = copy_graph(gm.graph)
    graph = gm.graph
    recomputed = frozenset(name for s in plan.segments for name in s.node_names)
    merge_batch_norm_updates(gm, recomputed)
    restore_inplace_activations(gm, recomputed)
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
    # Buffers only run-once ops read (BatchNorm's running statistics, num_batches_tracked) are
    # updated in place during the forward; passed as tensors, checkpoint would save them and
    # refuse the changed version on recompute. They go by reference: the run-once ops skip
    # themselves in the recompute, so nothing reads their values there.
    by_reference = {arg for arg in inputs
                    if all(u.op == "call_function" and u.target in RUN_ONCE_OPS for u in arg.users if u in inside)}

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    marker_target = sub.placeholder("checkpointed_segment") if kept_nodes else None
    for arg in inputs:
        env[arg] = sub.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for arg in inputs:
        if arg in by_reference:
            env[arg] = sub.call_function(_dereference, (env[arg],))
    for node in members:
        kept = node.name in kept_nodes
        if kept:
            sub.call_function(_enter_kept_node, (marker_target,))
        env[node] = sub.node_copy(node, lambda a: env[a])
        if kept:
            sub.call_function(_leave_kept_node, (marker_target,))
    sub.output(tuple(env[n] for n in outputs))
    segment_module = torch.fx.GraphModule(gm, sub, class_name=attr)
    call_operators_directly(segment_module)  # runs twice a step: no Python frame per operator
    segment = CheckpointedSegment(segment_module, kept_nodes)
    setattr(gm, attr, segment)

    last = members[-1]
    with graph.inserting_after(last), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        holder = graph.get_attr(attr)
    args: list[torch.fx.Node] = []
    anchor = holder
    for arg in inputs:
        if arg in by_reference:
            with graph.inserting_after(anchor):
                anchor = graph.call_function(_Reference, (arg,))
            args.append(anchor)
        else:
            args.append(arg)
    with graph.inserting_after(anchor):
        call = graph.call_function(checkpointed_call, (holder, *args))
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


class _Reference:
    """A tensor handed to a checkpointed segment without checkpoint saving it."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def _dereference(ref: _Reference) -> torch.Tensor:
    return ref.value
