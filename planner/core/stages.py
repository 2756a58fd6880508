"""Reduce a CostGraph to a chain of stages the solver can handle.

A stage is a contiguous run of compute nodes. Cuts go where few activation bytes cross
(between transformer sub-layers, on the residual stream), so a checkpointed segment made of
whole stages keeps little as its inputs. Nodes that must not be recomputed get a stage of
their own, marked ``recomputable=False``.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=8,
    ...                           requires_grad=True))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 8, i == 0) for i in range(7)), ("n6",))
    >>> [s.node_names for s in build_stages(g, max_stages=3)]
    [('n1', 'n2'), ('n3', 'n4'), ('n5', 'n6')]
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from planner.core.costgraph import CostGraph

__all__ = ["Stage", "build_stages", "crossing_bytes"]


@dataclass(frozen=True)
class Stage:
    """A contiguous run of compute nodes, by name, and whether all of them may be recomputed."""

    node_names: tuple[str, ...]
    recomputable: bool


def crossing_bytes(graph: CostGraph) -> list[int]:
    """For each compute-node position p, bytes of activations made before p and read at or after p."""
    compute = [i for i, n in enumerate(graph.nodes) if n.kind == "compute"]
    sizes = graph.storage_by_key
    value_storages = {
        n.name: [k for k in n.output_storages if not sizes[k].persistent] for n in graph.nodes
    }
    first_rank: dict[int, int] = {}
    last_rank: dict[int, int] = {}
    for r, i in enumerate(compute):
        node = graph.nodes[i]
        for k in value_storages[node.name]:
            first_rank.setdefault(k, r)
            last_rank[k] = max(last_rank.get(k, r), r)
        for name in node.input_names:
            for k in value_storages[name]:
                last_rank[k] = max(last_rank.get(k, r), r)
    for name in graph.output_names:
        for k in value_storages[name]:
            last_rank[k] = len(compute)
    delta = [0] * (len(compute) + 2)
    for k, start in first_rank.items():
        # live across the cut before position p for start < p <= last
        delta[start + 1] += sizes[k].size_bytes
        delta[last_rank[k] + 1] -= sizes[k].size_bytes
    out, running = [], 0
    for p in range(len(compute)):
        running += delta[p]
        out.append(running)
    return out


def build_stages(graph: CostGraph, max_stages: int, required_cuts: Collection[int] = ()) -> list[Stage]:
    """Split the compute nodes into at most about ``max_stages`` stages at low-crossing cuts,
    plus a cut before each compute-node position in ``required_cuts`` (the boundaries of a
    plan that must stay expressible)."""
    compute = [n for n in graph.nodes if n.kind == "compute"]
    if not compute:
        return []
    count = len(compute)
    crossing = crossing_bytes(graph)
    cuts: set[int] = set()
    target = count / max(max_stages, 1)
    if max_stages >= count:
        cuts = set(range(1, count))
    else:
        half = max(1, int(target / 2))
        for k in range(1, max_stages):
            centre = round(k * target)
            window = range(max(1, centre - half), min(count, centre + half + 1))
            best = min(window, key=lambda p: (crossing[p], abs(p - centre)))
            cuts.add(best)
    cuts.update(required_cuts)
    for r, node in enumerate(compute):
        if not node.recomputable:
            cuts.update((r, r + 1))
    bounds = sorted(c for c in cuts if 0 < c < count)
    stages: list[Stage] = []
    start = 0
    for end in [*bounds, count]:
        if end <= start:
            continue
        members = compute[start:end]
        stages.append(Stage(tuple(n.name for n in members), all(n.recomputable for n in members)))
        start = end
    return stages
