"""A lower bound on the recompute time any plan needs to fit a budget: how far from optimal a
plan can be, and whether a target overhead is reachable at all on the profiled times.

Take a moment of the unoptimized step (a node's forward or backward) where the simulator's
live bytes exceed the budget. A plan changes nothing at that moment but the storages saved for
backward by nodes that already ran their forward and not yet their backward. Such a storage is
gone only if the node that made it runs again in a recompute (a storage the recompute does not
remake is an input of its segment, held until that segment's backward). The recompute pays for
that node in full, or, when the node saves the storage itself, at least for the part of it
before its last save (:mod:`planner.rerun`: a recompute stops there). So a plan that fits must
rerun makers of saved storages adding up to at least ``live - budget_bytes`` there. Allowing
fractions of nodes (a fractional knapsack, cheapest time per byte first) can only lower the
needed time; the largest of these over the moments is a lower bound on the recompute time of
any plan, by the plan's own account.

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
from planner.rerun import after_last_save_time_fraction
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
    maker: dict[int, str] = {}  # storage -> the node that made it (first to output or save it)
    savers: dict[int, list[str]] = {}
    for node in graph.nodes:
        for k in (*node.output_storages, *node.saved_storages):
            maker.setdefault(k, node.name)
        for k in set(node.saved_storages):
            savers.setdefault(k, []).append(node.name)
    # (first saver's position, maker, bytes) of every saved storage a plan could free
    freeable: list[tuple[int, str, int]] = []
    for k, names in savers.items():
        made_by = graph.node(maker[k])
        if sizes[k].persistent or k in returned or made_by.kind != "compute" or not made_by.recomputable:
            continue
        if all(graph.node(n).recomputable for n in names):
            freeable.append((min(position[n] for n in names), made_by.name, sizes[k].size_bytes))
    saves_own = {name for k, names in savers.items() for name in names if maker.get(k) == name}
    least_ms = {}
    for name in {m for _, m, _ in freeable}:
        node = graph.node(name)
        share = 1.0 - after_last_save_time_fraction(graph, node) if name in saves_own else 1.0
        least_ms[name] = node.time_ms * share
    moments = sorted((m for m in unoptimized.timeline if m[2] > budget_bytes), key=lambda m: -m[2])[:max_moments]
    bound = 0.0
    for phase, name, live_bytes in moments:
        # saved storages held at this moment: those first saved by nodes up to this one
        # (forward: already run; backward: backward not yet finished)
        here = position[name]
        freed_by: dict[str, int] = {}
        for first, made_by, size in freeable:
            if first <= here:
                freed_by[made_by] = freed_by.get(made_by, 0) + size
        options = [(least_ms[m] / freed, least_ms[m], freed) for m, freed in freed_by.items()]
        bound = max(bound, _knapsack_ms(options, live_bytes - budget_bytes))
    return bound
