"""Offload as the third choice: turn a plan's recompute into copies to host memory where they hide.

:func:`offload_plan` starts from a plan (its segments) and a budget. With the segments it has,
it offloads the fewest held outputs that bring the replay of :func:`planner.core.offload.
simulate_offload` within the budget (none where the plan fits already); then it drops segments,
dearest first, each time offloading what the freed room needs, and keeps a change only where the
predicted extra step time (recompute plus copies not hidden behind compute) falls. Which outputs
to offload is a prefix of one of two orders: execution order (the earliest outputs have the
whole forward to leave and the whole backward to come back) and largest first; the shortest
prefix that fits is found by bisection on the replay's peak, then outputs whose copies the
compute waits for are dropped from it where the plan still fits. The plan with no segments at
all is tried first (a link fast enough for every held output needs no recompute). Every plan it returns was
replayed with its copies: its peak and its exposed transfer time are the simulator's.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.plan import Plan, Segment
    >>> def relu(name, src, k):
    ...     return CostNode(name, "relu", input_names=(src,), output_storages=(k,), saved_storages=(k,),
    ...                     output_bytes=1000, requires_grad=True, time_ms=1.0)
    >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)), relu("a", "x", 2),
    ...                relu("b", "a", 3), relu("c", "b", 4), relu("d", "c", 5)),
    ...               tuple(Storage(k, 1000, k == 1) for k in range(1, 6)), output_names=("d",), step_ms=12.0)
    >>> base = Plan(budget_bytes=6000, predicted_peak_bytes=6000, unoptimized_peak_bytes=7000,
    ...             segments=(Segment(("a", "b"), recompute_ms=2.0, recompute_flops=0),), forward_ms=4.0,
    ...             step_ms=12.0, forward_flops=0, solver="chain DP", solve_s=0.0)
    >>> plan = offload_plan(g, 6000, base, OffloadSpec(h2d_gbps=1e-3, d2h_gbps=1e-3))
    >>> plan.segments, plan.offloaded, plan.extra_time_ms, plan.predicted_peak_bytes <= 6000
    ((), ('a',), 0.0, True)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.core.costgraph import CostGraph
from planner.core.offload import OffloadSimulation, OffloadSpec, offloadable_nodes, simulate_offload
from planner.core.plan import Plan, Segment

__all__ = ["offload_plan", "OffloadChoice", "fit_with_offload", "offload_everything", "offload_floor",
           "with_offloads"]

logger = logging.getLogger(__name__)

#: a change must lower the predicted extra step time by more than this share of it to be kept
#: (so that noise in the replayed transfer times does not trade recompute for copies at par)
MIN_GAIN_SHARE = 1e-3


@dataclass(frozen=True)
class OffloadChoice:
    """Segments and offloaded nodes that fit a budget, with their replay: ``extra_ms`` is the
    recompute plus the exposed transfer time."""

    segments: tuple[Segment, ...]
    offloaded: tuple[str, ...]
    result: OffloadSimulation

    @property
    def extra_ms(self) -> float:
        return sum(s.recompute_ms for s in self.segments) + self.result.exposed_ms


def _fits(graph: CostGraph, segments: Sequence[Segment], names: Sequence[str], budget_bytes: int,
          spec: OffloadSpec) -> OffloadSimulation | None:
    result = simulate_offload(graph, segments, names, spec, limit_bytes=budget_bytes)
    return result if result.peak_bytes <= budget_bytes else None


def _within_pinned(graph: CostGraph, order: Sequence[str], movable: dict[str, tuple[int, ...]],
                   pinned_host_bytes: int) -> list[str]:
    sizes = graph.storage_by_key
    out: list[str] = []
    used = 0
    for name in order:
        size = sum(sizes[k].size_bytes for k in movable[name])
        if used + size <= pinned_host_bytes:
            out.append(name)
            used += size
    return out


def _shortest_prefix(graph: CostGraph, segments: Sequence[Segment], order: Sequence[str], budget_bytes: int,
                     spec: OffloadSpec) -> OffloadChoice | None:
    """The shortest prefix of ``order`` whose replay fits (bisection: the peak falls, by and
    large, as the prefix grows), then without the outputs whose copies the compute waits for
    where it still fits."""
    if _fits(graph, segments, order, budget_bytes, spec) is None:
        return None
    lo, hi = 0, len(order)  # order[:hi] fits; order[:lo] is not known to
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(graph, segments, order[:mid], budget_bytes, spec) is not None:
            hi = mid
        else:
            lo = mid + 1
    chosen = list(order[:hi])
    result = simulate_offload(graph, segments, chosen, spec)
    for name in reversed(order[:hi]):
        if result.exposed_ms <= 0:
            break
        trial = [n for n in chosen if n != name]
        fitted = _fits(graph, segments, trial, budget_bytes, spec)
        if fitted is not None and fitted.exposed_ms < result.exposed_ms:
            chosen = trial
            result = simulate_offload(graph, segments, chosen, spec)
    return OffloadChoice(tuple(segments), tuple(chosen), result)


def fit_with_offload(graph: CostGraph, segments: Sequence[Segment], budget_bytes: int,
                     spec: OffloadSpec) -> OffloadChoice | None:
    """The cheapest of the offload choices tried for ``segments`` that fits ``budget_bytes``
    (nothing offloaded where the segments fit alone), or None.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...                CostNode("a", "relu", input_names=("x",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=10, requires_grad=True, time_ms=1.0)),
        ...               (Storage(1, 10, True), Storage(2, 10)), output_names=("a",))
        >>> link = OffloadSpec(1.0, 1.0)
        >>> fit_with_offload(g, (), 30, link).offloaded, fit_with_offload(g, (), 29, link)
        ((), None)
    """
    alone = _fits(graph, segments, (), budget_bytes, spec)
    if alone is not None:
        return OffloadChoice(tuple(segments), (), alone)
    movable = offloadable_nodes(graph, segments)
    sizes = graph.storage_by_key
    by_size = sorted(movable, key=lambda n: -sum(sizes[k].size_bytes for k in movable[n]))
    best: OffloadChoice | None = None
    for order in (list(movable), by_size):
        choice = _shortest_prefix(graph, segments, _within_pinned(graph, order, movable, spec.pinned_host_bytes),
                                  budget_bytes, spec)
        if choice is not None and (best is None or choice.extra_ms < best.extra_ms):
            best = choice
    return best


def offload_plan(graph: CostGraph, budget_bytes: int, base: Plan, spec: OffloadSpec) -> Plan | None:
    """A plan from ``base``'s segments with outputs offloaded over ``spec``'s link, cheaper in
    predicted extra step time than ``base`` (or fitting ``budget_bytes`` where ``base`` does
    not); None where offloading finds no such plan. ``base`` is not changed.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),),
        ...               (Storage(1, 10, True),))
        >>> base = Plan(budget_bytes=10, predicted_peak_bytes=10, unoptimized_peak_bytes=10, segments=(),
        ...             forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="chain DP", solve_s=0.0)
        >>> offload_plan(g, 10, base, OffloadSpec(50.0, 50.0)) is None   # nothing is recomputed
        True
    """
    started = time.perf_counter()
    current = fit_with_offload(graph, base.segments, budget_bytes, spec)
    if base.segments:  # a link fast enough to move every held output needs no recompute at all
        bare = fit_with_offload(graph, (), budget_bytes, spec)
        if bare is not None and (current is None or bare.extra_ms < current.extra_ms):
            current = bare
    base_fits = base.predicted_peak_bytes <= budget_bytes and not base.offloaded
    base_extra_ms = base.extra_time_ms if base_fits else float("inf")
    for seg in sorted(base.segments, key=lambda s: -s.recompute_ms):
        if current is None:
            break
        trial_segments = tuple(s for s in current.segments if s is not seg)
        if len(trial_segments) == len(current.segments):
            continue
        trial = fit_with_offload(graph, trial_segments, budget_bytes, spec)
        if trial is not None and trial.extra_ms < current.extra_ms * (1 - MIN_GAIN_SHARE):
            logger.debug("offload: dropping segment %s..%s (%.3f ms recompute) for %d offloaded outputs",
                         seg.node_names[0], seg.node_names[-1], seg.recompute_ms, len(trial.offloaded))
            current = trial
    if current is None or not current.offloaded or not current.extra_ms < base_extra_ms * (1 - MIN_GAIN_SHARE):
        return None
    result = current.result
    logger.info("offload: %d outputs (%.1f MiB) to host memory, %.3f ms extra where the plan had %.3f ms",
                len(current.offloaded), result.offloaded_bytes / 2**20, current.extra_ms, base_extra_ms)
    return replace(with_offloads(base, current.segments, result, f"{base.solver} + offload"),
                   budget_bytes=budget_bytes, solve_s=base.solve_s + time.perf_counter() - started)


def with_offloads(base: Plan, segments: Sequence[Segment], result: OffloadSimulation, solver: str) -> Plan:
    """``base`` recomputing ``segments`` with the copies of ``result`` (its replay): peak,
    offloaded nodes, their triggers and bytes, exposed transfer time, all the replay's.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...                CostNode("a", "relu", input_names=("x",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=10, requires_grad=True, time_ms=1.0),
        ...                CostNode("b", "relu", input_names=("a",), output_storages=(3,), output_bytes=10,
        ...                         requires_grad=True, time_ms=1.0)),
        ...               (Storage(1, 10, True), Storage(2, 10), Storage(3, 10)), output_names=("b",))
        >>> base = Plan(budget_bytes=30, predicted_peak_bytes=30, unoptimized_peak_bytes=30, segments=(),
        ...             forward_ms=2.0, step_ms=6.0, forward_flops=0, solver="none", solve_s=0.0)
        >>> plan = with_offloads(base, (), simulate_offload(g, (), ("a",), OffloadSpec(1.0, 1.0)), "copies")
        >>> plan.offloaded, plan.offloaded_bytes, plan.solver
        (('a',), 10, 'copies')
    """
    return replace(base, segments=tuple(segments), predicted_peak_bytes=result.peak_bytes,
                   offloaded=result.offloaded, offload_triggers=result.triggers,
                   offloaded_bytes=result.offloaded_bytes, exposed_transfer_ms=result.exposed_ms, solver=solver,
                   optimality_gap=None, by_chain_dp=False)


def _movable_bytes(graph: CostGraph, movable: dict[str, tuple[int, ...]]) -> int:
    sizes = graph.storage_by_key
    return sum(sizes[k].size_bytes for ks in movable.values() for k in ks)


def offload_everything(graph: CostGraph, segments: Sequence[Segment], spec: OffloadSpec, *,
                       limit_bytes: float = math.inf) -> OffloadSimulation | None:
    """The replay of ``segments`` with every held output offloaded
    (:func:`planner.core.offload.offloadable_nodes`): what ``save_on_cpu`` around those
    checkpoints does. None where they need more than ``spec.pinned_host_bytes`` of host memory.
    ``limit_bytes`` as :func:`planner.core.offload.simulate_offload`'s.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...                CostNode("a", "relu", input_names=("x",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=10, requires_grad=True, time_ms=1.0),
        ...                CostNode("b", "relu", input_names=("a",), output_storages=(3,), output_bytes=10,
        ...                         requires_grad=True, time_ms=1.0)),
        ...               (Storage(1, 10, True), Storage(2, 10), Storage(3, 10)), output_names=("b",))
        >>> offload_everything(g, (), OffloadSpec(1.0, 1.0)).offloaded
        ('a',)
        >>> offload_everything(g, (), OffloadSpec(1.0, 1.0, pinned_host_bytes=9)) is None
        True
    """
    movable = offloadable_nodes(graph, segments)
    if _movable_bytes(graph, movable) > spec.pinned_host_bytes:
        return None
    return simulate_offload(graph, segments, list(movable), spec, limit_bytes=limit_bytes)


def offload_floor(graph: CostGraph, segments: Sequence[Segment], spec: OffloadSpec) -> int:
    """The smallest peak :func:`fit_with_offload` can reach with ``segments``: the held outputs
    within the pinned host memory, taken in execution order or largest first, all offloaded.
    A budget of at least this fits with ``segments`` and offload.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> def relu(name, src, k):
        ...     return CostNode(name, "relu", input_names=(src,), output_storages=(k,), saved_storages=(k,),
        ...                     output_bytes=1000, requires_grad=True, time_ms=1.0)
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)), relu("a", "x", 2),
        ...                relu("b", "a", 3), relu("c", "b", 4), relu("d", "c", 5)),
        ...               tuple(Storage(k, 1000, k == 1) for k in range(1, 6)), output_names=("d",), step_ms=12.0)
        >>> link = OffloadSpec(h2d_gbps=1e-3, d2h_gbps=1e-3)   # 1,000 bytes per ms each way
        >>> offload_floor(g, (), link), offload_floor(g, (), OffloadSpec(1e-3, 1e-3, pinned_host_bytes=0))
        (6000, 7000)
    """
    movable = offloadable_nodes(graph, segments)
    sizes = graph.storage_by_key
    by_size = sorted(movable, key=lambda n: -sum(sizes[k].size_bytes for k in movable[n]))
    chosen = {tuple(_within_pinned(graph, order, movable, spec.pinned_host_bytes))
              for order in (list(movable), by_size)}
    return min(simulate_offload(graph, segments, names, spec).peak_bytes for names in sorted(chosen))
