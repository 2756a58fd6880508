"""The plan with the smallest peak the planner's searches reach: :func:`minimum_peak_plan`.

It names the smallest budget when one is refused, and starts a sweep. An ILP over the first
stages minimises its account's peak (:mod:`planner.solvers.stage_ilp`); local moves judged by the simulator
lower it (:func:`planner.solvers.refine.lower_peak`); on small graphs the exact search bisects it
(:mod:`planner.solvers.relaxation`); then the chain DP's starts lower it further
(:func:`_lowest_by_dp_starts`). See docs/design.md#smallest-peak.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from planner.core.costgraph import MIB, CostGraph
from planner.core.errors import SolverError, check_time_limit
from planner.core.options import SolveOptions, with_overrides
from planner.solvers.keep import segment_with_kept
from planner.solvers.stage_ilp import choose_solver, run_solver, solve_ilp
from planner.core.plan import Plan, Segment
from planner.solvers.refine import ALL_CUTS_BELOW, lower_peak
from planner.solvers.relaxation import search_cheapest
from planner.core.simulate import simulate
from planner.solvers.stage_model import StageModel, build_stage_model
from planner.solvers.stage_plans import stage_segments, short_segments_plan, tightened_plan, to_plan, short_segment_shapes
from planner.core.stages import build_stages

__all__ = ["minimum_peak_plan"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: First step below the lowest peak of the chain DP's descent (docs/tuning.md#dp_descent_first_step).
DP_DESCENT_FIRST_STEP = 0.01
#: Relative precision the descent's bisection stops at (docs/tuning.md#dp_descent_precision).
DP_DESCENT_PRECISION = 0.005
#: Seconds the descent may take (docs/tuning.md#dp_descent_s).
DP_DESCENT_S = 30.0
#: Replays each start of the descent may tighten its target after (docs/tuning.md#dp_descent_attempts).
DP_DESCENT_ATTEMPTS = 8
#: Relative precision the exact search's bisection stops at (docs/tuning.md#bisection_precision).
BISECTION_PRECISION = 0.005
#: Candidates each search of the bisection may replay (docs/tuning.md#bisection_candidates).
BISECTION_CANDIDATES = 8


def minimum_peak_plan(
    graph: CostGraph,
    options: SolveOptions | None = None,
    *,
    exact_s: float | None = None,
    infeasible_bytes: int = 0,
    lower_by_dp: bool = True,
    **overrides: Any,
) -> Plan:
    """The plan with the smallest peak found, whatever it costs (``options`` as :func:`solve`'s,
    or their fields by name in ``overrides``): the ILP's, lowered further by
    local moves judged by the simulator (:func:`planner.solvers.refine.lower_peak`, up to ``refine_s``)
    and, with ``exact`` (default: graphs under 64 compute nodes), by bisecting the budget with
    the search of :mod:`planner.solvers.relaxation`, which makes it the smallest over the stages (within
    :data:`BISECTION_PRECISION`) unless a search of the bisection neither finds nor proves in
    :data:`BISECTION_CANDIDATES` candidates or it runs out of ``exact_s`` seconds (default
    ``time_limit_s``) first.
    ``infeasible_bytes``: a budget already proven to fit no plan over the stages (the bisection
    starts above it).

    With ``lower_by_dp`` and no ``solver`` named (the chain DP's path), it is then lowered by
    the chain DP's starts of :func:`solve` (:func:`_lowest_by_dp_starts`): the first stage
    model at targets raised above the budget and, on deep graphs, the starts on many short
    stages meet budgets below the ILP's smallest peak (docs/tuning.md#dp_descent_first_step).

    Its ``predicted_peak_bytes`` is the smallest budget :func:`solve` accepts.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 9):
        ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
        ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
        >>> from planner.solvers.solve import solve
        >>> lowest = minimum_peak_plan(g)
        >>> lowest.predicted_peak_bytes < simulate(g).peak_bytes
        True
        >>> solve(g, lowest.predicted_peak_bytes).predicted_peak_bytes <= lowest.predicted_peak_bytes
        True
    """
    options = with_overrides(options, overrides)
    max_stages, solver, time_limit_s, refine_s = options.max_stages, options.solver, options.time_limit_s, \
        options.refine_s
    exact = options.exact
    if exact_s is not None:
        check_time_limit(exact_s, "exact_s")
    started = time.perf_counter()
    stages = build_stages(graph, max_stages)
    model = build_stage_model(graph, stages, max_segment_stages=len(stages))
    unoptimized = simulate(graph).peak_bytes
    result = solve_ilp(model, None, solver, time_limit_s)
    if result is None:  # pragma: no cover - minimising the peak is always feasible
        raise SolverError("the minimum-peak model was reported infeasible")
    segments = stage_segments(graph, model, result.chosen, result.kept)
    if refine_s > 0:
        starts = [segments]
        if len(graph.compute_nodes) < ALL_CUTS_BELOW:  # small: also descend from no and from full recompute
            starts += [[], _every_recomputable_run(graph)]
        lowered = [lower_peak(graph, start, time_limit_s=refine_s / len(starts)) for start in starts]
        segments = min(lowered, key=lambda segs: (simulate(graph, segs).peak_bytes, sum(s.recompute_ms for s in segs)))
    peak = simulate(graph, segments).peak_bytes
    if peak > unoptimized:
        segments, peak = [], unoptimized
    if exact_search_on(graph, exact) and segments:
        segments, peak = _lowest_by_bisection(graph, model, segments, peak, solver,
                                              time_limit_s if exact_s is None else exact_s, infeasible_bytes)
    if lower_by_dp and solver is None and segments:
        segments, peak = _lowest_by_dp_starts(graph, model, segments, peak, unoptimized, max_stages,
                                              min(time_limit_s, DP_DESCENT_S), started)
    return to_plan(graph, segments, peak, unoptimized, peak, result.solver, time.perf_counter() - started, result)


def exact_search_on(graph: CostGraph, exact: bool | None) -> bool:
    """``exact``, or by default whether the graph is small enough (under 64 compute nodes) for
    the exact search to be quick (docs/tuning.md#all_cuts_below)."""
    return len(graph.compute_nodes) < ALL_CUTS_BELOW if exact is None else exact


def _lowest_by_bisection(graph: CostGraph, model: StageModel, segments: list[Segment], peak: int,
                         solver: str | None, time_limit_s: float,
                         infeasible_bytes: int = 0) -> tuple[list[Segment], int]:
    """Lower the smallest peak found by bisecting the budget with the optimistic account's
    search (:func:`planner.solvers.relaxation.search_cheapest`): a budget it proves that no plan over
    the stages fits is a lower end, a plan it finds is a new upper end. Starts above
    ``infeasible_bytes`` (a budget proven to fit no plan) or the persistent bytes. Stops within
    :data:`BISECTION_PRECISION` of the smallest peak over the stages, at the first search that
    neither finds nor proves in :data:`BISECTION_CANDIDATES` candidates, or after
    ``time_limit_s`` for all searches together: just below the smallest peak a search can
    replay candidate after candidate without either, seconds each
    (docs/tuning.md#bisection_candidates)."""
    name = choose_solver(solver)
    deadline = time.perf_counter() + time_limit_s
    low = max(graph.persistent_bytes, infeasible_bytes + 1)
    while peak - low > peak * BISECTION_PRECISION and (left_s := deadline - time.perf_counter()) > 0:
        middle = (low + peak) // 2
        found = search_cheapest(graph, model.stages, middle, math.inf,
                                lambda prob: run_solver(prob, name, left_s, presolve=False),
                                max_candidates=BISECTION_CANDIDATES, time_limit_s=left_s)
        if found.runs is not None:
            segments = stage_segments(graph, model, found.runs)
            peak = simulate(graph, segments).peak_bytes
        elif found.proven:
            low = middle + 1
        else:
            break
    return segments, peak


def _lowest_by_dp_starts(graph: CostGraph, model: StageModel, segments: list[Segment], peak: int,
                         unoptimized: int, max_stages: int, time_limit_s: float,
                         started: float) -> tuple[list[Segment], int]:
    """Lower the smallest peak found (``segments``, replayed at ``peak``) with the chain DP's
    starts of :func:`solve`: the first stage model (``model``) and, on graphs of at least 16
    compute nodes per stage, the short-segment starts (:func:`short_segment_shapes` without the
    finest), each at targets raised above the budget too (:func:`loosened_plan`: the models' account
    is conservative, so their plans can peak below the smallest peak the ILP minimises). Budgets
    :data:`DP_DESCENT_FIRST_STEP` below the lowest peak so far, the step doubling while a start
    finds a plan, then bisected between the last budget where none did and the lowest peak, to
    within :data:`DP_DESCENT_PRECISION` of it or until ``time_limit_s`` runs out. A budget is met
    when any start's plan fits it in the simulator, as in :func:`solve`, so the peak this
    returns is one :func:`solve` meets too (its fallback, this search, finds the same plan)."""
    # not the finest start: it found no lower peak, at seconds a budget; the shapes above it
    # found every lower one measured (docs/tuning.md#dp_descent_first_step)
    shapes = short_segment_shapes(len(graph.compute_nodes), max_stages)
    deadline = time.perf_counter() + time_limit_s

    def first_plan_at(budget_bytes: int) -> Plan | None | bool:
        """The first start's plan that fits ``budget_bytes``; None when no start finds one;
        False when time ran out before every start was tried."""
        left_s = deadline - time.perf_counter()
        if left_s <= 0:
            return False
        try:
            plan = tightened_plan(graph, model, budget_bytes, unoptimized, None, left_s, DP_DESCENT_ATTEMPTS,
                              started, by_chain_dp=True, loosen=True)
        except SolverError:  # the model was too large for the DP and its ILP found nothing in time
            plan = None
        if plan is not None:
            return plan
        for stage_count, max_segment_stages in shapes:
            left_s = deadline - time.perf_counter()
            if left_s <= 0:
                return False
            plan, _ = short_segments_plan(graph, stage_count, max_segment_stages, budget_bytes, unoptimized,
                                           None, left_s, DP_DESCENT_ATTEMPTS, started, by_chain_dp=True)
            if plan is not None:
                return plan
        return None

    low = graph.persistent_bytes  # no plan peaks below the persistent bytes
    step = DP_DESCENT_FIRST_STEP
    probes, lowered_from = 0, peak
    bisecting = False
    while peak - low > peak * DP_DESCENT_PRECISION and time.perf_counter() < deadline:
        budget = (low + peak) // 2 if bisecting else max(low + 1, int(peak * (1 - step)))
        found = first_plan_at(budget)
        probes += 1
        log.debug("smallest peak by the DP's starts: %.1f MiB %s", budget / MIB,
                  "out of time" if found is False else "no plan" if found is None
                  else f"a plan peaking at {found.predicted_peak_bytes / MIB:.1f} MiB")
        if found is False:
            break
        if found is None:
            low, bisecting = budget, True
            continue
        segments, peak = list(found.segments), found.predicted_peak_bytes
        step *= 2
    if peak < lowered_from:
        log.info("smallest peak lowered by the chain DP's starts: %.1f -> %.1f MiB (%d budgets tried)",
                 lowered_from / MIB, peak / MIB, probes)
    return segments, peak


def _every_recomputable_run(graph: CostGraph) -> list[Segment]:
    """One segment per maximal run of recomputable compute nodes."""
    runs: list[list[Any]] = [[]]
    for node in graph.compute_nodes:
        if node.recomputable:
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    return [segment_with_kept(graph, tuple(n.name for n in run)) for run in runs if run]
