"""Op-level keep decisions: which nodes inside recomputed segments keep their outputs.

A recomputed segment normally re-runs every node in its backward. Under a selective
checkpoint policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) a node of
the segment can instead keep what it produced from the forward: it is not re-run, and its
outputs (and what autograd saved inside it) stay allocated from the forward until the
segment's recompute. :func:`keep_outputs` makes that choice per node, as a knapsack judged by
the simulator: nodes are tried in order of measured time saved per byte held (expensive
matmuls before cheap pointwise ops with large outputs), and each is kept when the replayed
peak still fits the budget. Only nodes the profiler marked ``selective_save`` are candidates:
views and in-place ops (keeping a view holds its base; they cost no time), ops that write
their own intermediates in place (the policy's cache refuses them) and random ops (skipping
one in the recompute would shift the random numbers of the ops after it). Nodes after a segment's last
node that saves something for backward are not candidates either: the recompute stops before
them, so they never re-run.

The result never recomputes more than its input: the segments are the same, only nodes are
taken out of the recompute.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i, (ms, mib) in enumerate([(8.0, 1), (1.0, 4)] * 3, start=1):  # slow-small, fast-large
    ...     nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=mib * 2**20, requires_grad=True,
    ...                           time_ms=ms, selective_save=True))
    >>> g = CostGraph(tuple(nodes), (Storage(0, 2**20, True), *(Storage(i, n.output_bytes)
    ...               for i, n in enumerate(nodes) if i)), ("n6",))
    >>> segments = [Segment(("n1", "n2"), 9.0, 0), Segment(("n3", "n4"), 9.0, 0)]
    >>> from planner.core.simulate import simulate
    >>> simulate(g).peak_bytes // 2**20, simulate(g, segments).peak_bytes // 2**20
    (21, 19)
    >>> kept = keep_outputs(g, segments, budget_bytes=20 * 2**20)
    >>> [s.kept_nodes for s in kept], sum(s.recompute_ms for s in kept)  # n2, n4 end their segments
    ([('n1',), ('n3',)], 2.0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from planner.core.costgraph import CostGraph
from planner.core.plan import Segment
from planner.solvers.refine import GUARD_FACTOR, replay_budget
from planner.core.rerun import rerun_cost, skipped_node_names
from planner.core.simulate import fits_budget

__all__ = ["keep_outputs", "keepable_in_segment", "kept_storages", "policy_ms", "segment_with_kept"]

log = logging.getLogger(__name__)

#: nodes faster than this share of the recomputed time are not worth a keep decision
MIN_TIME_SHARE = 1e-4


def policy_ms(graph: CostGraph, node_names: Sequence[str]) -> float:
    """What running ``node_names`` under a selective checkpoint policy costs in itself
    (``graph.selective_overhead_ms_per_node`` on each node).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("a", "op"),), (), selective_overhead_ms_per_node=0.5)
        >>> policy_ms(g, ("a",))
        0.5
    """
    return graph.selective_overhead_ms_per_node * len(node_names)


def segment_with_kept(graph: CostGraph, node_names: Sequence[str],
                      kept: set[str] | frozenset[str] = frozenset()) -> Segment:
    """A segment over ``node_names`` keeping the outputs of ``kept``; its cost counts what its
    recompute reruns (:func:`planner.core.rerun.rerun_cost`: not the kept nodes, not what follows
    the last saved tensor) and, when it keeps anything, the selective policy's cost on each of
    its nodes (``graph.selective_overhead_ms_per_node``).

    Example:
        >>> import dataclasses
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", time_ms=2.0, flops=10, output_storages=(0,)),
        ...                CostNode("b", "op", time_ms=1.0, output_storages=(1,), saved_storages=(1,))),
        ...               (Storage(0, 8), Storage(1, 8)))
        >>> segment_with_kept(g, ("a", "b"), {"a"})
        Segment(node_names=('a', 'b'), recompute_ms=1.0, recompute_flops=0, kept_nodes=('a',), skipped_nodes=())
        >>> g = dataclasses.replace(g, selective_overhead_ms_per_node=0.25)
        >>> segment_with_kept(g, ("a", "b"), {"a"}).recompute_ms  # 1 ms re-run, 2 nodes x 0.25 ms
        1.5
    """
    kept_names = tuple(name for name in node_names if name in kept)
    skipped = skipped_node_names(graph, node_names, kept_names)
    time_ms, flops = rerun_cost(graph, node_names, kept_names)
    policy_cost_ms = policy_ms(graph, node_names) if kept_names else 0.0
    return Segment(tuple(node_names), time_ms + policy_cost_ms, flops, kept_names, skipped)


def keepable_in_segment(graph: CostGraph, node_names: Sequence[str]) -> list[str]:
    """The nodes of a segment over ``node_names`` a selective policy may keep: those the
    profiler marked ``selective_save``, before the segment's last node that saves something
    for backward. The recompute stops after that node, so later ones never re-run; the node
    itself is not kept either: kept, its output cache outlives the recompute, above what the
    replay counts (docs/tuning.md#keepable_in_segment).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", saved_storages=(1,), selective_save=True),
        ...                CostNode("b", "op", saved_storages=(2,), selective_save=True),
        ...                CostNode("c", "op", selective_save=True)), (Storage(1, 8), Storage(2, 8)))
        >>> keepable_in_segment(g, ("a", "b", "c"))
        ['a']
    """
    members = [graph.nodes[graph.index[name]] for name in node_names]
    last_saving = max((i for i, n in enumerate(members) if n.saved_storages), default=-1)
    return [n.name for n in members[:max(last_saving, 0)] if n.selective_save]


def kept_storages(graph: CostGraph, name: str) -> set[int]:
    """The storages keeping node ``name``'s outputs holds from its forward until the segment's
    recompute, as :func:`planner.core.simulate.simulate` counts them: what the node allocates
    (outputs, and what it saves that its inputs did not produce) and the input storages its
    ops returned views of.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("a", "op", input_names=("x",), output_storages=(1,)),
        ...                CostNode("mm", "op", input_names=("a",), output_storages=(2,), saved_storages=(1,))),
        ...               (Storage(0, 8, True), Storage(1, 8), Storage(2, 8)))
        >>> kept_storages(g, "mm")  # its saved input is held by whoever made it
        {2}
    """
    node = graph.node(name)
    sizes = graph.storage_by_key
    inputs = {k for i in node.input_names for k in graph.node(i).output_storages}
    made = set(node.output_storages) | (set(node.saved_storages) - inputs)
    return {k for k in made | set(node.viewed_storages) if not sizes[k].persistent}


def _candidates(graph: CostGraph, segments: Sequence[Segment]) -> list[tuple[int, str]]:
    """``(segment index, node name)`` of nodes worth keeping, most time saved per byte first;
    none from a segment where keeping every candidate would save less than the policy costs."""
    sizes = graph.storage_by_key
    total_ms = sum(s.recompute_ms for s in segments) or 1.0
    scored: list[tuple[float, int, str]] = []
    for s, seg in enumerate(segments):
        keepable = keepable_in_segment(graph, seg.node_names)
        saves_at_most_ms = sum(graph.node(n).time_ms for n in keepable)
        if not seg.kept_nodes and saves_at_most_ms <= policy_ms(graph, seg.node_names):
            continue
        for name in keepable:
            node = graph.nodes[graph.index[name]]
            if name in seg.kept_nodes or node.time_ms < MIN_TIME_SHARE * total_ms:
                continue
            held_bytes = sum(sizes[k].size_bytes for k in kept_storages(graph, name))
            scored.append((node.time_ms / max(held_bytes, 1), s, name))
    scored.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [(s, name) for _, s, name in scored]


def keep_outputs(
    graph: CostGraph,
    segments: Sequence[Segment],
    budget_bytes: int,
    *,
    time_limit_s: float = 5.0,
) -> list[Segment]:
    """``segments`` with the nodes whose outputs are worth keeping marked as kept.

    Candidates are tried in order of measured forward time per byte they would hold. Runs of
    candidates are added at once while the replayed peak fits (doubling the run), and halved
    when it does not, so a graph with thousands of candidates needs few replays; a single
    candidate that does not fit is skipped. Stops with what it has after the replays
    ``time_limit_s`` buys (:func:`planner.solvers.refine.replay_budget`, the same on every machine) or
    at a wall-clock guard of twice ``time_limit_s``.
    The returned plan's simulated peak is at most ``budget_bytes`` whenever the input's is.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("a", "op", input_names=("x",), output_storages=(1,), saved_storages=(1,),
        ...                         output_bytes=100, requires_grad=True, time_ms=5.0, selective_save=True),
        ...                CostNode("b", "op", input_names=("a",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=100, requires_grad=True, time_ms=1.0, selective_save=True)),
        ...               (Storage(0, 100, True), Storage(1, 100), Storage(2, 100)), ("b",))
        >>> keep_outputs(g, [Segment(("a", "b"), 6.0, 0)], budget_bytes=10**6)[0].kept_nodes
        ('a',)
    """
    started = time.perf_counter()
    segments = list(segments)
    if not segments:
        return segments
    kept = [set(seg.kept_nodes) for seg in segments]

    def build() -> list[Segment]:
        return [segment_with_kept(graph, seg.node_names, k) for seg, k in zip(segments, kept)]

    def fits() -> bool:
        return fits_budget(graph, build(), budget_bytes)

    order = _candidates(graph, segments)
    position, run, replays = 0, 1, 0
    max_replays = replay_budget(graph, time_limit_s)
    deadline = started + GUARD_FACTOR * time_limit_s
    while position < len(order) and replays < max_replays and time.perf_counter() < deadline:
        chunk = order[position : position + run]
        for s, name in chunk:
            kept[s].add(name)
        replays += 1
        if fits():
            position += len(chunk)
            run *= 2
            continue
        for s, name in chunk:
            kept[s].discard(name)
        if run == 1:
            position += 1  # this one does not fit; later, smaller ones may
        run = max(1, run // 2)
    result = build()
    if not fits():  # only when the input itself did not fit: hand it back unchanged
        return list(segments)
    result = _drop_unprofitable_keeps(graph, result, budget_bytes)
    log.info("kept %d node outputs in %d segments (%d replays, %.2f s): recompute %.1f -> %.1f ms",
             sum(len(s.kept_nodes) for s in result), len(segments), replays, time.perf_counter() - started,
             sum(s.recompute_ms for s in segments), sum(s.recompute_ms for s in result))
    return result


def _drop_unprofitable_keeps(graph: CostGraph, segments: list[Segment], budget_bytes: int) -> list[Segment]:
    """``segments`` with the kept outputs dropped from each segment whose keeping saves less
    than its selective policy costs (dropped only while the replayed peak still fits)."""
    out = list(segments)
    for i, seg in enumerate(segments):
        if not seg.kept_nodes:
            continue
        plain = segment_with_kept(graph, seg.node_names, set())
        if plain.recompute_ms > seg.recompute_ms:
            continue
        trial = [*out[:i], plain, *out[i + 1:]]
        if fits_budget(graph, trial, budget_bytes):
            out = trial
            cost_ms = policy_ms(graph, seg.node_names)
            log.info("segment %d: kept outputs save %.2f ms, the selective policy costs %.2f ms: recomputed instead",
                     i, plain.recompute_ms - seg.recompute_ms + cost_ms, cost_ms)
    return out
