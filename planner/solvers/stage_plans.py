"""One stage model to a plan that fits: solved by the chain DP or as an ILP, replayed, tightened.

Each start of :func:`planner.solvers.solve.solve` and of the smallest-peak search builds a stage model
(:mod:`planner.solvers.stage_model`) and hands it here. :func:`tightened_plan` solves it (by dynamic
programming over the stage chain, :mod:`planner.solvers.chain_dp`, or as an ILP, :mod:`planner.solvers.stage_ilp`),
replays the plan in the simulator and, when the replay is over the budget, solves again with
the bound lowered by the excess; :func:`loosened_plan` also tries targets above the budget, since
the model's account is conservative. :func:`short_segment_shapes` names the starts on many
short stages, and :func:`short_segments_plan` solves one of them.

Example:
    >>> short_segment_shapes(300), short_segment_shapes(755)
    ([], [(256, 8)])
"""

from __future__ import annotations

import dataclasses
import logging
import time

from planner.solvers.chain_dp import ChainSearchTooLarge, cheapest_plan
from planner.core.costgraph import MIB, CostGraph
from planner.core.errors import SolverError
from planner.solvers.keep import keepable_in_segment, segment_with_kept
from planner.solvers.stage_ilp import IlpResult, solve_ilp
from planner.core.plan import Plan, Segment
from planner.core.simulate import simulate
from planner.solvers.stage_model import StageModel, build_stage_model
from planner.core.stages import build_stages
from planner.core.options import SolveOptions

