"""Where to aim an eager plan so that its compiled step peaks in the budget's room. Torch-free.

The profile is the eager step's, and a compiled step peaks lower: fused kernels keep fewer
temporaries, so compile saves a share of the activations while parameters, inputs and
gradients stay as they are. How much it saves shrinks as more is recomputed (less is left to
fuse away), so the saving measured on the unoptimized step is no fixed allowance. Each plan
compiled and measured gives a pair (its eager prediction, its compiled measurement); the next
eager target is read off the line through the last two pairs, and before any plan is measured,
off the line through the unoptimized pair and the bytes held all step (which compile does not
change). How well the line fits: docs/tuning.md#slope_range. A compiled peak can jump between
two plans (a plan a little lower in eager terms can compile much lower), so a target is also kept
between the highest eager prediction that fitted and the lowest that did not
(:func:`within_bracket`).

The plans a search finds for the eager step are not the cheapest compiled: many short segments
cost the compiled step more than their eager prediction says (each boundary keeps its inputs
and splits fusions), while a person's every-k-th-layer plan compiles into few long regions.
:func:`hand_plans_to_compile` picks the hand-placed plans worth compiling beside the search's.

Example:
    >>> pairs = [PeakPair(eager_predicted_bytes=200, compiled_measured_bytes=140)]
    >>> eager_target_bytes(pairs, compiled_target_bytes=80, fixed_bytes=20)   # line through (20, 20) and (200, 140)
    110
    >>> pairs.append(PeakPair(110, 90))                  # the plan for 110 measured 90 compiled
    >>> eager_target_bytes(pairs, compiled_target_bytes=80, fixed_bytes=20)   # line through the last two
    92
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.costgraph import CostGraph
from planner.core.plan import Plan, Segment
from planner.core.simulate import simulate
from planner.core.matmul_ops import segment_saved_ops
from planner.solvers.hand_policies import HAND_PLACED, HandPlan, hand_placed_plans
from planner.solvers.keep import segment_with_kept
from planner.solvers.stage_plans import to_plan

__all__ = ["PeakPair", "eager_target_bytes", "within_bracket", "hand_plans_to_compile", "keeps_matmul_outputs",
           "cost_variant", "costed_on", "plan_structure", "MAX_COMPILED_HAND_PLANS", "MAX_FLOOR_VARIANTS",
           "FLOOR_VARIANT_SPREAD"]

#: Hand-placed plans compiled and measured at most beside the search's plans, the first that
#: fits ending the search (docs/tuning.md#max_compiled_hand_plans).
MAX_COMPILED_HAND_PLANS = 3

#: Plans at the eager floor, other than the floor's own, compiled at most where that one
#: measured over the room (:func:`cost_variant`; docs/tuning.md#max_floor_variants).
MAX_FLOOR_VARIANTS = 3

#: Each node's time moves by up to this share either way in a floor variant: about the spread of
#: node times between timing passes on a shared CPU (docs/tuning.md#max_floor_variants).
FLOOR_VARIANT_SPREAD = 0.1

#: Slopes (compiled bytes per eager byte) a line through two measured pairs may take. Outside
#: it (two plans whose compiled peaks barely differ, or a floor the plans do not move) the next
#: target would land far off; the line through the held bytes is used instead
#: (docs/tuning.md#slope_range).
SLOPE_RANGE = (0.2, 2.0)


@dataclass(frozen=True)
class PeakPair:
    """One step's peak two ways: the simulator's prediction for the eager step, and the
    compiled step's peak measured at the allocator."""

    eager_predicted_bytes: int
    compiled_measured_bytes: int
    #: the plan kept matmul outputs (compiled, its saving per eager byte differs from whole segments')
    kept_matmuls: bool = False


def _slope(low: PeakPair, high: PeakPair) -> float | None:
    run = high.eager_predicted_bytes - low.eager_predicted_bytes
    if run == 0:
        return None
    slope = (high.compiled_measured_bytes - low.compiled_measured_bytes) / run
    return slope if SLOPE_RANGE[0] <= slope <= SLOPE_RANGE[1] else None


def eager_target_bytes(pairs: Sequence[PeakPair], compiled_target_bytes: int, fixed_bytes: int) -> int:
    """The eager peak to plan for so that the compiled step peaks at ``compiled_target_bytes``:
    on the line through the last two ``pairs``, or (one pair, or a slope outside
    :data:`SLOPE_RANGE`) through the last pair and ``(fixed_bytes, fixed_bytes)``, the bytes
    held all step; the last pair itself where neither line is usable. See the module example."""
    if not pairs:
        raise ValueError("eager_target_bytes needs at least one measured pair")
    last = pairs[-1]
    slope = _slope(pairs[-2], last) if len(pairs) > 1 else None
    if slope is None:
        slope = _slope(PeakPair(fixed_bytes, fixed_bytes), last)
    if slope is None:
        return last.eager_predicted_bytes
    return round(last.eager_predicted_bytes + (compiled_target_bytes - last.compiled_measured_bytes) / slope)


