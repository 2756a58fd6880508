"""The plans a person writes by hand, as candidates every solve must match or beat.

A user who does not run this tool checkpoints every layer (HuggingFace's
``gradient_checkpointing_enable()``), every k-th layer (Chen et al.'s sqrt(n) spacing), or keeps
the matmul outputs inside each checkpointed layer and recomputes the rest (the selective policy
of torchtitan and Megatron). :func:`hand_placed_plans` builds those plans on a profiled graph,
on every way the graph shows to split it into repeated blocks (:func:`block_decompositions`:
module paths, module lists run as one loop body, structure), so the solver can take them as
candidates: the plan it returns never costs more than one of them that fits the budget.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):   # three layers of two ops each
    ...     nodes.append(CostNode(f"n{i}", "aten.relu.default", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0, module=f"layers.{(i - 1) // 2}"))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
    >>> [len(stack) for stack in repeated_blocks(g)]
    [3]
    >>> [(p.name, len(p.segments)) for p in hand_placed_plans(g)][:2]
    [('every layer', 3), ('every 2nd layer', 2)]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.costgraph import CostGraph
from planner.core.matmul_ops import SAVED_MATMUL_OPS
from planner.core.plan import Plan, Segment
from planner.core.simulate import fits_budget, simulate
from planner.solvers.block_structure import structural_blocks
from planner.solvers.interleaved_blocks import merge_interleaved
from planner.solvers.keep import segment_with_kept
from planner.solvers.stage_plans import to_plan

__all__ = ["HandPlan", "repeated_blocks", "block_decompositions", "hand_placed_plans", "hand_placed_candidate",
           "cheaper_hand_plans", "hand_placed_within_noise", "HAND_PLAN_TIME_TOLERANCE", "timing_spread",
           "EVERY_KTH_LAYER_MAX_K", "MAX_BLOCK_DECOMPOSITIONS", "HAND_PLACED", "module_list_blocks",
           "recomputable_runs", "every_kth_layer_name"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Solver label of a hand-placed candidate that no search beat.
HAND_PLACED = "hand-placed"

#: Every k-th layer for k = 1 up to this (docs/tuning.md#every_kth_layer_max_k).
EVERY_KTH_LAYER_MAX_K = 4

#: Block decompositions the hand-placed plans are built on: the module paths with interleaved
#: lists merged, the lists one stack each, the graph's structure. With two policies per k, a
#: solve replays at most 2 * EVERY_KTH_LAYER_MAX_K * MAX_BLOCK_DECOMPOSITIONS = 24 hand-placed
#: plans, one replay each (docs/tuning.md#max_block_decompositions).
MAX_BLOCK_DECOMPOSITIONS = 3

@dataclass(frozen=True)
class HandPlan:
    """A hand-placed policy on one graph: its name and the segments it recomputes."""

    name: str
    segments: tuple[Segment, ...]

    @property
    def recompute_ms(self) -> float:
        return sum(s.recompute_ms for s in self.segments)


def _outer_block(module: str) -> tuple[str, int] | None:
    """``("transformer.h", 3)`` for ``transformer.h.3.attn.c_attn``: the module path up to its
    first numeric part, and that number; ``None`` for a path without one."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def module_list_blocks(graph: CostGraph) -> list[list[tuple[str, tuple[str, ...]]]]:
    """Each module list (``transformer.h``, ``encoder.block``, ``blocks``) with two or more
    indexed children, as its children in index order: each child's module path and its compute
    nodes in graph order; lists in the order their first node runs, a node inside a nested list
    (``layers.0.experts.1``) in its outermost block.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph(tuple(CostNode(f"n{i}", "aten.relu.default", module=f"h.{i // 2}.mlp") for i in range(4)), ())
        >>> module_list_blocks(g)
        [[('h.0', ('n0', 'n1')), ('h.1', ('n2', 'n3'))]]
    """
    stacks: dict[str, dict[int, list[str]]] = {}
    for node in graph.compute_nodes:
        found = _outer_block(node.module)
        if found is not None:
            stacks.setdefault(found[0], {}).setdefault(found[1], []).append(node.name)
    return [[(f"{path}.{i}", tuple(blocks[i])) for i in sorted(blocks)]
            for path, blocks in stacks.items() if len(blocks) >= 2]