__all__ = ["CHAIN_DP", "short_segment_shapes"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: the solver name of plans found by :func:`_solve_chain`
CHAIN_DP = "chain DP"
#: Fractions above the budget the chain DP's target is raised to (docs/tuning.md#loosen_steps).
LOOSEN_STEPS = (0.01, 0.02, 0.03, 0.05, 0.08, 0.13, 0.21, 0.34, 0.55)
#: Most candidate segments a model may have for raised targets (docs/tuning.md#loosen_max_candidates).
LOOSEN_MAX_CANDIDATES = 1500
#: Bisection steps after the first raised target that goes over (docs/tuning.md#loosen_bisect_steps).
LOOSEN_BISECT_STEPS = 3
#: Branch-and-bound nodes of each ILP on finer stages (docs/tuning.md#finer_pass_nodes).
FINER_PASS_NODES = 100
#: Short-segment start's stage count per first stage (docs/tuning.md#short_segment_stages_per_start).
SHORT_SEGMENT_STAGES_PER_START = 8
#: Longest segment, in stages, of the first short-segment start (docs/tuning.md#short_segment_max_stages).
SHORT_SEGMENT_MAX_STAGES = 8
#: Longest segment, in stages, of the deeper short-segment start (docs/tuning.md#short_segment_max_stages_deep).
SHORT_SEGMENT_MAX_STAGES_DEEP = 6
#: Most stages of the chain DP's finest start, one per compute node (docs/tuning.md#finest_stages).
FINEST_STAGES = 1024
#: Longest segment, in stages, of the finest start (docs/tuning.md#finest_max_segment_stages).
FINEST_MAX_SEGMENT_STAGES = 10
#: Stage pairs the finest start's spans may cover on fewer stages (docs/tuning.md#finest_span_pairs).
FINEST_SPAN_PAIRS = 10_240
#: A model the chain DP finds too large goes to the ILP only on at most this many stages: on
#: more (the finest start, one stage per op) the ILP finds no plan in its time
#: (docs/tuning.md#ilp_fallback_max_stages).
ILP_FALLBACK_MAX_STAGES = 512


def _solve_chain(model: StageModel, budget_mib: float) -> IlpResult | None:
    """The same model as :func:`solve_ilp` at ``budget_mib``, solved to its optimum by dynamic
    programming over the stage chain (:mod:`planner.solvers.chain_dp`), keep options included; None
    when no plan fits."""
    plan = cheapest_plan(model, budget_mib)
    if plan is None:
        return None
    kept = frozenset(name for j, o in plan.keeps for name in model.keep_options[j][o].node_names)
    return IlpResult(plan.segments, CHAIN_DP, 0.0, False, kept, by_chain_dp=True, chain_labels=plan.labels)


def stage_segments(graph: CostGraph, model: StageModel, chosen: list[tuple[int, int]],
              kept: frozenset[str] = frozenset()) -> list[Segment]:
    """The chosen ``(first_stage, last_stage)`` runs as Segments with their recompute cost,
    keeping the outputs of the nodes in ``kept`` that a selective policy can keep there."""
    out = []
    for a, b in sorted(chosen):
        names = tuple(n for st in model.stages[a : b + 1] for n in st.node_names)
        out.append(segment_with_kept(graph, names, kept & set(keepable_in_segment(graph, names))))
    return out


def to_plan(
    graph: CostGraph,
    segments: list[Segment],
    budget_bytes: int,
    unoptimized_peak_bytes: int,
    peak_bytes: int,
    solver: str,
    solve_s: float,
    result: IlpResult | None = None,
) -> Plan:
    return Plan(
        budget_bytes=budget_bytes,
        predicted_peak_bytes=peak_bytes,
        unoptimized_peak_bytes=unoptimized_peak_bytes,
        segments=tuple(segments),
        forward_ms=graph.forward_ms,
        step_ms=graph.step_ms,
        forward_flops=graph.forward_flops,
        solver=solver,
        solve_s=solve_s,
        measured_unoptimized_peak_bytes=graph.measured_peak_bytes,
        optimality_gap=result.gap if result else None,
        hit_time_limit=result.hit_time_limit if result else False,
        by_chain_dp=result.by_chain_dp if result else False,
        chain_labels=result.chain_labels if result else 0,
    )


def tightened_plan(
    graph: CostGraph,
    model: StageModel,
    budget_bytes: int,
    unoptimized: int,
    solver: str | None,
    time_limit_s: float,
    max_attempts: int,
    started: float,
    node_limit: int | None = None,
    node_limit_needs_plan: bool = False,
    by_chain_dp: bool = False,
    loosen: bool = False,
) -> Plan | None:
    """Solve, replay in the simulator, and lower the ILP's bound by the excess until the replay
    fits. None when the ILP becomes infeasible first. ``node_limit`` and ``node_limit_needs_plan``: of each
    solve (:func:`solve_ilp`). ``by_chain_dp``: solve the model by dynamic
    programming instead (:func:`_solve_chain`: its optimum, in a fraction of the time); one the
    DP finds too large goes to the ILP (with its node and time limits) on at most
    :data:`ILP_FALLBACK_MAX_STAGES` stages, and has no plan on more. ``loosen``: a plan the
    DP finds at once (or none) is then passed to :func:`loosened_plan`."""
    target_mib = budget_bytes / MIB
    chain = by_chain_dp
    for attempt in range(max_attempts):
        if chain:
            try:
                result = _solve_chain(model, target_mib)
            except ChainSearchTooLarge as exc:
                if len(model.stages) > ILP_FALLBACK_MAX_STAGES:
                    log.info("%s on %d stages: %s; too many stages for the ILP: no plan from this start",
                             CHAIN_DP, len(model.stages), exc)
                    return None
                log.info("%s on %d stages: %s; solving the ILP instead", CHAIN_DP, len(model.stages), exc)
                chain = False
        if not chain:
            result = solve_ilp(model, target_mib, solver, time_limit_s, node_limit, node_limit_needs_plan)
        if result is None:
            break
        plan = _replayed(graph, model, result, budget_bytes, unoptimized, started)
        peak = plan.predicted_peak_bytes
        log.info("attempt %d: %d segments, simulated peak %.1f MiB (budget %.1f MiB)",
                 attempt, len(result.chosen), peak / MIB, budget_bytes / MIB)
        if peak <= budget_bytes:
            if chain and loosen and attempt == 0:
                return loosened_plan(graph, model, plan, budget_bytes, unoptimized, started)
            return plan
        target_mib -= (peak - budget_bytes) / MIB + 0.5
    if chain and loosen and target_mib == budget_bytes / MIB:  # no plan at the budget itself
        return loosened_plan(graph, model, None, budget_bytes, unoptimized, started)
    return None


def loosened_plan(graph: CostGraph, model: StageModel, plan: Plan | None, budget_bytes: int, unoptimized: int,
              started: float) -> Plan | None:
    """``plan`` (the chain DP's at the budget, or None when it found none), or a cheaper plan the
    DP finds at a target above the budget that still fits the budget in the simulator: the
    stage model's account is conservative, so its plans can leave room the simulator does not
    see used. Targets :data:`LOOSEN_STEPS` above the budget, in order, until one's plan goes
    over it, then :data:`LOOSEN_BISECT_STEPS` bisection steps between that target and the last
    that fitted (or the budget); only on models of at
    most :data:`LOOSEN_MAX_CANDIDATES` candidate segments and no keep options, where a DP
    solve takes a fraction of a second (docs/tuning.md#loosen_max_candidates)."""
    if len(model.segments) > LOOSEN_MAX_CANDIDATES or any(model.keep_options):
        return plan
    best = plan
    fitted, over = 0.0, None
    try:
        for step in LOOSEN_STEPS:
            attempt = _fits_at(graph, model, budget_bytes, unoptimized, started, step)
            if attempt is not None and attempt.predicted_peak_bytes > budget_bytes:
                over = step
                break
            if attempt is not None:
                fitted = step
                if best is None or attempt.recompute_ms < best.recompute_ms - 1e-9:
                    best = attempt
        if over is not None:  # bisect between the last target that fitted and the first that went over
            high = over
            for _ in range(LOOSEN_BISECT_STEPS):
                middle = (fitted + high) / 2
                attempt = _fits_at(graph, model, budget_bytes, unoptimized, started, middle)
                if attempt is not None and attempt.predicted_peak_bytes > budget_bytes:
                    high = middle
                    continue
                fitted = middle  # a plan that fits, or none at this target nor below it
                if attempt is not None and (best is None or attempt.recompute_ms < best.recompute_ms - 1e-9):
                    best = attempt
    except ChainSearchTooLarge as exc:
        log.info("%s on %d stages above the budget: %s; stopped raising the target", CHAIN_DP,
                 len(model.stages), exc)
    if best is not plan:
        log.info("%s on %d stages, target raised above the budget: %s -> %.2f ms, simulated peak %.1f MiB "
                 "(budget %.1f MiB)", CHAIN_DP, len(model.stages),
                 "no plan" if plan is None else f"{plan.recompute_ms:.2f} ms", best.recompute_ms,
                 best.predicted_peak_bytes / MIB, budget_bytes / MIB)
    return best


def _fits_at(graph: CostGraph, model: StageModel, budget_bytes: int, unoptimized: int, started: float,
             raised_by: float) -> Plan | None:
    """The chain DP's plan at ``budget_bytes`` raised by the fraction ``raised_by``, replayed
    against ``budget_bytes`` (its ``predicted_peak_bytes`` may exceed it); None when the DP
    finds no plan there."""
    result = _solve_chain(model, budget_bytes * (1 + raised_by) / MIB)
    return None if result is None else _replayed(graph, model, result, budget_bytes, unoptimized, started)


def _replayed(graph: CostGraph, model: StageModel, result: IlpResult, budget_bytes: int, unoptimized: int,
              started: float, solver: str | None = None) -> Plan:
    """``result``'s segments as a plan for ``budget_bytes``, its peak replayed in the simulator
    (it may exceed the budget); ``solver`` names it (``result.solver`` by default)."""
    segments = stage_segments(graph, model, result.chosen, result.kept)
    peak = simulate(graph, segments).peak_bytes
    return to_plan(graph, segments, budget_bytes, unoptimized, peak, solver or result.solver,
                    time.perf_counter() - started, result)


def short_segment_shapes(compute_count: int, max_stages: int = SolveOptions.max_stages, finest: bool = False) -> list[tuple[int, int]]:
    """The starts of the short-segments path (:func:`short_segments_plan`) on a graph of
    ``compute_count`` compute nodes, as (stage count, most stages a segment may span): on graphs
    of at least 16 compute nodes per first stage, :data:`SHORT_SEGMENT_STAGES_PER_START` times
    ``max_stages`` stages with segments of at most :data:`SHORT_SEGMENT_MAX_STAGES`; on graphs
    where that count doubled stays within half the compute nodes, also the count doubled as far
    as it does, with segments of at most :data:`SHORT_SEGMENT_MAX_STAGES_DEEP`. With
    ``finest`` (the chain DP solves them), last, one stage per compute node (at most
    :data:`FINEST_STAGES`) with segments of at most :data:`FINEST_MAX_SEGMENT_STAGES` or
    :data:`FINEST_SPAN_PAIRS` over the stage count, whichever is more, on any graph of more
    compute nodes than ``max_stages``.

    Example:
        >>> short_segment_shapes(300), short_segment_shapes(755), short_segment_shapes(3912)
        ([], [(256, 8)], [(256, 8), (1024, 6)])
        >>> short_segment_shapes(222, finest=True), short_segment_shapes(1042, finest=True)
        ([(222, 46)], [(256, 8), (512, 6), (1024, 10)])
        >>> short_segment_shapes(3912, finest=True)  # 1,024 stages are there already
        [(256, 8), (1024, 6)]
    """
    stage_count = SHORT_SEGMENT_STAGES_PER_START * max_stages
    shapes: list[tuple[int, int]] = []
    if compute_count >= 2 * stage_count:
        shapes.append((stage_count, SHORT_SEGMENT_MAX_STAGES))
        deep_count = stage_count
        while 4 * deep_count <= compute_count:
            deep_count *= 2
        if deep_count > stage_count:
            shapes.append((deep_count, SHORT_SEGMENT_MAX_STAGES_DEEP))
    finest_count = min(compute_count, FINEST_STAGES)
    if finest and finest_count > max([max_stages, *(count for count, _ in shapes)]):
        shapes.append((finest_count, max(FINEST_MAX_SEGMENT_STAGES, FINEST_SPAN_PAIRS // finest_count)))
    return shapes


def short_segments_plan(graph: CostGraph, stage_count: int, max_segment_stages: int, budget_bytes: int,
                         unoptimized: int, solver: str | None, time_limit_s: float, max_attempts: int,
                         started: float, by_chain_dp: bool = False) -> tuple[Plan | None, int]:
    """The ILP's plan on about ``stage_count`` stages with no segment longer than
    ``max_segment_stages`` of them (a shape from :func:`short_segment_shapes`; stopped after
    :data:`FINER_PASS_NODES` branch-and-bound nodes), or None when it finds none; and how many
    stages that was. On a deep graph the first stages each span a layer or more, and its plan
    is a few segments of several layers that the finer rounds cannot break up (their ILP would
    allow every segment as long as the longest); short segments on many stages end inside
    the layers."""
    stages = build_stages(graph, stage_count)
    model = build_stage_model(graph, stages, max_segment_stages=max_segment_stages)
    try:
        plan = tightened_plan(graph, model, budget_bytes, unoptimized, solver, time_limit_s, max_attempts, started,
                          node_limit=FINER_PASS_NODES, by_chain_dp=by_chain_dp, loosen=True)
    except SolverError as exc:
        log.info("short segments on %d stages: no plan (%s)", len(stages), exc)
        return None, len(stages)
    if plan is None:
        return None, len(stages)
    log.info("short segments on %d stages: %.2f ms", len(stages), plan.recompute_ms)
    return dataclasses.replace(plan, solver=f"{plan.solver} (short segments)"), len(stages)
