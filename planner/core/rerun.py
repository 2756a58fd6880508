"""Which nodes of a checkpointed segment run again in the backward, and what that costs.

Non-reentrant ``torch.utils.checkpoint`` stops recomputing a segment as soon as its rerun has
saved again every tensor the forward saved ("early stop", on by default). Autograd saves an
op's inputs before the op runs and its outputs after it, so the rerun covers every node up to
the last one that saves a tensor, and of that node only the part before its last save: a
segment that ends ``linear, gelu, linear`` reruns the first linear and the gelu, and stops when
the second linear has saved its input and weight, before its matmul. Nodes after the last
saver never rerun. The profiler measures each node's share after its last save, of its FLOPs
(``CostNode.after_last_save_fraction``) and of its time (``after_last_save_time_fraction``:
CPU attention saves its softmax halfway through its FLOPs but well past half its time); for a
node without them, the share is 1 when every tensor it saves is one of its inputs, else 0.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> g = CostGraph(
    ...     (CostNode("x", "placeholder", kind="input", output_storages=(0,)),
    ...      CostNode("tanh", "aten.tanh.default", input_names=("x",), output_storages=(1,),
    ...               saved_storages=(1,), time_ms=1.0),
    ...      CostNode("mul", "aten.mul.Tensor", input_names=("tanh", "x"), output_storages=(2,),
    ...               saved_storages=(1, 0), time_ms=2.0)),
    ...     (Storage(0, 8, persistent=True), Storage(1, 8), Storage(2, 8)))
    >>> rerun_node_names(g, ("tanh", "mul"))
    ('tanh',)
    >>> rerun_cost(g, ("tanh", "mul"))
    (1.0, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate

from planner.core.costgraph import CostGraph, CostNode
from planner.core.stages import Stage

__all__ = ["ChainCosts", "after_last_save_fraction", "after_last_save_time_fraction", "rerun_cost", "rerun_node_names", "saves_only_inputs",
           "skipped_node_names", "stage_run_costs"]


def saves_only_inputs(graph: CostGraph, node: CostNode) -> bool:
    """Whether every tensor ``node`` saves for backward is one of its inputs (or a parameter,
    buffer or graph input), so that autograd saves them all before the op runs.

    A node that saves nothing returns False. Alias nodes (views, in-place ops) return False:
    what they save may be their own output.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("gelu", "gelu", input_names=("x",), output_storages=(1,),
        ...                         saved_storages=(0,))),
        ...               (Storage(0, 8, persistent=True), Storage(1, 8)))
        >>> saves_only_inputs(g, g.node("gelu"))
        True
    """
    if not node.saved_storages or node.is_alias:
        return False
    sizes = graph.storage_by_key
    inputs = {k for name in node.input_names for k in graph.node(name).output_storages}
    return all(k in inputs or sizes[k].persistent for k in node.saved_storages)


def after_last_save_fraction(graph: CostGraph, node: CostNode) -> float:
    """The share of ``node``'s forward a recompute skips when it stops at this node: the
    profiler's measurement, or 1 when the node saves only its inputs and 0 otherwise.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("sdpa", "attention", after_last_save_fraction=0.5),), ())
        >>> after_last_save_fraction(g, g.node("sdpa"))
        0.5
    """
    if node.after_last_save_fraction is not None:
        return node.after_last_save_fraction
    return 1.0 if saves_only_inputs(graph, node) else 0.0


def after_last_save_time_fraction(graph: CostGraph, node: CostNode) -> float:
    """The share of ``node``'s forward *time* a recompute skips when it stops at this node: the
    profiler's timed share where the node stops partway (a share strictly between 0 and 1),
    else :func:`after_last_save_fraction`.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("sdpa", "attention", after_last_save_fraction=0.5,
        ...                         after_last_save_time_fraction=0.2),), ())
        >>> after_last_save_time_fraction(g, g.node("sdpa"))
        0.2
    """
    share = after_last_save_fraction(graph, node)
    if 0.0 < share < 1.0 and node.after_last_save_time_fraction is not None:
        return node.after_last_save_time_fraction
    return share


def _last_saver(graph: CostGraph, node_names: Sequence[str]) -> int:
    for i in range(len(node_names) - 1, -1, -1):
        if graph.node(node_names[i]).saved_storages:
            return i
    return -1


def rerun_node_names(graph: CostGraph, node_names: Sequence[str], kept: Iterable[str] = ()) -> tuple[str, ...]:
    """The nodes of the segment ``node_names`` (in execution order) that its recompute runs,
    wholly or in part: every node up to the last one that saves a tensor (that one unless the
    recompute skips all of it), less the ``kept`` nodes (a selective policy returns their
    stored outputs). A segment in which no node saves anything reruns nothing.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("a", "op", saved_storages=()), CostNode("b", "op")), ())
        >>> rerun_node_names(g, ("a", "b"))
        ()
    """
    last = _last_saver(graph, node_names)
    if last >= 0 and after_last_save_fraction(graph, graph.node(node_names[last])) >= 1.0:
        last -= 1
    kept_names = set(kept)
    return tuple(name for name in node_names[: last + 1] if name not in kept_names)


def skipped_node_names(graph: CostGraph, node_names: Sequence[str], kept: Iterable[str] = ()) -> tuple[str, ...]:
    """The nodes of the segment ``node_names`` its recompute never runs and a selective policy
    does not keep: ``Segment.skipped_nodes``.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("a", "op", saved_storages=()), CostNode("b", "op")), ())
        >>> skipped_node_names(g, ("a", "b"))
        ('a', 'b')
    """
    kept_names = set(kept)
    rerun = set(rerun_node_names(graph, node_names, kept_names))
    return tuple(name for name in node_names if name not in rerun and name not in kept_names)


def rerun_cost(graph: CostGraph, node_names: Sequence[str], kept: Iterable[str] = ()) -> tuple[float, int]:
    """``(time_ms, flops)`` the recompute of the segment ``node_names`` spends: the nodes
    :func:`rerun_node_names` lists, the last saver only up to its last save (its time and FLOPs
    shares before that save), and, where anything is saved (so the backward recomputes),
    ``graph.segment_overhead_ms`` plus ``graph.range_overhead_ms_per_node`` for each node.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", output_storages=(0,), saved_storages=(0,),
        ...                         time_ms=2.0, flops=5),), (Storage(0, 8),))
        >>> rerun_cost(g, ("a",))
        (2.0, 5)
    """
    kept_names = set(kept)
    last = _last_saver(graph, node_names)
    overhead_ms = graph.segment_overhead_ms + graph.range_overhead_ms_per_node * len(node_names)
    time_ms, flops = (overhead_ms if last >= 0 else 0.0), 0
    for i, name in enumerate(node_names[: last + 1]):
        if name in kept_names:
            continue
        node = graph.node(name)
        if i == last:
            time_ms += node.time_ms * (1.0 - after_last_save_time_fraction(graph, node))
            flops += round(node.flops * (1.0 - after_last_save_fraction(graph, node)))
        else:
            time_ms += node.time_ms
            flops += node.flops
    return time_ms, flops


class ChainCosts:
    """:func:`rerun_cost` of every contiguous run of a sequence of nodes, each in O(1) after
    O(n) set-up (prefix sums and the last saver at or before each position): what the solvers
    price thousands of candidate segments with.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", output_storages=(0,), saved_storages=(0,), time_ms=2.0),
        ...                CostNode("b", "op", time_ms=1.0)), (Storage(0, 8),))
        >>> ChainCosts(g, ("a", "b")).time_ms(0, 1)  # b saves nothing: the recompute stops after a
        2.0
    """

    def __init__(self, graph: CostGraph, node_names: Sequence[str]) -> None:
        nodes = [graph.node(name) for name in node_names]
        self.node_names = tuple(node_names)
        self._time_prefix = [0.0, *accumulate(n.time_ms for n in nodes)]
        self._flops_prefix = [0, *accumulate(n.flops for n in nodes)]
        self._last_saver: list[int] = []
        last = -1
        for i, node in enumerate(nodes):
            if node.saved_storages:
                last = i
            self._last_saver.append(last)
        self._time_share = [1.0 - after_last_save_time_fraction(graph, n) if n.saved_storages else 0.0 for n in nodes]
        self._flops_share = [1.0 - after_last_save_fraction(graph, n) if n.saved_storages else 0.0 for n in nodes]
        self._time = [n.time_ms for n in nodes]
        self._flops = [n.flops for n in nodes]
        self._segment_ms = graph.segment_overhead_ms
        self._node_ms = graph.range_overhead_ms_per_node

    def _last(self, first: int, last: int) -> int:
        saver = self._last_saver[last]
        return saver if saver >= first else -1

    def time_ms(self, first: int, last: int) -> float:
        """Recompute time of the run of positions ``first..last`` (inclusive)."""
        end = self._last(first, last)
        if end < 0:
            return 0.0
        return (self._time_prefix[end] - self._time_prefix[first] + self._time[end] * self._time_share[end]
                + self._segment_ms + self._node_ms * (last - first + 1))

    def flops(self, first: int, last: int) -> int:
        """Recomputed FLOPs of the run of positions ``first..last`` (inclusive)."""
        end = self._last(first, last)
        if end < 0:
            return 0
        return self._flops_prefix[end] - self._flops_prefix[first] + round(self._flops[end] * self._flops_share[end])


def stage_run_costs(graph: CostGraph, stages: Sequence[Stage], runs: Iterable[tuple[int, int]] | None = None
                    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], int]]:
    """Recompute time and FLOPs of every run ``(first_stage, last_stage)`` of ``stages`` (only
    of ``runs`` where given: a stage model prices its candidate segments, not all pairs).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", output_storages=(0,), saved_storages=(0,), time_ms=2.0),), (Storage(0, 8),))
        >>> stage_run_costs(g, [Stage(("a",), True)])
        ({(0, 0): 2.0}, {(0, 0): 0})
    """
    costs = ChainCosts(graph, [name for stage in stages for name in stage.node_names])
    first = list(accumulate((len(stage.node_names) for stage in stages), initial=0))
    if runs is None:
        runs = [(a, b) for a in range(len(stages)) for b in range(a, len(stages))]
    else:
        runs = list(runs)
    return ({(a, b): costs.time_ms(first[a], first[b + 1] - 1) for a, b in runs},
            {(a, b): costs.flops(first[a], first[b + 1] - 1) for a, b in runs})