def _module_path_stacks(graph: CostGraph) -> list[list[tuple[str, ...]]]:
    """:func:`module_list_blocks` without the paths: each stack as its blocks' compute nodes."""
    return [[names for _, names in stack] for stack in module_list_blocks(graph)]


def repeated_blocks(graph: CostGraph) -> list[list[tuple[str, ...]]]:
    """The graph's stacks of repeated blocks as a person checkpoints them: each module list with
    two or more indexed children is a stack and each child's compute nodes a block, except that
    lists run as one loop body (``ln[i]``, ``enc[i]``, ``proj[i]`` in iteration ``i``) make one
    stack of whole iterations (:func:`planner.solvers.interleaved_blocks.merge_interleaved`).
    A graph without such paths gets the stacks its structure shows
    (:func:`planner.solvers.block_structure.structural_blocks`). The first of
    :func:`block_decompositions`.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph(tuple(CostNode(f"n{i}", "aten.relu.default", module=f"{('ln', 'enc')[i % 2]}.{i // 2}")
        ...                     for i in range(4)), ())
        >>> repeated_blocks(g)
        [[('n0', 'n1'), ('n2', 'n3')]]
    """
    by_path = _module_path_stacks(graph)
    return merge_interleaved(graph, by_path) if by_path else structural_blocks(graph)


def block_decompositions(graph: CostGraph) -> list[tuple[str, list[list[tuple[str, ...]]]]]:
    """Each distinct way the graph splits into repeated blocks, labelled, at most
    :data:`MAX_BLOCK_DECOMPOSITIONS`: first :func:`repeated_blocks` (label ``""``), then the
    module lists one stack each where lists were merged (``" (module lists)"``), then the stacks
    of the graph's structure (``" (structure)"``). A person may write any of them; decompositions
    with the same blocks, and empty ones, appear once.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph(tuple(CostNode(f"n{i}", "aten.relu.default", module=f"{('ln', 'enc')[i % 2]}.{i // 2}")
        ...                     for i in range(4)), ())
        >>> [(label, [len(stack) for stack in stacks]) for label, stacks in block_decompositions(g)]
        [('', [2]), (' (module lists)', [2, 2])]
    """
    by_path = _module_path_stacks(graph)
    candidates = [("", merge_interleaved(graph, by_path) if by_path else []), (" (module lists)", by_path),
                  (" (structure)", structural_blocks(graph))]
    found: dict[tuple[tuple[tuple[str, ...], ...], ...], tuple[str, list[list[tuple[str, ...]]]]] = {}
    for label, stacks in candidates:
        key = tuple(tuple(stack) for stack in stacks)
        if stacks and key not in found:
            found[key] = (label if found else "", stacks)  # the first gets the plain names
    return list(found.values())[:MAX_BLOCK_DECOMPOSITIONS]


def recomputable_runs(graph: CostGraph, blocks: Sequence[Sequence[str]]) -> list[list[tuple[str, ...]]]:
    """Each block's recomputable nodes as maximal runs that are contiguous in the graph's compute
    order (a segment must be one): a node outside the block or one that must run once ends a
    run. One pass over the graph for all blocks.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph(tuple(CostNode(f"n{i}", "aten.relu.default", recomputable=i != 1) for i in range(4)), ())
        >>> recomputable_runs(g, [("n0", "n1", "n2"), ("n3",)])
        [[('n0',), ('n2',)], [('n3',)]]
    """
    owner = {name: index for index, block in enumerate(blocks) for name in block}
    runs: list[list[tuple[str, ...]]] = [[] for _ in blocks]
    current: list[str] = []
    current_owner = -1
    for node in graph.compute_nodes:
        index = owner.get(node.name, -1) if node.recomputable else -1
        if current and index != current_owner:
            runs[current_owner].append(tuple(current))
            current = []
        if index >= 0:
            current.append(node.name)
        current_owner = index
    if current:
        runs[current_owner].append(tuple(current))
    return runs


def every_kth_layer_name(k: int) -> str:
    """What a person calls checkpointing every ``k``-th layer.

    Example:
        >>> [every_kth_layer_name(k) for k in (1, 2, 4)]
        ['every layer', 'every 2nd layer', 'every 4th layer']
    """
    return f"every {({1: '', 2: '2nd ', 3: '3rd '}.get(k, f'{k}th '))}layer"