def within_bracket(target_bytes: int, pairs: Sequence[PeakPair], room_bytes: int) -> int:
    """``target_bytes`` where it lies strictly between the highest eager prediction whose compiled
    step measured within ``room_bytes`` and the lowest one above it that measured over; otherwise
    that bracket's midpoint. Without a measurement on both sides, ``target_bytes`` itself.

    Example:
        >>> pairs = [PeakPair(200, 150), PeakPair(160, 130), PeakPair(130, 90)]  # room 120
        >>> within_bracket(170, pairs, room_bytes=120)    # above the lowest that measured over
        145
        >>> within_bracket(150, pairs, room_bytes=120)
        150
    """
    fitted = [p.eager_predicted_bytes for p in pairs if p.compiled_measured_bytes <= room_bytes]
    if not fitted:
        return target_bytes
    low = max(fitted)
    over = [p.eager_predicted_bytes for p in pairs
            if p.compiled_measured_bytes > room_bytes and p.eager_predicted_bytes > low]
    if not over:
        return target_bytes
    high = min(over)
    return target_bytes if low < target_bytes < high else (low + high) // 2


def _compiles(graph: CostGraph, segment: Segment) -> bool:
    """Whether a compiled step can honour ``segment``: it keeps nothing, or only matmul-like
    outputs whose operators it never recomputes (a policy by operator, which the compiled graph
    traces: :func:`planner.core.matmul_ops.segment_saved_ops`)."""
    if not segment.kept_nodes:
        return True
    return segment_saved_ops({n: graph.node(n).op for n in segment.node_names}, segment.kept_nodes) is not None


def keeps_matmul_outputs(plan: Plan) -> bool:
    """Whether any segment of ``plan`` keeps outputs (compiled: its matmul outputs).

    Example:
        >>> plan = Plan(0, 0, 0, (Segment(("a", "b"), 1.0, 0, kept_nodes=("a",)),), 0.0, 0.0, 0, "-", 0.0)
        >>> keeps_matmul_outputs(plan), keeps_matmul_outputs(Plan(0, 0, 0, (), 0.0, 0.0, 0, "-", 0.0))
        (True, False)
    """
    return any(segment.kept_nodes for segment in plan.segments)


def _partly_kept(hands: Sequence[HandPlan]) -> list[HandPlan]:
    """For each plan keeping matmul outputs whose whole-segment twin (the same segments, nothing
    kept) is among ``hands``: the plans recomputing its first 1 .. n-1 segments whole and keeping
    matmul outputs in the rest, from the most kept to the least. Compiled, a segment that keeps
    its matmul outputs costs little and saves less; a few whole segments close the gap to a budget
    between the two plans at less cost than a plan of whole segments alone."""
    whole = {tuple(s.node_names for s in hand.segments): hand for hand in hands
             if not any(s.kept_nodes for s in hand.segments)}
    mixed: list[HandPlan] = []
    for hand in hands:
        twin = whole.get(tuple(s.node_names for s in hand.segments))
        if twin is None or not any(s.kept_nodes for s in hand.segments):
            continue
        n = len(hand.segments)
        for j in range(1, n):
            mixed.append(HandPlan(f"{twin.name}, matmul outputs kept in the last {n - j} of {n}",
                                  twin.segments[:j] + hand.segments[j:]))
    return mixed


