"""Choose the segments to recompute: the strategy of :func:`solve`, the planner's one entry point.

The graph is reduced to stages (:mod:`planner.core.stages`) and a linear memory account over their
chain (:mod:`planner.solvers.stage_model`), solved by the chain DP or as an ILP
(:mod:`planner.solvers.stage_plans`, :mod:`planner.solvers.stage_ilp`). :func:`solve` builds plans from several
starts (the first stage model, finer rounds in :mod:`planner.solvers.finer_rounds`, short segments on
many stages), runs the exact search of :mod:`planner.solvers.relaxation` where it pays, and keeps the
cheapest plan whose simulated peak (:func:`planner.core.simulate.simulate`, the judge) is within
the budget; otherwise :class:`InfeasibleBudgetError` names the smallest peak found
(:mod:`planner.solvers.smallest_peak`). See docs/design.md#how-the-planner-decides.

With ``selective=True`` an op-level pass follows (:mod:`planner.solvers.keep`): inside the chosen
segments, node by node, outputs worth more recompute time than the memory they hold are kept
from the forward under a selective checkpoint policy instead of being recomputed.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> plan = solve(g, budget_bytes=9 * 2**20)
    >>> plan.predicted_peak_bytes <= 9 * 2**20 < simulate(g).peak_bytes
    True
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from planner.core.costgraph import CostGraph
from planner.solvers.deadline import SolveDeadline
from planner.core.errors import InfeasibleBudgetError, check_max_stages, check_time_limit
from planner.solvers.hand_policies import hand_placed_candidate, repeated_blocks
from planner.solvers.finer_rounds import FINER_PASS_ROUNDS, FINER_PASS_S, _on_finer_stages
from planner.solvers.keep_round import cheapest_with_kept_outputs
from planner.solvers.stage_ilp import MIP_GAP, _choose_solver, _IlpResult, _run_solver, available_solvers
from planner.core.plan import Plan
from planner.solvers.refine import ALL_CUTS_BELOW, refine_segments
from planner.solvers.relaxation import search_cheapest
from planner.core.simulate import simulate
from planner.solvers.smallest_peak import _exact_search_on, minimum_peak_plan
from planner.solvers.stage_model import StageModel, build_stage_model
from planner.solvers.stage_plans import (_loosened, _segments, _short_segments_plan, _tightened, _to_plan,
                                 short_segment_shapes)
from planner.core.stages import build_stages


__all__ = ["solve", "minimum_peak_plan", "available_solvers", "check_time_limit", "check_max_stages"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Stages per repeated block of the start that resolves each block (docs/tuning.md#stages_per_repeated_block).
STAGES_PER_REPEATED_BLOCK = 16
#: At most this many stages in that start: deeper models get fewer a block, down to
#: :data:`MIN_STAGES_PER_REPEATED_BLOCK` (docs/tuning.md#per_block_start_max_stages).
PER_BLOCK_START_MAX_STAGES = 512
#: Fewest stages a block of the per-block start (docs/tuning.md#per_block_start_max_stages).
MIN_STAGES_PER_REPEATED_BLOCK = 8
#: Most candidate segments of the first finer round after the per-block start, the one round
#: that may go past half the compute nodes (docs/tuning.md#per_block_round_max_candidates).
PER_BLOCK_ROUND_MAX_CANDIDATES = 24_000
#: Branch-and-bound nodes of the first ILP, on ``max_stages`` stages (docs/tuning.md#first_ilp_nodes).
FIRST_ILP_NODES = 200
#: Compute nodes below which the exact search runs by default (docs/tuning.md#exact_by_default_below).
EXACT_BY_DEFAULT_BELOW = 512
#: Share of the budget a plan must leave unused for that default search (docs/tuning.md#exact_when_unused).
EXACT_WHEN_UNUSED = 0.01
#: Seconds the exact search may take when it runs by default (docs/tuning.md#exact_search_s).
EXACT_SEARCH_S = 30.0
#: Seconds the default search may take when a plan is already in hand, so that it can only
#: make that plan cheaper or prove it the cheapest (docs/tuning.md#exact_improve_s).
EXACT_IMPROVE_S = 5.0


def solve(
    graph: CostGraph,
    budget_bytes: int,
    *,
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
    max_attempts: int = 8,
    selective: bool = False,
    refine_s: float = 2.0,
    polish: bool = False,
    exact: bool | None = None,
    finer_s: float = FINER_PASS_S,
    exact_s: float = EXACT_SEARCH_S,
    finer_rounds: int = FINER_PASS_ROUNDS,
    short_segments: bool = True,
    max_solve_s: float | None = None,
) -> Plan:
    """The least-recompute plan whose simulated peak is at most ``budget_bytes``.

    Every stage model below is one ILP (:func:`_solve_ilp`). With ``solver=None`` (default) it
    is solved to its optimum by dynamic programming over the stage chain instead
    (:mod:`planner.solvers.chain_dp`, keep options included; gap 0, no node or time limit, solver name
    ``chain DP``): on 1,000-node GPT-2 graphs the whole solve takes about 2 s where the ILPs
    took 4 to 30 s (docs/benchmarks/solve_time.md). A named ``solver`` ("HiGHS", "CBC") solves every
    model as an ILP, as does the smallest-peak search. What follows says "ILP" for either.
    The DP also solves the first model and the short-segment starts at targets raised above
    the budget and keeps the cheapest plan whose replay fits it (:func:`_loosened`: the
    model's account is conservative).

    The ILP on ``max_stages`` stages stops within 1 % of its optimum (:data:`MIP_GAP`), after
    :data:`FIRST_ILP_NODES` branch-and-bound nodes or at ``time_limit_s``, whichever comes first,
    with its best plan and its proven gap (a search the node limit stops before any plan goes
    on without it). After it finds a plan, an ILP on about twice as many stages
    (every boundary of the plan among them) runs for up to :data:`FINER_PASS_NODES`
    branch-and-bound nodes, and the cheaper plan is kept; this repeats, doubling the stages
    again, up to ``finer_rounds`` times while each round finds a cheaper plan and the stages
    are fewer than the compute nodes, for at most ``finer_s`` seconds in all
    (:func:`_on_finer_stages`; ``finer_s=0`` or ``finer_rounds=0`` turns it off). On graphs of
    at least 16 times ``max_stages`` compute nodes, with ``short_segments``, rounds also start
    from the ILP's plan on 8 times ``max_stages`` stages with short segments, on deeper graphs
    also from more stages (:func:`short_segment_shapes`), and the cheapest end is kept
    (:func:`_short_segments_plan`; segments-only solves; they run where the first ILP found no
    plan too, and the exact search below then looks only for a cheaper one). ``finer_s`` bounds each start's ILP
    and, separately, its rounds: it is a guard, not a limit on the whole solve (on a 24-layer
    GPT-2 at 60 % of its peak the start on 491 stages ran into it, docs/tuning.md#finer_pass_s). With ``exact``
    too, the cheapest of the exact search's plan and the finer passes'.

    ``max_solve_s`` bounds the work after the first ILP's plan: the finer rounds, the
    short-segment starts, the exact search and the cost search run only in what is left of
    ``max_solve_s`` seconds from the start, each cut to fit, and the plan is the cheapest
    found by then (``hit_time_limit`` is set when something was cut). The first ILP (up to
    ``time_limit_s``) and, when it finds no plan, the search for one or for the smallest
    feasible budget are not bounded by it: a plan is never given up for time. ``None``
    (default): no such bound, so the plan does not depend on the machine's speed beyond the
    limits above.

    ``exact`` runs the search of :mod:`planner.solvers.relaxation` after the ILP (on segments-only plans): an optimistic memory
    account, solved and checked against the simulator until a plan fits, which either proves
    the ILP's plan the cheapest over the stages (its ``optimality_gap`` is then the MIP gap
    against the simulator) or finds a cheaper one, also where the ILP found none. ``None``
    (default) runs it on graphs of fewer than 64 compute nodes, where it is quick (seconds at most),
    and on graphs under :data:`EXACT_BY_DEFAULT_BELOW` compute nodes where the ILP's plan
    leaves more than :data:`EXACT_WHEN_UNUSED` of the budget unused (or the ILP found none),
    for at most ``exact_s`` seconds, and at most :data:`EXACT_IMPROVE_S` where a plan is in
    hand: there it saved 14 to 22 % of the recompute on the quality
    models in 0.1 to 2.2 s more, while on plans that filled the budget ``exact=True`` found
    nothing cheaper in 4 to 26 s more (docs/benchmarks/exact_search.md). ``True`` runs it for up to ``time_limit_s``; the smallest-peak search
    that answers an infeasible budget bisects with it only with ``True`` or under 64 nodes.

    When no stage model finds a plan, on graphs of 64 compute nodes or more with ``exact=None``
    the smallest peak (:func:`minimum_peak_plan`) is found first: a budget below it is refused
    without the exact search (on Llama it took 9.5 s to prove that nothing fits), and at or
    above it the search looks only for plans cheaper than the smallest-peak one.

    When the ILP finds no plan, the smallest-peak plan is searched by local moves judged by the
    simulator and, if it fits, made cheaper the same way, for up to ``refine_s`` seconds each
    (:mod:`planner.solvers.refine`); ``refine_s=0`` turns this off. ``polish=True`` also runs the
    cost search on a plan the ILP found: cheaper plans, but on real models they reach parts
    of the graph where the memory model has been less exact (one measured 5.6 % below its
    prediction), so it is off by default.

    With ``selective``, nodes inside the recomputed segments may keep their outputs from the
    forward instead of being re-run (a selective checkpoint policy), chosen per node by
    :func:`planner.solvers.keep.keep_outputs` on the selective model's segments (the chain DP chooses
    segments and keep options together), on the segments-only plan's and, at budgets within
    :data:`planner.solvers.keep_round.KEEP_FROM_SMALLEST_PEAK_WITHIN` of the smallest peak, on the finer segments of the
    smallest-peak plan, whichever ends cheapest; the plan never costs more than the
    segments-only one. Keeping costs the selective policy's dispatch
    time on every node of a segment that keeps anything (``graph.selective_overhead_ms_per_node``);
    it is kept only where it saves more, and when it pays nowhere the plan is the segments-only one.

    Raises:
        InfeasibleBudgetError: no plan found fits; the error names the smallest peak reached.
        SolverError: no solver is installed, or it found nothing in ``time_limit_s``.
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        if not (isinstance(budget_bytes, float) and math.isfinite(budget_bytes)):
            raise ValueError(f"budget_bytes must be a finite number, got {budget_bytes!r}")
        budget_bytes = int(budget_bytes)
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    check_time_limit(time_limit_s)
    check_max_stages(max_stages)
    check_time_limit(exact_s, "exact_s")
    if max_solve_s is not None:
        check_time_limit(max_solve_s, "max_solve_s")
    started = time.perf_counter()
    deadline = SolveDeadline(started, max_solve_s)
    unoptimized = simulate(graph).peak_bytes
    if unoptimized <= budget_bytes:
        return _to_plan(graph, [], budget_bytes, unoptimized, unoptimized, "none", 0.0)
    stages = build_stages(graph, max_stages)
    model = build_stage_model(graph, stages, max_segment_stages=len(stages), selective=selective)
    by_chain_dp = solver is None  # a solver named by the caller solves every stage model
    plan = _tightened(graph, model, budget_bytes, unoptimized, solver, time_limit_s, max_attempts, started,
                      node_limit=FIRST_ILP_NODES, node_limit_needs_plan=True, by_chain_dp=by_chain_dp)
    ilp_found = plan is not None
    # a candidate of its own, and the finer rounds' start where the model found none at the
    # budget; the rounds start from the budget's own plan otherwise (on Llama at 1.03 times its
    # smallest peak, 75.6 ms from it against 76.2 from the raised target's 78.4)
    by_dp = by_chain_dp and (plan is None or plan.by_chain_dp)  # not where the DP was too large
    raised = _loosened(graph, model, plan, budget_bytes, unoptimized, started) if by_dp else plan
    if finer_rounds < 0:
        raise ValueError(f"finer_rounds must be 0 or more, got {finer_rounds}")
    finer = None
    # the short-segment starts run where the first model found no plan too: near the smallest
    # peak its 32 stages can miss a budget their many stages meet (GPT-2 width 768 at 1.005x
    # its smallest peak: 334.4 ms in 1 s, where the exact search took 10 s for 580.6 ms)
    if finer_s > 0 and finer_rounds > 0:
        finer_limit_s = min(finer_s, time_limit_s)
        start = plan if plan is not None else raised
        if start is not None and deadline.allows("the finer rounds"):
            finer = _on_finer_stages(graph, start, len(stages), budget_bytes, unoptimized, selective=selective,
                                     solver=solver, time_limit_s=deadline.cut(finer_limit_s),
                                     max_attempts=max_attempts, started=started, rounds=finer_rounds,
                                     by_chain_dp=by_chain_dp)
        shapes = short_segment_shapes(len(graph.compute_nodes), max_stages, finest=by_chain_dp)
        # a start that resolves every repeated block (a deep model on max_stages stages has
        # several layers a stage, where the hand-placed plans cut at every layer)
        blocks = sum(len(stack) for stack in repeated_blocks(graph))
        stages_a_block = max(MIN_STAGES_PER_REPEATED_BLOCK,
                             min(STAGES_PER_REPEATED_BLOCK, PER_BLOCK_START_MAX_STAGES // max(blocks, 1)))
        per_block = by_chain_dp and blocks and stages_a_block * blocks > len(stages)
        if per_block:
            shapes.insert(0, (stages_a_block * blocks, 2 * stages_a_block))
        for index, (stage_count, max_segment_stages) in enumerate(shapes if short_segments and not selective else []):
            if not deadline.allows(f"the short segments on {stage_count} stages"):
                break
            short, short_stages = _short_segments_plan(graph, stage_count, max_segment_stages, budget_bytes,
                                                       unoptimized, solver, deadline.cut(finer_limit_s),
                                                       max_attempts, started, by_chain_dp)
            # the per-block start's plan cuts near the block boundaries, a few nodes a stage; its
            # first round, on twice the stages, moves the cuts to the node (T5 at every-layer's
            # peak: 0.905 -> 0.868 of its recompute), where other starts' rounds stop at half the nodes
            round_cap = PER_BLOCK_ROUND_MAX_CANDIDATES if per_block and index == 0 else None
            if short is not None and deadline.allows(f"the finer rounds after {short_stages} stages"):
                short = _on_finer_stages(graph, short, short_stages, budget_bytes, unoptimized, selective=False,
                                         solver=solver, time_limit_s=deadline.cut(finer_limit_s),
                                         max_attempts=max_attempts, started=started, rounds=finer_rounds,
                                         every_round_capped=round_cap is None, first_round_max_candidates=round_cap,
                                         by_chain_dp=by_chain_dp)
            if short is not None and (finer is None or short.recompute_ms < finer.recompute_ms):
                finer = short
    if raised is not None and raised is not plan and (finer is None or raised.recompute_ms < finer.recompute_ms):
        finer = raised
    # what a person would write by hand (every k-th layer, matmul outputs kept) is a candidate
    # like any other, so the plan returned never costs more than one of them that fits
    hand = hand_placed_candidate(graph, budget_bytes, unoptimized, started)
    if hand is not None and (finer is None or hand.recompute_ms < finer.recompute_ms) and \
            (plan is None or hand.recompute_ms < plan.recompute_ms):
        finer = hand
    cheaper = plan if finer is None or (plan is not None and plan.recompute_ms <= finer.recompute_ms) else finer
    proven_infeasible = False
    search_s = time_limit_s if exact else min(time_limit_s, exact_s)
    smallest: Plan | None = None
    if cheaper is None and exact is None and not selective and len(graph.compute_nodes) >= ALL_CUTS_BELOW:
        # no stage model found a plan: the smallest peak first, and a budget below it is refused
        # at once (on Llama the exact search took 9.5 s there to prove that no plan fits); at or
        # above it, the exact search looks only for a plan cheaper than the smallest-peak one
        smallest = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                     refine_s=refine_s, exact=False)
        if smallest.predicted_peak_bytes > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, smallest.predicted_peak_bytes)
    in_hand = cheaper or smallest  # the cheapest plan in hand: the exact search's cut-off
    if in_hand is not None:  # with a plan in hand the search only improves it: bounded by the deadline
        search_s = deadline.cut(search_s if exact else min(search_s, EXACT_IMPROVE_S))
    if (not selective and _cost_search_on(graph, exact, cheaper, budget_bytes)
            and (in_hand is None or deadline.allows("the exact search"))):
        log.info("exact search for a cheaper plan (up to %.0f s): %s", search_s,
                 "the stage models found none" if cheaper is None else
                 f"the ILP's plan leaves {1 - cheaper.predicted_peak_bytes / budget_bytes:.1%} of the budget unused")
        plan, proven_infeasible = _cheapest_by_optimistic_account(
            graph, model, plan, budget_bytes, unoptimized, solver, search_s, started,
            incumbent_ms=in_hand.recompute_ms if in_hand is not None else None)
    if finer is not None and (plan is None or finer.recompute_ms < plan.recompute_ms):
        plan = finer  # cheaper than anything on the first stages, the exact search's optimum included
    fallback: Plan | None = None
    if plan is not None:
        # a hand-placed plan is a start for the cost search, as a plan only the search found is
        found_on_stages = (ilp_found or plan is finer) and plan is not hand
        # a plan only the search found gets the cost search the fallback below would get
        if not found_on_stages:
            search_refine_s = refine_s
        else:  # polishing an ILP plan only improves it: bounded by the deadline
            search_refine_s = deadline.cut(refine_s) if polish and deadline.allows("the cost search") else 0.0
        plan = _refined(graph, plan, budget_bytes, search_refine_s, started)
    else:
        fallback = smallest or minimum_peak_plan(
            graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s, refine_s=refine_s,
            exact=_exact_search_on(graph, exact), exact_s=search_s,
            infeasible_bytes=budget_bytes if proven_infeasible else 0,
            lower_by_dp=not selective)  # a selective solve that misses the budget asks the segments-only one
        if fallback.predicted_peak_bytes > budget_bytes:
            if not selective:
                raise InfeasibleBudgetError(budget_bytes, fallback.predicted_peak_bytes)
            plan = None  # the selective ILP (more binaries) can miss a budget the segments-only one meets
        else:
            # the fallback minimised the peak, so no gap on the recompute cost is known
            plan = dataclasses.replace(fallback, budget_bytes=budget_bytes, optimality_gap=None)
            plan = _refined(graph, plan, budget_bytes, refine_s, started)
    if selective:
        # the segments-only optimum is a candidate and a start for keeping: the selective
        # ILP's segments are not always as cheap (GPT-2 at every-layer's peak: 979 against 953 ms)
        try:
            plain = solve(graph, budget_bytes, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                          max_attempts=max_attempts, refine_s=refine_s, polish=polish, exact=exact, finer_s=finer_s,
                          exact_s=exact_s, finer_rounds=finer_rounds, short_segments=short_segments,
                          max_solve_s=deadline.left_s_or_none())
        except InfeasibleBudgetError:
            if plan is None:
                raise
            plain = None
        # when keeping pays nowhere (the policy costs more than it saves) this is the segments-only optimum
        plan = cheapest_with_kept_outputs(graph, [p for p in (plan, plain) if p is not None], budget_bytes, fallback,
                                          max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                          refine_s=refine_s, deadline=deadline)
        plan = dataclasses.replace(plan, solve_s=time.perf_counter() - started)
    if deadline.reached():
        log.info("max_solve_s=%g s reached after %.1f s: the plan is the cheapest found by then (%.2f ms)",
                 max_solve_s, time.perf_counter() - started, plan.recompute_ms)
        plan = dataclasses.replace(plan, hit_time_limit=True)
    return plan


