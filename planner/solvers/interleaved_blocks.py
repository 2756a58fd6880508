"""A layer written as a loop body over several module lists, found as one block.

A model can keep each layer's parts in lists of their own and run them in a loop::

    for i in range(n):
        x = x + drop(proj[i](gelu(enc[i](ln[i](x)))))

Its module paths show three stacks (``ln``, ``enc``, ``proj``), where a person checkpoints one
function per iteration. :func:`merge_interleaved` finds the stacks whose i-th members run
together (the i-th members of all of them run after every (i-1)-th member and before every
(i+1)-th) and merges them into one stack whose i-th block is the whole loop body: every node
from the first of the i-th members to the last, the glue between them included (the GELU, the
dropout, the residual add), and the nodes between two iterations given to one side or the other
where the fewest bytes cross, as the loop's own boundary is (only ``x`` is live there).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes, last = [CostNode("x", "placeholder", kind="input", output_storages=(0,))], "x"
    >>> for i in range(3):   # x = x + gelu(enc[i](ln[i](x)))
    ...     for op, module in (("layer_norm", f"ln.{i}"), ("linear", f"enc.{i}"), ("gelu", ""), ("add", "")):
    ...         inputs = (nodes[-1].name, last) if op == "add" else (nodes[-1].name,)
    ...         nodes.append(CostNode(f"{op}_{i}", f"aten.{op}.default", input_names=inputs,
    ...                               output_storages=(len(nodes),), output_bytes=8, module=module))
    ...     last = nodes[-1].name
    >>> g = CostGraph(tuple(nodes), tuple(Storage(k, 8, k == 0) for k in range(len(nodes))))
    >>> stacks = [[(f"layer_norm_{i}",) for i in range(3)], [(f"linear_{i}",) for i in range(3)]]
    >>> [block[-1] for block in merge_interleaved(g, stacks)[0]]
    ['add_0', 'add_1', 'add_2']
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.core.costgraph import CostGraph
from planner.solvers.block_structure import crossing_bytes, node_labels

__all__ = ["merge_interleaved", "interleaved_groups"]

Stack = Sequence[Sequence[str]]
Span = tuple[int, int]


def _spans(position: dict[str, int], stack: Stack) -> list[Span]:
    """(first, last) compute position of each block of ``stack``."""
    return [(min(position[n] for n in block), max(position[n] for n in block)) for block in stack]


def _run_together(spans: Sequence[Sequence[Span]]) -> bool:
    """Whether stacks of these block spans run as one loop: every i-th block of each ends before
    every (i+1)-th block of each starts."""
    return all(max(s[i][1] for s in spans) < min(s[i + 1][0] for s in spans) for i in range(len(spans[0]) - 1))


def interleaved_groups(graph: CostGraph, stacks: Sequence[Stack]) -> list[list[int]]:
    """Indices of ``stacks`` grouped by the loop they run in: stacks with as many blocks, whose
    i-th blocks all run between their (i-1)-th and (i+1)-th ones, share a group; every other
    stack is a group of its own. Groups are in the order of their first stack.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph(tuple(CostNode(n, "aten.relu.default") for n in "abcdef"), ())
        >>> interleaved_groups(g, [[("a",), ("c",)], [("b",), ("d",)], [("e",), ("f",)]])
        [[0, 1], [2]]
    """
    position = {n.name: i for i, n in enumerate(graph.compute_nodes)}
    spans = [_spans(position, stack) for stack in stacks]
    groups: list[list[int]] = []
    for index in sorted(range(len(stacks)), key=lambda k: spans[k][0][0] if spans[k] else 0):
        joined = next((group for group in groups if len(spans[group[0]]) == len(spans[index]) >= 2
                       and _run_together([spans[k] for k in (*group, index)])), None)
        if joined is None:
            groups.append([index])
        else:
            joined.append(index)
    return groups


def _cut(crossing: np.ndarray, low: int, high: int) -> int:
    """The position in ``low .. high`` where the fewest bytes cross; the latest of equal ones, so
    the glue after an iteration's last listed module (its residual add) stays in that iteration."""
    window = crossing[low:high + 1][::-1]
    return high - int(np.argmin(window))


def _matching(labels: np.ndarray, template: Sequence[int], candidates: Sequence[int]) -> int:
    """How many of ``candidates`` (positions, in order) carry the labels of ``template``'s
    positions, counted from the first until one differs or leaves the graph."""
    count = 0
    for want, at in zip(template, candidates):
        if not 0 <= at < len(labels) or labels[at] != labels[want]:
            break
        count += 1
    return count


def _loop_bodies(graph: CostGraph, spans: Sequence[Span]) -> list[range]:
    """Compute positions of each iteration: consecutive iterations meet at the position of least
    crossing bytes between them, and the first and last take the glue the middle ones have on
    that side (the nodes before the first listed module, after the last)."""
    crossing = crossing_bytes(graph)
    labels = node_labels(graph)
    cuts = [_cut(crossing, spans[i - 1][1] + 1, spans[i][0]) for i in range(1, len(spans))]
    # glue of the second iteration before its first listed module, matched backwards before the first's
    lead = range(spans[1][0] - 1, cuts[0] - 1, -1)
    head = _matching(labels, lead, [spans[0][0] - 1 - k for k in range(len(lead))])
    # glue of the next-to-last iteration after its last listed module, matched after the last's
    trail = range(spans[-2][1] + 1, cuts[-1])
    tail = _matching(labels, trail, [spans[-1][1] + 1 + k for k in range(len(trail))])
    starts = [spans[0][0] - head, *cuts]
    ends = [*cuts, spans[-1][1] + 1 + tail]
    return [range(start, end) for start, end in zip(starts, ends)]


def merge_interleaved(graph: CostGraph, stacks: Sequence[Stack]) -> list[list[tuple[str, ...]]]:
    """``stacks`` (each a list of blocks of node names, as the module paths give them) with each
    group of :func:`interleaved_groups` merged into one stack of loop bodies (the module's
    docstring says how they are cut). A stack outside every group whose nodes fall inside a
    merged block is left out: the loop body already holds them. Stacks are in the order their
    first node runs."""
    position = {n.name: i for i, n in enumerate(graph.compute_nodes)}
    names = [n.name for n in graph.compute_nodes]
    merged: list[list[tuple[str, ...]]] = []
    single: list[list[tuple[str, ...]]] = []
    for group in interleaved_groups(graph, stacks):
        if len(group) == 1:
            single.append([tuple(block) for block in stacks[group[0]]])
            continue
        spans = [_spans(position, stacks[k]) for k in group]
        joint = [(min(s[i][0] for s in spans), max(s[i][1] for s in spans)) for i in range(len(spans[0]))]
        merged.append([tuple(names[p] for p in body) for body in _loop_bodies(graph, joint)])
    inside = {name for stack in merged for block in stack for name in block}
    kept = merged + [stack for stack in single if inside.isdisjoint(n for block in stack for n in block)]
    return sorted(kept, key=lambda stack: position[stack[0][0]])