def _every_kth_plans(graph: CostGraph, stacks: list[list[tuple[str, ...]]], max_k: int,
                     label: str) -> list[HandPlan]:
    """:func:`hand_placed_plans` on one decomposition ``stacks``, each name ending in ``label``."""
    runs_of = dict(zip((id(block) for stack in stacks for block in stack),
                       recomputable_runs(graph, [block for stack in stacks for block in stack])))
    plain: dict[tuple[str, ...], Segment] = {}
    matmul: dict[tuple[str, ...], Segment] = {}
    for run in (run for block_runs in runs_of.values() for run in block_runs):
        plain[run] = segment_with_kept(graph, run)
        matmul[run] = segment_with_kept(graph, run, {n for n in run if graph.node(n).op in SAVED_MATMUL_OPS
                                                     and graph.node(n).selective_save})
    plans: list[HandPlan] = []
    for k in range(1, max_k + 1):
        runs = [run for stack in stacks if len(stack) > k or k == 1
                for index, block in enumerate(stack) if index % k == 0 for run in runs_of[id(block)]]
        if not runs:
            continue
        name = f"{every_kth_layer_name(k)}{label}"
        plans.append(HandPlan(name, tuple(plain[run] for run in runs)))
        if any(matmul[run].kept_nodes for run in runs):
            plans.append(HandPlan(f"{name}, matmul outputs kept", tuple(matmul[run] for run in runs)))
    return plans


