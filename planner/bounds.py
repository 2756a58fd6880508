"""A lower bound on the recompute time any plan needs to fit a budget: how far from optimal a
plan can be, and whether a target overhead is reachable at all on the profiled times.

Take a moment of the unoptimized step (a node's forward or backward) where the simulator's
live bytes exceed the budget. A plan changes nothing at that moment but the storages saved for
backward by nodes that already ran their forward and not yet their backward: such a storage is
gone only if every node that saved it is recomputed (and not kept). So a plan that fits must
recompute nodes whose saved storages add up to at least ``live - budget_bytes`` there.
Crediting each node with all the storages it saves (even those other nodes also save) and
allowing fractions of nodes (a fractional knapsack, cheapest time per byte first) can only lower
the needed time; the largest of these over the moments is a lower bound on the forward time of
the recomputed nodes of any plan, by the simulator's account.

Example:
    >>> from planner.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i, ms in enumerate([4.0, 1.0, 2.0], start=1):
    ...     nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=100, requires_grad=True, time_ms=ms))
    >>> g = CostGraph(tuple(nodes), (Storage(0, 100, True), *(Storage(i, 100) for i in (1, 2, 3))), ("n3",))
    >>> simulate(g).peak_bytes  # at n3's backward: n3's gradient and n2's next to it
    600
    >>> recompute_lower_bound_ms(g, 450)  # 150 bytes to free: n2 (1 ms) and half of n1 (2 ms)
    3.0
"""

from __future__ import annotations

from planner.costgraph import CostGraph
from planner.simulate import simulate

__all__ = ["recompute_lower_bound_ms"]


def _returned_storages(graph: CostGraph) -> set[int]:
    persistent = {s.key for s in graph.storages if s.persistent}
    return {k for name in graph.output_names for k in graph.node(name).output_storages} - persistent


def _knapsack_ms(options: list[tuple[float, float, int]], needed_bytes: int) -> float:
    """Least time to free ``needed_bytes`` from ``(ms per byte, ms, bytes)`` options, fractions
    allowed; ``inf`` when they cannot."""
    total_ms = 0.0
    for _, time_ms, freed in sorted(options):
        if freed >= needed_bytes:
            return total_ms + time_ms * needed_bytes / freed
        total_ms += time_ms
        needed_bytes -= freed
    return float("inf")


def recompute_lower_bound_ms(graph: CostGraph, budget_bytes: int, *, max_moments: int = 64) -> float:
    """The least forward time (ms) of recomputed nodes that any plan fitting ``budget_bytes``
    needs, by the bound in the module docstring, over the ``max_moments`` moments of the
    unoptimized step with the most live bytes (more moments can only raise it); ``inf`` when
    the budget is infeasible by this account, 0 when nothing has to be freed.

    Example:
        >>> from planner.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 64, True),))
        >>> recompute_lower_bound_ms(g, 64), recompute_lower_bound_ms(g, 63)
        (0.0, inf)
    """
    sizes = graph.storage_by_key
    returned = _returned_storages(graph)
    unoptimized = simulate(graph)
    if unoptimized.peak_bytes <= budget_bytes:
        return 0.0
    if not any(n.kind == "compute" for n in graph.nodes):
        return float("inf")
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    credit: list[tuple[int, float, int]] = []  # (position, ms, bytes it could free)
    for node in graph.compute_nodes:
        freed = sum(sizes[k].size_bytes for k in set(node.saved_storages)
                    if not sizes[k].persistent and k not in returned)
        if node.recomputable and freed > 0:
            credit.append((position[node.name], node.time_ms, freed))
    moments = sorted((m for m in unoptimized.timeline if m[2] > budget_bytes), key=lambda m: -m[2])[:max_moments]
    bound = 0.0
    for phase, name, live_bytes in moments:
        # saved storages held at this moment: those of nodes up to this one (forward: already
        # run; backward: backward not yet finished)
        here = position[name]
        options = [(ms / freed, ms, freed) for pos, ms, freed in credit if pos <= here]
        bound = max(bound, _knapsack_ms(options, live_bytes - budget_bytes))
    return bound