def _cost_search_on(graph: CostGraph, exact: bool | None, plan: Plan | None, budget_bytes: int) -> bool:
    """Whether :func:`solve` runs the exact search for a cheaper plan: ``exact``; by default on
    graphs under 64 compute nodes, and on graphs under :data:`EXACT_BY_DEFAULT_BELOW` compute
    nodes where the ILP found no plan or one that leaves more than :data:`EXACT_WHEN_UNUSED` of
    the budget unused."""
    if exact is not None or len(graph.compute_nodes) < ALL_CUTS_BELOW:
        return _exact_search_on(graph, exact)
    if len(graph.compute_nodes) >= EXACT_BY_DEFAULT_BELOW:
        return False
    return plan is None or plan.predicted_peak_bytes < budget_bytes * (1 - EXACT_WHEN_UNUSED)


def _refined(graph: CostGraph, plan: Plan, budget_bytes: int, refine_s: float, started: float) -> Plan:
    """``plan`` improved by :func:`planner.solvers.refine.refine_segments` when that saves recompute time.
    The ILP's gap no longer bounds a changed plan, so it is then reported as unknown."""
    if refine_s > 0 and plan.segments and not any(s.selective for s in plan.segments):
        segments = refine_segments(graph, plan.segments, budget_bytes, time_limit_s=refine_s)
        cost = sum(s.recompute_ms for s in segments)
        if cost < plan.recompute_ms - 1e-9:
            peak = simulate(graph, segments).peak_bytes
            plan = dataclasses.replace(plan, segments=tuple(segments), predicted_peak_bytes=peak,
                                       optimality_gap=None, solver=f"{plan.solver} + refine")
    return dataclasses.replace(plan, solve_s=time.perf_counter() - started)