def hand_plans_to_compile(graph: CostGraph, pairs: Sequence[PeakPair], room_bytes: int, budget_bytes: int,
                          limit: int = MAX_COMPILED_HAND_PLANS) -> list[Plan]:
    """The hand-placed plans (:func:`planner.solvers.hand_policies.hand_placed_plans`: whole
    segments, or segments keeping exactly their matmul outputs, the one selective policy a
    compiled step runs) most likely to compile into
    ``room_bytes``, at most ``limit``, as plans for ``budget_bytes``: those whose eager peak is
    below the lowest eager prediction that measured over the room, nearest first to the eager
    peak the measured ``pairs`` expect to compile to the room (:func:`eager_target_bytes`),
    except that the matmul-keeping plan of least recompute at or below that peak comes first
    (compiled, its recomputed pointwise ops fuse into the backward's kernels); that peak is read
    off the pairs of plans that kept matmul outputs where there are any. Matmul-keeping plans
    include those recomputing their first segments whole (:func:`_partly_kept`).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 9):   # four layers of two ops each
        ...     nodes.append(CostNode(f"n{i}", "aten.relu.default", input_names=(nodes[-1].name,),
        ...                           output_storages=(i,), saved_storages=(i,), output_bytes=100,
        ...                           requires_grad=True, time_ms=1.0, module=f"layers.{(i - 1) // 2}"))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 100, i == 0) for i in range(9)), ("n8",))
        >>> pairs = [PeakPair(simulate(g).peak_bytes, 900)]   # nothing recomputed: 1100 eager, 900 compiled
        >>> [(p.solver, p.predicted_peak_bytes) for p in hand_plans_to_compile(g, pairs, 800, 800)]
        [('hand-placed: every 3rd layer', 1000), ('hand-placed: every layer', 900), ('hand-placed: every 2nd layer', 800)]
        >>> pairs.append(PeakPair(1000, 850))   # every 3rd layer measured over the room
        >>> [p.solver for p in hand_plans_to_compile(g, pairs, 800, 800)]
        ['hand-placed: every layer', 'hand-placed: every 2nd layer']
    """
    unoptimized = simulate(graph).peak_bytes
    over = [p.eager_predicted_bytes for p in pairs if p.compiled_measured_bytes > room_bytes]
    ceiling = min(over) if over else None
    aim = eager_target_bytes(pairs, room_bytes, graph.persistent_bytes) if pairs else unoptimized
    keeping_pairs = [p for p in pairs if p.kept_matmuls]
    keeping_aim = eager_target_bytes(keeping_pairs, room_bytes, graph.persistent_bytes) if keeping_pairs else aim
    seen: set[tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = set()
    ranked: list[tuple[int, int, str, Plan]] = []
    hands = hand_placed_plans(graph)
    for hand in [*hands, *_partly_kept(hands)]:
        key = plan_structure(hand.segments)
        if not hand.segments or not all(_compiles(graph, s) for s in hand.segments) or key in seen:
            continue
        seen.add(key)
        peak = simulate(graph, hand.segments).peak_bytes
        if ceiling is not None and peak >= ceiling:
            continue
        plan = to_plan(graph, list(hand.segments), budget_bytes, unoptimized, peak, f"{HAND_PLACED}: {hand.name}", 0.0)
        ranked.append((abs(peak - aim), len(ranked), hand.name, plan))
    ordered = sorted(ranked)
    # compiled, recomputing pointwise ops around saved matmul outputs costs little (they fuse
    # into the backward's kernels): the cheapest such plan expected to fit goes first
    keeping = [r for r in ordered if keeps_matmul_outputs(r[3]) and r[3].predicted_peak_bytes <= keeping_aim]
    if keeping:
        first = min(keeping, key=lambda r: r[3].recompute_ms)
        ordered = [first, *(r for r in ordered if r is not first)]
    return [plan for *_, plan in ordered[:limit]]


def cost_variant(graph: CostGraph, seed: int, spread: float = FLOOR_VARIANT_SPREAD) -> CostGraph:
    """``graph`` with each node's ``time_ms`` scaled by a factor drawn from ``[1 - spread, 1 +
    spread]`` (seeded: the same variant every run). At the eager floor many plans peak alike
    and differ in recompute cost by less than the timing noise, while their compiled peaks
    differ by several percent: solving the floor on such variants finds those plans to compile.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", time_ms=1.0, output_storages=(0,)),), (Storage(0, 8),))
        >>> t = cost_variant(g, seed=1).nodes[0].time_ms
        >>> 0.9 <= t <= 1.1, t == cost_variant(g, seed=1).nodes[0].time_ms, t != 1.0
        (True, True, True)
    """
    rng = random.Random(seed)
    nodes = tuple(dataclasses.replace(n, time_ms=n.time_ms * (1 + rng.uniform(-spread, spread))) for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)


def costed_on(plan: Plan, graph: CostGraph) -> Plan:
    """``plan`` with its segments' recompute costs, and its forward time, counted on ``graph`` (a
    plan solved on a :func:`cost_variant` reports the profile's own costs).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> node = CostNode("a", "op", time_ms=2.0, output_storages=(0,), saved_storages=(0,))
        >>> g = CostGraph((node,), (Storage(0, 8),))
        >>> plan = Plan(0, 0, 0, (Segment(("a",), 9.0, 0),), 0.0, 0.0, 0, "-", 0.0)
        >>> costed_on(plan, g).segments[0].recompute_ms
        2.0
    """
    segments = tuple(segment_with_kept(graph, s.node_names, set(s.kept_nodes)) for s in plan.segments)
    return dataclasses.replace(plan, segments=segments, forward_ms=graph.forward_ms)


def plan_structure(segments: Sequence[Segment]) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """What a compiled plan of ``segments`` is, costs aside: each segment's nodes and kept nodes.

    Example:
        >>> plan_structure((Segment(("a", "b"), 1.0, 0, kept_nodes=("a",)),))
        ((('a', 'b'), ('a',)),)
    """
    return tuple((s.node_names, s.kept_nodes) for s in segments)