def hand_placed_plans(graph: CostGraph, max_k: int = EVERY_KTH_LAYER_MAX_K) -> list[HandPlan]:
    """Checkpoint every k-th block of every stack (k = 1 .. ``max_k``, as long as a stack has more
    than k blocks) and, for each, the same blocks keeping their matmul outputs
    (:data:`SAVED_MATMUL_OPS`, where a selective policy can keep them), on each of
    :func:`block_decompositions`: ``"every layer"`` on :func:`repeated_blocks`, the others named
    with their decomposition's label (``"every 2nd layer (structure)"``). A plan that recomputes
    the same segments as one before it is left out. Costs are what each recompute reruns
    (:func:`planner.solvers.keep.segment_with_kept`). No stacks: no plans."""
    plans: list[HandPlan] = []
    seen: set[tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = set()
    for label, stacks in block_decompositions(graph):
        for hand in _every_kth_plans(graph, stacks, max_k, label):
            key = tuple((s.node_names, s.kept_nodes) for s in hand.segments)
            if key not in seen:
                seen.add(key)
                plans.append(hand)
    return plans


def hand_placed_candidate(graph: CostGraph, budget_bytes: int, unoptimized: int, started: float) -> Plan | None:
    """The cheapest hand-placed plan (:func:`hand_placed_plans`) whose simulated peak fits
    ``budget_bytes``, as a plan of :func:`planner.solvers.solve.solve` begun at ``started``
    (``unoptimized``: the graph's unoptimized peak), or ``None``."""
    fitting = [hand for hand in hand_placed_plans(graph) if fits_budget(graph, hand.segments, budget_bytes)]
    if not fitting:
        return None
    best = min(fitting, key=lambda hand: hand.recompute_ms)
    log.info("hand-placed candidate: %s, %.2f ms", best.name, best.recompute_ms)
    return to_plan(graph, list(best.segments), budget_bytes, unoptimized, simulate(graph, best.segments).peak_bytes,
                    f"{HAND_PLACED}: {best.name}", time.perf_counter() - started)


#: A hand-placed plan that fits and recomputes fewer FLOPs replaces a plan predicted at most this
#: share cheaper in time (docs/tuning.md#hand_plan_time_tolerance).
HAND_PLAN_TIME_TOLERANCE = 0.1


def hand_placed_within_noise(graph: CostGraph, plan: Plan, budget_bytes: int,
                             tolerance: float = HAND_PLAN_TIME_TOLERANCE) -> Plan:
    """``plan``, or the hand-placed plan (:func:`hand_placed_plans`) that fits ``budget_bytes``,
    recomputes fewer FLOPs and is predicted at most ``tolerance`` slower (or the profile's
    measured timing spread, where larger: :func:`cheaper_hand_plans`): the fewest FLOPs of
    those, then the least time.

    Node times are measured, and a step's time swings by 10 % on a busy machine; FLOPs do not.
    A search's plan that beats every-layer by less than that noise while recomputing more FLOPs
    can step slower when measured, so within the noise the plan a person would write wins.

    Example:
        >>> from planner.core.costgraph import CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 7):   # two layers of (linear, relu, add)
        ...     op = ("aten.linear.default", "aten.relu.default", "aten.add.Tensor")[(i - 1) % 3]
        ...     nodes.append(CostNode(f"n{i}", op, input_names=(nodes[-1].name,), output_storages=(i,),
        ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True,
        ...                           time_ms=1.0, flops=10**6 if "linear" in op else 0))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
        >>> plan = hand_placed_candidate(g, 10 * 2**20, simulate(g).peak_bytes, 0.0)
        >>> hand_placed_within_noise(g, plan, 10 * 2**20) is plan   # nothing fits with fewer FLOPs
        True
    """
    better = cheaper_hand_plans(graph, plan, budget_bytes, tolerance)
    if not better:
        return plan
    best = better[0]
    log.info("hand-placed %s: %.2f ms and %d FLOPs against the search's %.2f ms and %d FLOPs, within the timing "
             "noise: the plan a person would write", best.name, best.recompute_ms,
             sum(s.recompute_flops for s in best.segments), plan.recompute_ms,
             sum(s.recompute_flops for s in plan.segments))
    return to_plan(graph, list(best.segments), budget_bytes, plan.unoptimized_peak_bytes,
                    simulate(graph, best.segments).peak_bytes, f"{HAND_PLACED}: {best.name}", plan.solve_s)


def timing_spread(graph: CostGraph) -> float:
    """How far the profile's timed passes of the step's nodes spread, (slowest - fastest) /
    median of their totals (``graph.metadata["timing_spread"]``; 0 where not measured).

    Example:
        >>> timing_spread(CostGraph((), (), metadata={"timing_spread": 0.3})), timing_spread(CostGraph((), ()))
        (0.3, 0.0)
    """
    return float(graph.metadata.get("timing_spread") or 0.0)


def cheaper_hand_plans(graph: CostGraph, plan: Plan, peak_limit_bytes: int,
                       tolerance: float = HAND_PLAN_TIME_TOLERANCE) -> list[HandPlan]:
    """The hand-placed plans whose simulated peak is at most ``peak_limit_bytes`` and that cost
    less than ``plan``: predicted faster, or recomputing fewer FLOPs at most ``tolerance`` slower
    (or, where the profile's node times spread more between their timed passes, that spread:
    :func:`timing_spread`); fewest FLOPs first, then least time.

    Example:
        >>> from planner.core.costgraph import CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 7):   # three layers of (linear, relu)
        ...     op = ("aten.linear.default", "aten.relu.default")[(i - 1) % 2]
        ...     nodes.append(CostNode(f"n{i}", op, input_names=(nodes[-1].name,), output_storages=(i,),
        ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True,
        ...                           time_ms=1.0, flops=10**6 if "linear" in op else 0,
        ...                           module=f"layers.{(i - 1) // 2}"))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
        >>> every = hand_placed_plans(g)[0]
        >>> dearer = to_plan(g, [Segment(("n1", "n2", "n3", "n4"), recompute_ms=5.0, recompute_flops=3 * 10**6)],
        ...                  2**30, 7 * 2**20, 6 * 2**20, "search", 0.0)
        >>> [hand.name for hand in cheaper_hand_plans(g, dearer, 2**30)][:1]
        ['every 2nd layer']
        >>> cheaper_hand_plans(g, dearer, simulate(g, every.segments).peak_bytes - 1)   # none that low
        []
    """
    flops = sum(s.recompute_flops for s in plan.segments)
    limit_ms = plan.recompute_ms * (1 + max(tolerance, timing_spread(graph)))
    cheaper = [hand for hand in hand_placed_plans(graph)
               if (hand.recompute_ms < plan.recompute_ms
                   or (sum(s.recompute_flops for s in hand.segments) < flops and hand.recompute_ms <= limit_ms))
               and fits_budget(graph, hand.segments, peak_limit_bytes)]
    return sorted(cheaper, key=lambda hand: (sum(s.recompute_flops for s in hand.segments), hand.recompute_ms))
