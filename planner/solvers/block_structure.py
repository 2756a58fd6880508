"""Repeated blocks found from the graph's structure alone, for graphs without module paths.

A model captured without its module hierarchy (``torch.fx.symbolic_trace`` of some models, a
saved ``.pt2`` program, a hand-made graph) still shows its layers: the sequence of compute nodes,
each labelled by its op and output size, repeats itself once per layer. :func:`structural_blocks`
finds the longest such tandem repeat (the period that covers the most nodes, the shortest of
equal ones), cuts it where the fewest bytes cross the block boundary (between layers only the
residual stream is live), and looks again in what is left before and after it (an encoder and a
decoder are two stacks).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 10):   # three layers of (linear, relu, add): no module paths
    ...     op = ("aten.linear.default", "aten.relu.default", "aten.add.Tensor")[(i - 1) % 3]
    ...     nodes.append(CostNode(f"n{i}", op, input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(10)), ("n9",))
    >>> [len(block) for block in structural_blocks(g)[0]]
    [3, 3, 3]
"""

from __future__ import annotations

import numpy as np

from planner.core.costgraph import CostGraph

__all__ = ["structural_blocks", "node_labels", "crossing_bytes", "MIN_BLOCK_NODES", "MIN_STACK_SHARE"]

#: Fewest compute nodes a structural block may have: a layer of fewer is an op pair
#: (linear, relu), the smallest a hand-placed checkpoint wraps.
MIN_BLOCK_NODES = 2
#: Least share of the graph's compute nodes a structural stack covers: smaller repeats (two
#: identical projections inside one layer) are not layers.
MIN_STACK_SHARE = 0.2


def node_labels(graph: CostGraph) -> np.ndarray:
    """One integer per compute node: equal for nodes with the same op and output size.

    Example:
        >>> from planner.core.costgraph import CostNode, Storage
        >>> ops = ("aten.relu.default", "aten.add.Tensor", "aten.relu.default")
        >>> g = CostGraph(tuple(CostNode(f"n{i}", op, output_bytes=8) for i, op in enumerate(ops)), ())
        >>> node_labels(g).tolist()
        [0, 1, 0]
    """
    codes: dict[tuple[str, int], int] = {}
    return np.array([codes.setdefault((n.op, n.output_bytes), len(codes)) for n in graph.compute_nodes],
                    dtype=np.int64)


def crossing_bytes(graph: CostGraph) -> np.ndarray:
    """``crossing[i]``: output bytes of compute nodes before position ``i`` (in compute order)
    read at or after it.

    Example:
        >>> from planner.core.costgraph import CostNode, Storage
        >>> nodes = (CostNode("a", "aten.relu.default", output_bytes=8),
        ...          CostNode("b", "aten.relu.default", input_names=("a",), output_bytes=4),
        ...          CostNode("c", "aten.add.Tensor", input_names=("a", "b"), output_bytes=4))
        >>> crossing_bytes(CostGraph(nodes, ())).tolist()
        [0, 8, 12, 0]
    """
    position = {n.name: i for i, n in enumerate(graph.compute_nodes)}
    last_read = {i: i for i in range(len(position))}
    for i, node in enumerate(graph.compute_nodes):
        for name in node.input_names:
            j = position.get(name)
            if j is not None:
                last_read[j] = max(last_read[j], i)
    change = np.zeros(len(position) + 1, dtype=np.int64)
    for j, last in last_read.items():
        if last > j:  # live across the boundaries j+1 .. last
            change[j + 1] += graph.compute_nodes[j].output_bytes
            change[last + 1] -= graph.compute_nodes[j].output_bytes
    return np.cumsum(change)


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in ``mask``; (0, 0) when none."""
    if not mask.any():
        return 0, 0
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[0::2], edges[1::2]
    best = int(np.argmax(ends - starts))
    return int(starts[best]), int(ends[best] - starts[best])


def _best_repeat(labels: np.ndarray) -> tuple[int, int, int] | None:
    """(start, period, span) of the tandem repeat covering the most of ``labels``: the labels
    from ``start`` repeat with ``period`` for ``span`` positions (at least two periods)."""
    best: tuple[int, int, int] | None = None
    best_cover = 0
    for period in range(MIN_BLOCK_NODES, len(labels) // 2 + 1):
        start, length = _longest_run(labels[:-period] == labels[period:])
        copies = (length + period) // period
        # the shortest period of the widest cover: a layer, not two layers
        if copies >= 2 and copies * period > best_cover:
            best, best_cover = (start, period, length + period), copies * period
    return best


def _stacks_in(labels: np.ndarray, crossing: np.ndarray, offset: int, min_cover: int) -> list[tuple[int, int, int]]:
    """(first node, period, copies) of each stack in ``labels`` (positions from ``offset``), in order."""
    found = _best_repeat(labels)
    if found is None or found[2] - found[2] % found[1] < min_cover:
        return []
    start, period, span = found
    # the phase whose boundary carries the fewest bytes: where a hand-placed checkpoint cuts
    phases = [(int(crossing[offset + start + phase]), phase) for phase in range(period)]
    phase = min(phases)[1]
    first = start + phase
    copies = (start + span - first) // period
    end = first + period * copies
    if copies < 2:
        return []
    return (_stacks_in(labels[:first], crossing, offset, min_cover) + [(offset + first, period, copies)]
            + _stacks_in(labels[end:], crossing, offset + end, min_cover))


def structural_blocks(graph: CostGraph) -> list[list[tuple[str, ...]]]:
    """The graph's stacks of repeated blocks, found from the sequence of its compute nodes' ops
    and output sizes; each stack is a list of blocks of node names, in graph order."""
    nodes = graph.compute_nodes
    if len(nodes) < 2 * MIN_BLOCK_NODES:
        return []
    labels = node_labels(graph)
    min_cover = max(2 * MIN_BLOCK_NODES, int(MIN_STACK_SHARE * len(nodes)))
    stacks = _stacks_in(labels, crossing_bytes(graph), 0, min_cover)
    return [[tuple(n.name for n in nodes[first + k * period:first + (k + 1) * period]) for k in range(copies)]
            for first, period, copies in stacks]
