"""Finer rounds: a plan found on some stages, improved on about twice as many.

Finer stages let a segment end right after a node that saves only its inputs (a linear: its
matmul is never recomputed) where the coarse cuts could not. :func:`on_finer_stages` repeats
the doubling while each round finds a cheaper plan. See docs/design.md#starts-and-rounds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from planner.core.costgraph import CostGraph
from planner.core.errors import SolverError
from planner.core.plan import Plan
from planner.solvers.stage_model import StageModel, build_stage_model
from planner.solvers.stage_plans import FINER_PASS_NODES, tightened_plan
from planner.core.stages import build_stages

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Most candidate segments of a round after the first (docs/tuning.md#finer_round_max_candidates).
FINER_ROUND_MAX_CANDIDATES = 2000


def on_finer_stages(
    graph: CostGraph,
    plan: Plan,
    stage_count: int,
    budget_bytes: int,
    unoptimized: int,
    *,
    selective: bool,
    solver: str | None,
    time_limit_s: float,
    max_attempts: int,
    started: float,
    rounds: int = 1,
    every_round_capped: bool = False,
    first_round_max_candidates: int | None = None,
    by_chain_dp: bool = False,
) -> Plan:
    """``plan`` (found on ``stage_count`` stages), or a cheaper one from the ILP on about twice
    as many stages, every boundary of ``plan`` among them and no segment longer than its
    longest, stopped after :data:`FINER_PASS_NODES` branch-and-bound nodes (HiGHS; CBC has no
    such limit); repeated on twice as many stages again, up to ``rounds`` times in all, while a
    round finds a cheaper plan, the doubled stages would be at most half the compute nodes, the
    ILP would have at most :data:`FINER_ROUND_MAX_CANDIDATES` candidate segments and
    ``time_limit_s`` (for all rounds together) is not spent (docs/tuning.md#finer_pass_rounds
    says why half). With ``every_round_capped`` (a start from :func:`short_segments_plan`, already
    on many stages) the first round is held to the same limits; otherwise the first round may
    have at most ``first_round_max_candidates`` candidate segments (None: no limit). Finer
    stages let a segment end right after a node that saves only its inputs (a linear: its
    matmul is never recomputed) where the coarse cuts could not. Deeper graphs gain from a
    second round (``SolveOptions.finer_rounds``, :data:`planner.core.options.FINER_PASS_ROUNDS`;
    docs/tuning.md#finer_pass_rounds has what each round bought).

    The search does not start from ``plan``: given as a MIP start (``Highs.setSolution``),
    HiGHS's presolve can prove it optimal at the root and return it unchanged, where the same
    model solved without a start finds a cheaper plan within the node limit
    (docs/tuning.md#finer_pass_nodes).
    """
    deadline = time.perf_counter() + time_limit_s
    best = plan
    compute_count = len(graph.compute_nodes)
    for round_index in range(rounds):
        left_s = deadline - time.perf_counter()
        if not best.segments or stage_count >= compute_count or left_s <= 0:
            break
        capped = bool(round_index) or every_round_capped
        if capped and 4 * stage_count > compute_count:
            break  # on more stages than half the compute nodes, a further round rarely pays

        def solve_stages(model: StageModel, limit_s: float = left_s) -> Plan | None:
            return tightened_plan(graph, model, budget_bytes, unoptimized, solver, limit_s, max_attempts, started,
                              node_limit=FINER_PASS_NODES, by_chain_dp=by_chain_dp)

        finer, stage_count = _on_doubled_stages(graph, best, stage_count, solve_stages, selective=selective,
                                                max_candidates=FINER_ROUND_MAX_CANDIDATES if capped
                                                else first_round_max_candidates)
        if finer is None or finer.recompute_ms >= best.recompute_ms:
            break
        log.info("the ILP on %d stages cut the recompute from %.2f to %.2f ms", stage_count, best.recompute_ms,
                 finer.recompute_ms)
        best = finer
    if best is plan:
        return plan
    return dataclasses.replace(best, solver=f"{best.solver} (finer stages)")


def _on_doubled_stages(
    graph: CostGraph,
    plan: Plan,
    stage_count: int,
    solve_stages: Callable[[StageModel], Plan | None],
    *,
    selective: bool,
    max_candidates: int | None = None,
) -> tuple[Plan | None, int]:
    """One round of :func:`on_finer_stages`: the plan ``solve_stages`` finds on about
    ``2 * stage_count`` stages (None when it finds none, or when the ILP would have more than
    ``max_candidates`` candidate segments), and how many stages that was."""
    rank = {n.name: r for r, n in enumerate(graph.compute_nodes)}
    cuts = {rank[s.node_names[0]] for s in plan.segments} | {rank[s.node_names[-1]] + 1 for s in plan.segments}
    stages = build_stages(graph, 2 * stage_count, required_cuts=cuts)
    if len(stages) <= stage_count:
        return None, len(stages)
    first = {st.node_names[0]: j for j, st in enumerate(stages)}
    last = {st.node_names[-1]: j for j, st in enumerate(stages)}
    longest = max(last[s.node_names[-1]] - first[s.node_names[0]] + 1 for s in plan.segments)
    model = build_stage_model(graph, stages, max_segment_stages=longest, selective=selective)
    log.info("finer stages: %d stages, %d candidate segments (none longer than %d stages)", len(stages),
             len(model.segments), longest)
    if max_candidates is not None and len(model.segments) > max_candidates:
        log.info("more than %d candidate segments: no further round", max_candidates)
        return None, len(stages)
    try:
        finer = solve_stages(model)
    except SolverError as exc:
        log.info("the ILP on %d stages found no plan (%s); keeping the plan on %d", len(stages), exc, stage_count)
        return None, len(stages)
    return finer, len(stages)