def _cheapest_by_optimistic_account(
    graph: CostGraph,
    model: StageModel,
    plan: Plan | None,
    budget_bytes: int,
    unoptimized: int,
    solver: str | None,
    time_limit_s: float,
    started: float,
    incumbent_ms: float | None = None,
) -> tuple[Plan | None, bool]:
    """``plan`` (the ILP's, or None when it found none), or the cheaper plan over the same
    stages that :func:`planner.solvers.relaxation.search_cheapest` finds; a plan the search proves the
    cheapest gets the MIP gap as its optimality gap, measured against the simulator's account.
    And whether the search proved that no plan over the stages fits the budget.
    ``incumbent_ms``: the cost of the cheapest plan in hand, found on these or other stages
    (default: ``plan``'s); the search looks only for cheaper ones (a cut-off in its MILP), so
    finding none proves nothing infeasible, and proves ``plan`` the cheapest only when it is
    the plan in hand."""
    name = _choose_solver(solver)
    if incumbent_ms is None:
        incumbent_ms = plan.recompute_ms if plan is not None else math.inf
    found = search_cheapest(graph, model.stages, budget_bytes, incumbent_ms,
                            lambda prob: _run_solver(prob, name, time_limit_s, presolve=False), time_limit_s=time_limit_s)
    log.info("optimistic account: %d candidates, %s", found.candidates,
             "cheaper plan found" if found.runs is not None else "proven" if found.proven else "stopped")
    if found.runs is None:
        if (plan is not None and found.proven and not plan.hit_time_limit
                and incumbent_ms >= plan.recompute_ms - 1e-9):
            plan = dataclasses.replace(plan, optimality_gap=MIP_GAP)
        return plan, plan is None and found.proven and incumbent_ms == math.inf
    segments = _segments(graph, model, found.runs)
    label = f"{plan.solver if plan is not None else name} + exact"
    return _to_plan(graph, segments, budget_bytes, unoptimized, simulate(graph, segments).peak_bytes, label,
                    time.perf_counter() - started, _IlpResult(found.runs, label, MIP_GAP if found.proven else None,
                                                               found.hit_time_limit)), False
