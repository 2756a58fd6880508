"""Choose the segments to recompute: an integer linear program over a chain of stages.

The graph is first reduced to stages (:mod:`planner.stages`). A binary variable ``y[a, b]``
says that stages ``a..b`` run as one checkpointed segment. The ILP minimises the forward time
of everything recomputed subject to a memory account at every stage, in the forward and in
the backward. Memory is tracked storage by storage: a continuous ``held[k, j]`` is at least
1 when a stage at or before ``j`` that saves storage ``k`` is not recomputed, or when a
chosen segment starting at or before ``j`` takes ``k`` as an input; ``held`` never
decreases with ``j`` (backward releases a storage only after its earliest holder ran). A
segment being recomputed adds the fresh copies of what its stages up to ``j`` save. Parameter
gradients accumulated so far, gradients in flight and measured temporaries are constants.

The linear account is an approximation; :func:`planner.simulate.simulate` is the judge. Each
solution is replayed there, and when its simulated peak exceeds the budget the ILP is solved
again with the budget lowered by the excess. A plan is returned only when its simulated peak
is within the budget; otherwise :class:`InfeasibleBudgetError` names the smallest peak found.

With ``selective=True`` an op-level pass follows (:mod:`planner.keep`): inside the chosen
segments, node by node, outputs worth more recompute time than the memory they hold are kept
from the forward under a selective checkpoint policy instead of being recomputed.

Example:
    >>> from planner.costgraph import CostGraph, CostNode, Storage
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
import warnings
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import pulp

from planner.chain_dp import ChainSearchTooLarge, cheapest_plan
from planner.costgraph import CostGraph
from planner.deadline import SolveDeadline
from planner.errors import InfeasibleBudgetError, InputError, SolverError
from planner.plan import Plan, Segment
from planner.keep import keep_outputs, keepable_in_segment, segment_with_kept
from planner.highs import NO_PROBING, PlannerHiGHS, stopped_at_node_limit
from planner.refine import ALL_CUTS_BELOW, lower_peak, refine_segments
from planner.relaxation import search_cheapest
from planner.simulate import simulate
from planner.stage_model import StageModel, build_stage_model, holder_groups
from planner.stages import build_stages

__all__ = ["solve", "minimum_peak_plan", "available_solvers", "check_time_limit", "check_max_stages"]

log = logging.getLogger(__name__)

MIB = float(2**20)
#: Relative optimality gap the MIP solvers stop at: plans cost at most 1 % more than the optimum
#: of the ILP (the last few tenths of a percent take most of the solve time).
MIP_GAP = 0.01
#: with ``selective``, the smallest-peak plan is a start for keeping outputs only at budgets up to
#: this multiple of the smallest-peak ILP's peak (before its refinement). On the GPT-2 (widths 256
#: and 768, 4 to 24 layers), Llama, BERT, MLP and 17-layer fake profiles, at 69 budgets from 1.005
#: to 5.8 times the smallest peak, that start was cheaper than the others only at 0.99 times the
#: ILP's peak (GPT-2 width 768: 480.5 against 521.9 ms) and tied at up to 1.02; above that, it cost
#: 0.6 s of ILP, 2 s of refinement and up to 2 s of keep search (README "Solve time")
KEEP_FROM_SMALLEST_PEAK_WITHIN = 1.10
#: the solver name of plans found by :func:`_solve_chain`
CHAIN_DP = "chain DP"
#: the stage model's account is conservative: a plan the chain DP finds at a target this far
#: above the budget can still fit it in the simulator, and cost less (:func:`_loosened`; on the
#: first model and the short-segment starts, not in the finer rounds, where on a 17-layer GPT-2
#: it took 1.2 s more for the same plan). On the residual MLP's 50 stages (its finest start) at
#: 0.63 of its peak 25.8 -> 21.3 ms; on Llama's first 32 stages at 1.01 times its smallest peak
#: a plan where the model found none, and with the finer rounds from it 81.7 ms in 3 to 5 s,
#: where the exact search had taken 5 to 15 s for 84.3 ms
LOOSEN_STEPS = (0.01, 0.02, 0.03, 0.05, 0.08)
#: loosen only models of at most this many candidate segments, where a DP solve takes a
#: fraction of a second: the first model (528 on 32 stages) and the MLP's finest start (1,275
#: on 50 stages), where it paid; not the 24-layer GPT-2's 248-stage start (1,948: 0.7 s for the
#: same plan) nor one stage per node on a 222-node GPT-2 (about 9,000: 1 to 2 s a solve, and
#: nothing cheaper on five profiles)
LOOSEN_MAX_CANDIDATES = 1500
#: after the first raised target whose plan goes over the budget, this many bisection steps
#: between it and the last that fitted (or the budget): the window where plans fit can be
#: narrow (Llama at 1.01 times its smallest peak: no plan at the budget, over at 0.5 % above
#: it, one that fits at 0.25 %)
LOOSEN_BISECT_STEPS = 3
_ACCEPTED = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
#: each ILP on finer stages stops after this many branch-and-bound nodes (an effort limit: the
#: same plan on every machine); all of them together stop after this many seconds (a guard)
FINER_PASS_NODES = 100
FINER_PASS_S = 20.0
#: the first ILP (on ``max_stages`` stages) stops after this many branch-and-bound nodes with its
#: best plan and proven gap: HiGHS finds its plan at the root and may then spend minutes proving
#: it. On a 24-layer GPT-2 (1,042 compute nodes) it found its plan within 0.3 s and was still
#: 4.4 % from proving it when its 60 s time limit stopped it; at 13 budgets from 30 to 90 % of
#: the peak, 200 nodes gave the same plans in at most 4.1 s where 4 solves had run into the 60 s
#: limit, and the whole solve's plans were the same on 42 graph-budget pairs (README, "Solve time")
FIRST_ILP_NODES = 200
#: how many times the stages are doubled after the first ILP, while each doubling finds a cheaper
#: plan: on a 12-layer GPT-2 (550 compute nodes) at half its peak the second doubling cut the
#: predicted recompute from 18.2 % to 15.2 % of the step, on the 1,000-node graph of
#: ``benchmarks/solve_time.py`` from 17.7 % to 9.6 %, that whole solve taking 2.9 s (README,
#: "How the planner decides")
FINER_PASS_ROUNDS = 2
#: a finer round after the first runs only on at most this many candidate segments: the good
#: second rounds had 1,242 to 1,540 (0.4 to 1.5 s), while on the 5,000-node graph's, with 3,968,
#: HiGHS found no plan within the 17 s left of ``finer_s``
FINER_ROUND_MAX_CANDIDATES = 2000
#: on graphs of at least twice as many compute nodes as these stages, the finer rounds may also
#: start from the ILP's plan on 8 times ``max_stages`` stages with segments of at most 8 of them
#: (:func:`_short_segments_plan`), when it is cheaper than the first plan: on fake-profiled GPT-2
#: graphs of 17, 48 and 94 layers (755 to 3,912 compute nodes) it predicted 3.3 to 6.8 % of the
#: step at 70 % of the peak where the first plans predicted 10.0 to 12.1 %, in 1 to 2 s
SHORT_SEGMENT_STAGES_PER_START = 8
SHORT_SEGMENT_MAX_STAGES = 8
#: on deeper graphs the short segments also start from the count doubled while it stays within
#: half the compute nodes (about 3 to 4 nodes a stage), with segments of at most this many
#: stages: on the 94-layer graph 256 stages are under 3 a layer (11.5 % of the step at 70 %),
#: while 1,024 with segments of at most 6 predicted 3.7 % in 11 s (at most 8: 3.9 % in 12 s, and
#: 26 s at 40 %). It is a second start, not a replacement: on the 4-layer GPT-2 profile with 4
#: first stages (the same shapes scaled down) the rounds from the first start were cheaper at
#: three budgets of four
SHORT_SEGMENT_MAX_STAGES_DEEP = 6
#: with the chain DP, a last start on one stage per compute node (at most this many stages)
#: with segments of at most :data:`FINEST_MAX_SEGMENT_STAGES`: too many binaries for the ILP,
#: about a second for the DP (2,048 on a 94-layer graph took 16 to 21 s more and only once
#: found a cheaper plan). On saved profiles at 40 to 80 % of the peak it cut the
#: predicted recompute of a 4-layer GPT-2 by 0 to 39 % (most where the budget is roomy) and of
#: 12- and 24-layer GPT-2s by up to 21 and 27 % (README "How the planner decides")
FINEST_STAGES = 1024
FINEST_MAX_SEGMENT_STAGES = 10
#: on fewer stages the finest start's segments may span up to this many stage pairs divided by
#: the stage count (46 stages on a 222-node GPT-2, 13 on 755 nodes, 10 from 1,024): the DP's
#: work grows with stages times span. On the quality models' profiles at 45 to 80 % of their
#: peak it cut GPT-2 width 768 at half its peak from 305.2 to 286.0 ms and BERT at 80 % from
#: 47.1 to 45.3, never cost more, and took 1 to 3 s where the whole solve took 0.2 to 0.7 s
FINEST_SPAN_PAIRS = 10_240
#: :func:`minimum_peak_plan` lowers its peak with the chain DP's starts: first at
#: budgets this fraction below the lowest peak so far (the step doubling while a plan is
#: found), then by bisection to within :data:`DP_DESCENT_PRECISION` of the lowest peak, for
#: at most :data:`DP_DESCENT_S` seconds
DP_DESCENT_FIRST_STEP = 0.01
DP_DESCENT_PRECISION = 0.005
DP_DESCENT_S = 30.0
#: replays each start may tighten its target after (:func:`solve`'s default ``max_attempts``)
DP_DESCENT_ATTEMPTS = 8
#: by default the exact search (:mod:`planner.relaxation`) also runs on graphs of 64 up to this
#: many compute nodes, when the ILP's plan leaves more than :data:`EXACT_WHEN_UNUSED` of the
#: budget unused: the ILP's conservative account passed over room there, which the search's
#: optimistic account finds (Llama at every-layer's peak: 69.0 -> 59.5 ms; GPT-2 width 768 at
#: half its peak: 480.8 -> 377.2 ms; on plans that left under 1 % unused it found nothing cheaper)
EXACT_BY_DEFAULT_BELOW = 512
EXACT_WHEN_UNUSED = 0.01
#: seconds the exact search may take when it runs by default (``exact=None``)
EXACT_SEARCH_S = 30.0


def available_solvers() -> list[str]:
    """Names of the MILP solvers PuLP can run here, best first."""
    names = []
    if PlannerHiGHS(msg=False).available():  # not after a stuck solve was abandoned
        names.append("HiGHS")
    if _cbc(0).available():
        names.append("CBC")
    return names


def _cbc(time_limit_s: float) -> pulp.LpSolver:
    """PuLP's bundled CBC (its class is deprecated in PuLP 3.x in favour of a separate install)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s or None, gapRel=MIP_GAP)


#: Every solver this module can drive, best first, with what to install when it is missing.
KNOWN_SOLVERS = {"HiGHS": "pip install highspy", "CBC": "pip install pulp (its wheels bundle CBC)"}


def check_max_stages(max_stages: int) -> None:
    """Raise :class:`InputError` unless ``max_stages`` is a positive integer.

    Example:
        >>> check_max_stages(32)
        >>> check_max_stages(0)
        Traceback (most recent call last):
        ...
        planner.errors.InputError: max_stages must be a positive integer (32 by default), got 0
    """
    if isinstance(max_stages, bool) or not isinstance(max_stages, int) or max_stages < 1:
        raise InputError(f"max_stages must be a positive integer (32 by default), got {max_stages!r}")


def check_time_limit(time_limit_s: float, name: str = "time_limit_s") -> None:
    """Raise :class:`InputError` unless ``time_limit_s`` is a positive, finite number of seconds.

    Example:
        >>> check_time_limit(10.0)
        >>> check_time_limit(0, "max_solve_s")
        Traceback (most recent call last):
        ...
        planner.errors.InputError: max_solve_s must be a positive number of seconds, got 0
    """
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0 \
            or not math.isfinite(time_limit_s):
        raise InputError(f"{name} must be a positive number of seconds, got {time_limit_s!r}")


def _choose_solver(name: str | None) -> str:
    """The requested solver, or the best installed one when it is None or missing here.

    An unknown name raises; a known solver that is not installed falls back to another with a
    warning that says what to install; no solver at all raises :class:`SolverError`.
    """
    if name is not None and name not in KNOWN_SOLVERS:
        raise SolverError(f"unknown solver {name!r}; choose one of {sorted(KNOWN_SOLVERS)} or None for the best installed")
    names = available_solvers()
    if not names:
        raise SolverError("no MILP solver is available: " + " or ".join(KNOWN_SOLVERS.values()))
    chosen = name or names[0]
    if chosen not in names:
        if chosen == "HiGHS" and PlannerHiGHS.abandoned:
            log.info("HiGHS is off for this process (%s); using %s", PlannerHiGHS.abandoned[0], names[0])
        else:
            log.warning("solver %s is not installed (%s); using %s", chosen, KNOWN_SOLVERS[chosen], names[0])
        chosen = names[0]
    return chosen


def _solver_named(name: str, time_limit_s: float, presolve: bool = True, node_limit: int | None = None) -> pulp.LpSolver:
    """The solver ``name``; ``node_limit``: HiGHS stops after that many branch-and-bound nodes
    (:mod:`planner.highs`; CBC ignores it)."""
    if name == "HiGHS":
        options: dict[str, Any] = dict(NO_PROBING) if presolve else {"presolve": "off"}
        if node_limit is not None:
            options["mip_max_nodes"] = node_limit
        return PlannerHiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=MIP_GAP, **options)
    return _cbc(time_limit_s)


@dataclass(frozen=True)
class _IlpResult:
    """One ILP solve: the chosen ``(first_stage, last_stage)`` runs and how the solver ended."""

    chosen: list[tuple[int, int]]
    solver: str
    #: proven relative gap between this solution and the best bound; None when not known
    gap: float | None
    hit_time_limit: bool
    #: nodes the chosen keep options keep (selective models only)
    kept: frozenset[str] = frozenset()


def _run_solver(prob: pulp.LpProblem, name: str, time_limit_s: float, presolve: bool = True,
                node_limit: int | None = None) -> str:
    """Solve ``prob`` with ``name``; when that solver fails to run, with another installed one.
    ``presolve=False`` turns HiGHS's presolve off (the exact search's models: on one of them
    HiGHS 1.16.0's presolve ran for over 13 minutes past a 3 s time limit, while the solve
    without it took 0.16 s)."""
    try:
        prob.solve(_solver_named(name, time_limit_s, presolve, node_limit))
        return name
    except pulp.PulpSolverError as exc:
        others = [other for other in available_solvers() if other != name]
        if not others:
            raise SolverError(f"{name} failed to run ({exc}); install another: "
                              + " or ".join(KNOWN_SOLVERS[k] for k in KNOWN_SOLVERS if k != name)) from exc
        log.warning("%s failed to run (%s); retrying with %s", name, exc, others[0])
        prob.solve(_solver_named(others[0], time_limit_s, presolve))
        return others[0]


def solved_lp_relaxation(prob: pulp.LpProblem, time_limit_s: float = 0.0) -> pulp.LpProblem:
    """A copy of ``prob`` with every variable continuous, solved by CBC (0: no time limit);
    its optimum, when its status is optimal, bounds ``prob``'s from below."""
    relaxed = prob.deepcopy()
    for var in relaxed.variables():
        var.cat = pulp.LpContinuous
    relaxed.solve(_cbc(time_limit_s))
    return relaxed


def _proven_gap(prob: pulp.LpProblem, name: str, objective: float, hit_time_limit: bool) -> float | None:
    """Relative gap between ``objective`` and the solver's best bound (HiGHS reports it; for CBC
    a time-limited solve is bounded by the LP relaxation, an optimal one by the requested gap)."""
    if name == "HiGHS" and getattr(prob, "solverModel", None) is not None:
        gap = float(prob.solverModel.getInfo().mip_gap)
        return gap if math.isfinite(gap) else None
    if not hit_time_limit:
        return MIP_GAP
    relaxed = solved_lp_relaxation(prob)
    bound = pulp.value(relaxed.objective)
    if relaxed.status != pulp.LpStatusOptimal or bound is None or objective <= 0:
        return None
    return max(0.0, (objective - bound) / objective)


def _variable(prob: pulp.LpProblem, name: str, **kwargs: object) -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP 3.3+), or a free-standing one on older PuLP."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kwargs)
    return pulp.LpVariable(name, **kwargs)


def _solve_ilp(
    model: StageModel,
    budget_mib: float | None,
    solver_name: str | None,
    time_limit_s: float,
    node_limit: int | None = None,
    node_limit_needs_plan: bool = False,
) -> _IlpResult | None:
    """Solve once. ``budget_mib=None`` minimises the peak instead of the recompute time.
    ``node_limit``: HiGHS stops after that many branch-and-bound nodes with the best plan found.
    With ``node_limit_needs_plan``, a search the node limit stopped before any plan goes on
    without it for what is left of ``time_limit_s`` (the first ILP: a node limit there bounds
    the proof, not the search for a plan).

    Returns the chosen segments and how the solve ended, or None when the model is infeasible.
    A time limit that stops the solver with a feasible solution returns it with its gap; one
    that stops it with none raises :class:`SolverError`.
    """
    k_count = len(model.stages)
    segs = model.segments
    name = _choose_solver(solver_name)
    prob = pulp.LpProblem("checkpoint_plan", pulp.LpMinimize)
    y = {s: _variable(prob, f"recompute_stages_{s[0]}_to_{s[1]}", cat="Binary") for s in segs}
    total_ms = sum(model.time_ms) or 1.0
    cost = pulp.lpSum(y[s] * (model.run_ms[s] + 1e-3 * total_ms) for s in segs)
    if budget_mib is None:
        peak = _variable(prob, "peak_mib", lowBound=0)
        bound: pulp.LpAffineExpression | float = peak
        # ties broken by recomputed FLOPs, not measured time, so that the minimum does not move
        # with timing noise between two profiles of the same model
        total_flops = float(sum(model.flops)) or 1.0
        flop_cost = pulp.lpSum(y[s] * (model.run_flops[s] / total_flops + 1e-3) for s in segs)
        prob += peak + 1e-6 * flop_cost
    else:
        bound = budget_mib
    covering: list[list[tuple[int, int]]] = [[] for _ in range(k_count)]
    for a, b in segs:
        for j in range(a, b + 1):
            covering[j].append((a, b))
    # recomputed[j]: stage j is in a chosen segment (at most one). A variable of its own, so that
    # the many terms that read it hold one coefficient each instead of a sum over the segments
    cov: list[Any] = []
    for j in range(k_count):
        if covering[j]:
            c = _variable(prob, f"recomputed_{j}", lowBound=0, upBound=1)
            prob += c == pulp.lpSum(y[s] for s in covering[j]), f"one_segment_covers_stage_{j}"
            cov.append(c)
        else:
            cov.append(0)
    keep = {(j, o): _variable(prob, f"keep_option_{o}_in_stage_{j}", cat="Binary")
            for j, options in enumerate(model.keep_options) for o in range(len(options))}
    for j, options in enumerate(model.keep_options):
        if options:
            prob += pulp.lpSum(keep[(j, o)] for o in range(len(options))) <= cov[j], f"keep_only_if_recomputed_{j}"
        ends_here = pulp.lpSum(y[(a, b)] for (a, b) in covering[j] if b == j)
        for o, option in enumerate(options):
            if not option.ends_segment_allowed:
                prob += keep[(j, o)] <= cov[j] - ends_here, f"keep_option_{o}_in_stage_{j}_not_at_segment_end"
    if budget_mib is not None:
        prob += cost - pulp.lpSum(var * model.keep_options[j][o].saved_ms for (j, o), var in keep.items())

    # held[g][j]: the storages of group g are still held when stage j runs backward (and at the
    # end of its forward). Storages with the same holders form one group; a group with a single
    # holder needs no variable: it is held exactly while that holder is.
    groups = holder_groups(model)

    def holder_expr(kind: str, ref: Any) -> Any:
        if kind == "saver":
            return 1 - cov[ref]
        if kind == "kept":
            return keep[ref]
        return y[ref]

    # what stage j's account adds: single-holder groups from their first stage on, through a
    # running sum (one term each, not one per later stage), and one held variable per
    # multi-holder group and stage up to its last holder's, then the last one in the running sum;
    # ``crossing[j]``: held terms whose storages are live across j
    # in the forward anyway (the forward account counts those in ``forward_live``)
    single_from: list[list[Any]] = [[] for _ in range(k_count)]
    held_terms: list[list[Any]] = [[] for _ in range(k_count)]
    crossing: list[list[Any]] = [[] for _ in range(k_count)]
    for g, (holders, keys) in enumerate(groups.items()):
        mib = sum(model.sizes[k] for k in keys)
        first = min(pos for pos, _, _ in holders)
        if len(holders) == 1:
            expr = holder_expr(holders[0][1], holders[0][2])
            single_from[first].append(mib * expr)
            for j in range(first, k_count):
                live_mib = sum(model.sizes[k] for k in keys if k in model.forward_live_keys[j])
                if live_mib:
                    crossing[j].append(live_mib * expr)
            continue
        by_pos: dict[int, list[tuple[str, object]]] = {}
        for pos, kind, ref in holders:
            by_pos.setdefault(pos, []).append((kind, ref))
        last = max(by_pos)
        h: Any = None
        for j in range(first, k_count):
            if j <= last:  # past its last holder a group's held value no longer changes
                previous, h = h, _variable(prob, f"held_group_{g}_at_{j}", lowBound=0, upBound=1)
                if previous is not None:
                    prob += h >= previous, f"held_group_{g}_stays_{j}"
                for n, (kind, ref) in enumerate(by_pos.get(j, [])):
                    prob += h >= holder_expr(kind, ref), f"held_group_{g}_by_{kind}_{j}_{n}"
                if j < last:
                    held_terms[j].append(mib * h)
                else:
                    single_from[j].append(mib * h)
            live_mib = sum(model.sizes[k] for k in keys if k in model.forward_live_keys[j])
            if live_mib:
                crossing[j].append(live_mib * h)
    single_held: Any = 0
    opened: Any = 0
    for j in range(k_count):
        if single_from[j]:
            running = _variable(prob, f"held_by_one_holder_at_{j}", lowBound=0)
            prob += running == single_held + pulp.lpSum(single_from[j]), f"held_by_one_holder_from_{j}"
            single_held = running
        starting = [y[s] for s in segs if s[0] == j]
        if starting and model.segment_overhead:
            count = _variable(prob, f"segments_started_by_{j}", lowBound=0)
            prob += count == opened + pulp.lpSum(starting), f"segments_started_by_{j}"
            opened = count
        stored = single_held + pulp.lpSum(held_terms[j])
        stored_not_live = stored - pulp.lpSum(crossing[j])
        open_segments = opened * model.segment_overhead
        prob += (
            model.base + model.forward_live[j] + stored_not_live + model.forward_transient[j]
            + open_segments <= bound,
            f"forward_stage_{j}",
        )
        recompute = pulp.lpSum(model.recomputed[(s[0], j)] * y[s] for s in covering[j])
        prob += (
            model.base + model.param_grads[j] + model.grads_in_flight[j] + stored + recompute
            + open_segments <= bound,
            f"backward_stage_{j}",
        )
    solve_started = time.perf_counter()
    name = _run_solver(prob, name, time_limit_s, node_limit=node_limit)
    if node_limit_needs_plan and prob.sol_status == pulp.LpSolutionNoSolutionFound and stopped_at_node_limit(prob):
        left_s = time_limit_s - (time.perf_counter() - solve_started)
        log.info("%s found no plan in %d branch-and-bound nodes; going on for up to %.1f s", name, node_limit,
                 left_s)
        if left_s > 0:
            name = _run_solver(prob, name, left_s)
    if prob.sol_status not in _ACCEPTED:
        if prob.sol_status == pulp.LpSolutionNoSolutionFound and prob.status != pulp.LpStatusInfeasible:
            raise SolverError(
                f"{name} found no feasible plan within time_limit_s={time_limit_s:g}; raise time_limit_s "
                f"or the budget"
            )
        return None
    stopped_early = prob.sol_status == pulp.LpSolutionIntegerFeasible
    hit_time_limit = stopped_early and not stopped_at_node_limit(prob)  # the finer pass's effort limit
    chosen = [(a, b) for (a, b) in segs if (y[(a, b)].value() or 0) > 0.5]
    kept = frozenset(node for (j, o), var in keep.items() if (var.value() or 0) > 0.5
                     for node in model.keep_options[j][o].node_names)
    gap = _proven_gap(prob, name, float(pulp.value(prob.objective) or 0.0), stopped_early)
    gap_text = "unknown" if gap is None else f"{gap:.1%}"
    if hit_time_limit:
        log.warning("%s stopped at its time limit (%g s) with a feasible plan; proven gap %s", name, time_limit_s,
                    gap_text)
    elif stopped_early:
        log.info("%s stopped at its node limit with a feasible plan; proven gap %s", name, gap_text)
    return _IlpResult(sorted(chosen), name, gap, hit_time_limit, kept)


def _solve_chain(model: StageModel, budget_mib: float) -> _IlpResult | None:
    """The same model as :func:`_solve_ilp` at ``budget_mib``, solved to its optimum by dynamic
    programming over the stage chain (:mod:`planner.chain_dp`), keep options included; None
    when no plan fits."""
    plan = cheapest_plan(model, budget_mib)
    if plan is None:
        return None
    kept = frozenset(name for j, o in plan.keeps for name in model.keep_options[j][o].node_names)
    return _IlpResult(plan.segments, CHAIN_DP, 0.0, False, kept)


def _segments(graph: CostGraph, model: StageModel, chosen: list[tuple[int, int]],
              kept: frozenset[str] = frozenset()) -> list[Segment]:
    """The chosen ``(first_stage, last_stage)`` runs as Segments with their recompute cost,
    keeping the outputs of the nodes in ``kept`` that a selective policy can keep there."""
    out = []
    for a, b in sorted(chosen):
        names = tuple(n for st in model.stages[a : b + 1] for n in st.node_names)
        out.append(segment_with_kept(graph, names, kept & set(keepable_in_segment(graph, names))))
    return out


def _to_plan(
    graph: CostGraph,
    segments: list[Segment],
    budget_bytes: int,
    unoptimized_peak_bytes: int,
    peak_bytes: int,
    solver: str,
    solve_s: float,
    result: _IlpResult | None = None,
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
    )


def minimum_peak_plan(
    graph: CostGraph,
    *,
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
    refine_s: float = 2.0,
    exact: bool | None = None,
    exact_s: float | None = None,
    infeasible_bytes: int = 0,
    lower_by_dp: bool = True,
) -> Plan:
    """The plan with the smallest peak found, whatever it costs: the ILP's, lowered further by
    local moves judged by the simulator (:func:`planner.refine.lower_peak`, up to ``refine_s``)
    and, with ``exact`` (default: graphs under 64 compute nodes), by bisecting the budget with
    the search of :mod:`planner.relaxation`, which makes it the smallest over the stages (within
    0.1 %) unless the bisection runs out of ``exact_s`` seconds (default ``time_limit_s``) first.
    ``infeasible_bytes``: a budget already proven to fit no plan over the stages (the bisection
    starts above it).

    With ``lower_by_dp`` and no ``solver`` named (the chain DP's path), it is then lowered by
    the chain DP's starts of :func:`solve` (:func:`_lowest_by_dp_starts`): the first stage
    model at targets raised above the budget and, on deep graphs, the starts on many short
    stages meet budgets below the ILP's smallest peak (fake-profiled GPT-2s of 17 and 94
    layers: 33.8 and 29.7 % of their peak against 34.5 and 31.1 %).

    Its ``predicted_peak_bytes`` is the smallest budget :func:`solve` accepts.

    Example:
        >>> from planner.costgraph import CostGraph, CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 9):
        ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
        ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
        >>> lowest = minimum_peak_plan(g)
        >>> lowest.predicted_peak_bytes < simulate(g).peak_bytes
        True
        >>> solve(g, lowest.predicted_peak_bytes).predicted_peak_bytes <= lowest.predicted_peak_bytes
        True
    """
    check_time_limit(time_limit_s)
    check_max_stages(max_stages)
    if exact_s is not None:
        check_time_limit(exact_s, "exact_s")
    started = time.perf_counter()
    stages = build_stages(graph, max_stages)
    model = build_stage_model(graph, stages, max_segment_stages=len(stages))
    unoptimized = simulate(graph).peak_bytes
    result = _solve_ilp(model, None, solver, time_limit_s)
    if result is None:  # pragma: no cover - minimising the peak is always feasible
        raise SolverError("the minimum-peak model was reported infeasible")
    segments = _segments(graph, model, result.chosen, result.kept)
    if refine_s > 0:
        starts = [segments]
        if len(graph.compute_nodes) < ALL_CUTS_BELOW:  # small: also descend from no and from full recompute
            starts += [[], _every_recomputable_run(graph)]
        lowered = [lower_peak(graph, start, time_limit_s=refine_s / len(starts)) for start in starts]
        segments = min(lowered, key=lambda segs: (simulate(graph, segs).peak_bytes, sum(s.recompute_ms for s in segs)))
    peak = simulate(graph, segments).peak_bytes
    if peak > unoptimized:
        segments, peak = [], unoptimized
    if _exact_search_on(graph, exact) and segments:
        segments, peak = _lowest_by_bisection(graph, model, segments, peak, solver,
                                              time_limit_s if exact_s is None else exact_s, infeasible_bytes)
    if lower_by_dp and solver is None and segments:
        segments, peak = _lowest_by_dp_starts(graph, model, segments, peak, unoptimized, max_stages,
                                              min(time_limit_s, DP_DESCENT_S), started)
    return _to_plan(graph, segments, peak, unoptimized, peak, result.solver, time.perf_counter() - started, result)


def _exact_search_on(graph: CostGraph, exact: bool | None) -> bool:
    """``exact``, or by default whether the graph is small enough (under 64 compute nodes) for
    the exact search to be quick (0.01 to 0.05 s on random graphs of 10 to 14 nodes; on a
    50-node residual MLP 0.2 to 3 s, most near its smallest peak)."""
    return len(graph.compute_nodes) < ALL_CUTS_BELOW if exact is None else exact


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


def _lowest_by_bisection(graph: CostGraph, model: StageModel, segments: list[Segment], peak: int,
                         solver: str | None, time_limit_s: float,
                         infeasible_bytes: int = 0) -> tuple[list[Segment], int]:
    """Lower the smallest peak found by bisecting the budget with the optimistic account's
    search (:func:`planner.relaxation.search_cheapest`): a budget it proves that no plan over
    the stages fits is a lower end, a plan it finds is a new upper end. Starts above
    ``infeasible_bytes`` (a budget proven to fit no plan) or the persistent bytes. Stops within
    0.1 % of the smallest peak over the stages, at the first search that neither finds nor
    proves, or after ``time_limit_s`` for all searches together: just below the smallest peak
    a search can replay its 32 candidates without either (on a 27-node graph, 2 s each)."""
    name = _choose_solver(solver)
    deadline = time.perf_counter() + time_limit_s
    low = max(graph.persistent_bytes, infeasible_bytes + 1)
    while peak - low > peak // 1000 and (left_s := deadline - time.perf_counter()) > 0:
        middle = (low + peak) // 2
        found = search_cheapest(graph, model.stages, middle, math.inf,
                                lambda prob: _run_solver(prob, name, left_s, presolve=False), time_limit_s=left_s)
        if found.runs is not None:
            segments = _segments(graph, model, found.runs)
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
    finest), each at targets raised above the budget too (:func:`_loosened`: the models' account
    is conservative, so their plans can peak below the smallest peak the ILP minimises). Budgets
    :data:`DP_DESCENT_FIRST_STEP` below the lowest peak so far, the step doubling while a start
    finds a plan, then bisected between the last budget where none did and the lowest peak, to
    within :data:`DP_DESCENT_PRECISION` of it or until ``time_limit_s`` runs out. A budget is met
    when any start's plan fits it in the simulator, as in :func:`solve`, so the peak this
    returns is one :func:`solve` meets too (its fallback, this search, finds the same plan)."""
    # not the finest start: on the 4-layer quality models it found no lower peak, at 2 to 6 s a
    # budget; the shapes above it found every lower one measured (17 to 94 layers)
    shapes = short_segment_shapes(len(graph.compute_nodes), max_stages)
    deadline = time.perf_counter() + time_limit_s

    def first_plan_at(budget_bytes: int) -> Plan | None | bool:
        """The first start's plan that fits ``budget_bytes``; None when no start finds one;
        False when time ran out before every start was tried."""
        left_s = deadline - time.perf_counter()
        if left_s <= 0:
            return False
        try:
            plan = _tightened(graph, model, budget_bytes, unoptimized, None, left_s, DP_DESCENT_ATTEMPTS,
                              started, by_chain_dp=True, loosen=True)
        except SolverError:  # the model was too large for the DP and its ILP found nothing in time
            plan = None
        if plan is not None:
            return plan
        for stage_count, max_segment_stages in shapes:
            left_s = deadline - time.perf_counter()
            if left_s <= 0:
                return False
            plan, _ = _short_segments_plan(graph, stage_count, max_segment_stages, budget_bytes, unoptimized,
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
    (:mod:`planner.chain_dp`, keep options included; gap 0, no node or time limit, solver name
    ``chain DP``): on 1,000-node GPT-2 graphs the whole solve takes about 2 s where the ILPs
    took 4 to 30 s (README "Solve time"). A named ``solver`` ("HiGHS", "CBC") solves every
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
    GPT-2 at 60 % of its peak the start on 491 stages ran into it, README "Solve time"). With ``exact``
    too, the cheapest of the exact search's plan and the finer passes'.

    ``max_solve_s`` bounds the work after the first ILP's plan: the finer rounds, the
    short-segment starts, the exact search and the cost search run only in what is left of
    ``max_solve_s`` seconds from the start, each cut to fit, and the plan is the cheapest
    found by then (``hit_time_limit`` is set when something was cut). The first ILP (up to
    ``time_limit_s``) and, when it finds no plan, the search for one or for the smallest
    feasible budget are not bounded by it: a plan is never given up for time. ``None``
    (default): no such bound, so the plan does not depend on the machine's speed beyond the
    limits above.

    ``exact`` runs the search of :mod:`planner.relaxation` after the ILP (on segments-only plans): an optimistic memory
    account, solved and checked against the simulator until a plan fits, which either proves
    the ILP's plan the cheapest over the stages (its ``optimality_gap`` is then the MIP gap
    against the simulator) or finds a cheaper one, also where the ILP found none. ``None``
    (default) runs it on graphs of fewer than 64 compute nodes, where it is quick (seconds at most),
    and on graphs under :data:`EXACT_BY_DEFAULT_BELOW` compute nodes where the ILP's plan
    leaves more than :data:`EXACT_WHEN_UNUSED` of the budget unused (or the ILP found none),
    for at most ``exact_s`` seconds: there it saved 14 to 22 % of the recompute on the quality
    models in 0.1 to 2.2 s more, while on plans that filled the budget ``exact=True`` found
    nothing cheaper in 4 to 26 s more (``benchmarks/exact_search.py``, README). ``True`` runs it for up to ``time_limit_s``; the smallest-peak search
    that answers an infeasible budget bisects with it only with ``True`` or under 64 nodes.

    When no stage model finds a plan, on graphs of 64 compute nodes or more with ``exact=None``
    the smallest peak (:func:`minimum_peak_plan`) is found first: a budget below it is refused
    without the exact search (on Llama it took 9.5 s to prove that nothing fits), and at or
    above it the search looks only for plans cheaper than the smallest-peak one.

    When the ILP finds no plan, the smallest-peak plan is searched by local moves judged by the
    simulator and, if it fits, made cheaper the same way, for up to ``refine_s`` seconds each
    (:mod:`planner.refine`); ``refine_s=0`` turns this off. ``polish=True`` also runs the
    cost search on a plan the ILP found: cheaper plans, but on real models they reach parts
    of the graph where the memory model has been less exact (one measured 5.6 % below its
    prediction), so it is off by default.

    With ``selective``, nodes inside the recomputed segments may keep their outputs from the
    forward instead of being re-run (a selective checkpoint policy), chosen per node by
    :func:`planner.keep.keep_outputs` on the selective model's segments (the chain DP chooses
    segments and keep options together), on the segments-only plan's and, at budgets within
    :data:`KEEP_FROM_SMALLEST_PEAK_WITHIN` of the smallest peak, on the finer segments of the
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
    by_dp = by_chain_dp and (plan is None or plan.solver.startswith(CHAIN_DP))  # not where the DP was too large
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
        for stage_count, max_segment_stages in (short_segment_shapes(len(graph.compute_nodes), max_stages,
                                                                     finest=by_chain_dp)
                                                if short_segments and not selective else []):
            if not deadline.allows(f"the short segments on {stage_count} stages"):
                break
            short, short_stages = _short_segments_plan(graph, stage_count, max_segment_stages, budget_bytes,
                                                       unoptimized, solver, deadline.cut(finer_limit_s),
                                                       max_attempts, started, by_chain_dp)
            if short is not None and deadline.allows(f"the finer rounds after {short_stages} stages"):
                short = _on_finer_stages(graph, short, short_stages, budget_bytes, unoptimized, selective=False,
                                         solver=solver, time_limit_s=deadline.cut(finer_limit_s),
                                         max_attempts=max_attempts, started=started, rounds=finer_rounds,
                                         every_round_capped=True, by_chain_dp=by_chain_dp)
            if short is not None and (finer is None or short.recompute_ms < finer.recompute_ms):
                finer = short
    if raised is not None and raised is not plan and (finer is None or raised.recompute_ms < finer.recompute_ms):
        finer = raised
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
        search_s = deadline.cut(search_s)
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
        found_on_stages = ilp_found or plan is finer
        plan = dataclasses.replace(plan, solver=plan.solver.removesuffix(" (tightened)"))
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
        plan = _with_kept_outputs(graph, [p for p in (plan, plain) if p is not None], budget_bytes, fallback,
                                  max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                  refine_s=refine_s, deadline=deadline)
        plan = dataclasses.replace(plan, solve_s=time.perf_counter() - started)
    if deadline.reached():
        log.info("max_solve_s=%g s reached after %.1f s: the plan is the cheapest found by then (%.2f ms)",
                 max_solve_s, time.perf_counter() - started, plan.recompute_ms)
        plan = dataclasses.replace(plan, hit_time_limit=True)
    return plan


def short_segment_shapes(compute_count: int, max_stages: int = 32, finest: bool = False) -> list[tuple[int, int]]:
    """The starts of the short-segments path (:func:`_short_segments_plan`) on a graph of
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


def _short_segments_plan(graph: CostGraph, stage_count: int, max_segment_stages: int, budget_bytes: int,
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
        plan = _tightened(graph, model, budget_bytes, unoptimized, solver, time_limit_s, max_attempts, started,
                          node_limit=FINER_PASS_NODES, by_chain_dp=by_chain_dp, loosen=True)
    except SolverError as exc:
        log.info("short segments on %d stages: no plan (%s)", len(stages), exc)
        return None, len(stages)
    if plan is None:
        return None, len(stages)
    log.info("short segments on %d stages: %.2f ms", len(stages), plan.recompute_ms)
    return dataclasses.replace(plan, solver=f"{plan.solver.removesuffix(' (tightened)')} (short segments)"), len(stages)


def _on_finer_stages(
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
    by_chain_dp: bool = False,
) -> Plan:
    """``plan`` (found on ``stage_count`` stages), or a cheaper one from the ILP on about twice
    as many stages, every boundary of ``plan`` among them and no segment longer than its
    longest, stopped after :data:`FINER_PASS_NODES` branch-and-bound nodes (HiGHS; CBC has no
    such limit); repeated on twice as many stages again, up to ``rounds`` times in all, while a
    round finds a cheaper plan, the doubled stages would be at most half the compute nodes, the
    ILP would have at most :data:`FINER_ROUND_MAX_CANDIDATES` candidate segments and
    ``time_limit_s`` (for all rounds together) is not spent (on the 4-layer GPT-2 and BERT
    profiles, 222 and 128 compute nodes, a second round on about 140 stages found nothing in
    9 to 13 s). With ``every_round_capped`` (a start from :func:`_short_segments_plan`, already
    on many stages) the first round is held to the same limits. Finer stages let a segment end right after a node
    that saves only its inputs (a linear: its matmul is never recomputed) where the coarse cuts
    could not; on the residual MLP at half its peak the predicted recompute fell from 16.6 % to
    13.0 % of the step, on a 4-layer GPT-2 from 21 % to 16 %. Deeper graphs gain from a second
    round (:data:`FINER_PASS_ROUNDS`).

    The search does not start from ``plan``: HiGHS 1.16 with presolve, given ``plan`` as a MIP
    start (``Highs.setSolution``), proved the start optimal at the root on a 4-layer GPT-2 at
    half its peak on 71, 83 and 95 stages, where the same models solved without a start found
    plans 25 % cheaper within the node limit (without presolve the start was no trap, but
    100 nodes took 30 to 55 s).
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
            return _tightened(graph, model, budget_bytes, unoptimized, solver, limit_s, max_attempts, started,
                              node_limit=FINER_PASS_NODES, by_chain_dp=by_chain_dp)

        finer, stage_count = _on_doubled_stages(graph, best, stage_count, solve_stages, selective=selective,
                                                max_candidates=FINER_ROUND_MAX_CANDIDATES if capped else None)
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
    """One round of :func:`_on_finer_stages`: the plan ``solve_stages`` finds on about
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
    if finer is not None:
        finer = dataclasses.replace(finer, solver=finer.solver.removesuffix(" (tightened)"))
    return finer, len(stages)


def _with_kept_outputs(
    graph: CostGraph,
    plans: list[Plan],
    budget_bytes: int,
    fallback: Plan | None,
    *,
    max_stages: int,
    solver: str | None,
    time_limit_s: float,
    refine_s: float,
    deadline: SolveDeadline | None = None,
) -> Plan:
    """The cheapest of ``plans`` and of op-level keep decisions (:func:`planner.keep.keep_outputs`)
    on their segments and on the finer ones of the smallest-peak plan (``fallback``, solved
    here when ``None`` and the budget is within :data:`KEEP_FROM_SMALLEST_PEAK_WITHIN` of the
    smallest-peak ILP's peak), each of whose room below the budget is then filled with kept outputs.
    (Plans checkpointing every stage of a partition into 6 to 32 stages were starts too; since
    the chain DP chooses segments and keep options together they no longer won on any
    profile measured, at 2 s each on 1,000-node graphs.)"""
    if fallback is None:
        rough = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                  refine_s=0, exact=False, lower_by_dp=False)
        if budget_bytes <= KEEP_FROM_SMALLEST_PEAK_WITHIN * rough.predicted_peak_bytes:
            fallback = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                                         refine_s=refine_s, lower_by_dp=False)
        else:
            log.info("keep search: the budget is %.2fx the smallest-peak ILP's peak, so its plan is no start",
                     budget_bytes / rough.predicted_peak_bytes)
    starts = [(p.segments, p.solver) for p in plans]
    if fallback is not None and fallback.segments and fallback.predicted_peak_bytes <= budget_bytes:
        starts.append((fallback.segments, fallback.solver))
    best = min(plans, key=lambda p: p.recompute_ms)
    deadline = deadline or SolveDeadline(time.perf_counter(), None)
    for segments, solver_name in starts:
        if not deadline.allows(f"keeping outputs in the plan of {solver_name}"):
            break
        kept_s = deadline.cut(max(refine_s, 1.0))
        kept = keep_outputs(graph, segments, budget_bytes, time_limit_s=kept_s)
        cost = sum(s.recompute_ms for s in kept)
        if kept and cost < best.recompute_ms - 1e-9:
            peak = simulate(graph, kept).peak_bytes
            best = dataclasses.replace(best, budget_bytes=budget_bytes, segments=tuple(kept),
                                       predicted_peak_bytes=peak, optimality_gap=None, hit_time_limit=False,
                                       solver=f"{solver_name} + keep")
    return best


def _every_recomputable_run(graph: CostGraph) -> list[Segment]:
    """One segment per maximal run of recomputable compute nodes."""
    runs: list[list[Any]] = [[]]
    for node in graph.compute_nodes:
        if node.recomputable:
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    return [segment_with_kept(graph, tuple(n.name for n in run)) for run in runs if run]


def _refined(graph: CostGraph, plan: Plan, budget_bytes: int, refine_s: float, started: float) -> Plan:
    """``plan`` improved by :func:`planner.refine.refine_segments` when that saves recompute time.
    The ILP's gap no longer bounds a changed plan, so it is then reported as unknown."""
    if refine_s > 0 and plan.segments:
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
    stages that :func:`planner.relaxation.search_cheapest` finds; a plan the search proves the
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


def _tightened(
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
    fits. None when the ILP becomes infeasible first. A plan found after lowering is marked
    ``(tightened)`` in its solver name. ``node_limit`` and ``node_limit_needs_plan``: of each
    solve (:func:`_solve_ilp`). ``by_chain_dp``: solve the model by dynamic
    programming instead (:func:`_solve_chain`: its optimum, in a fraction of the time); one the
    DP finds too large goes to the ILP (with its node and time limits). ``loosen``: a plan the
    DP finds at once (or none) is then passed to :func:`_loosened`."""
    target_mib = budget_bytes / MIB
    chain = by_chain_dp
    for attempt in range(max_attempts):
        if chain:
            try:
                result = _solve_chain(model, target_mib)
            except ChainSearchTooLarge as exc:
                log.info("%s on %d stages: %s; solving the ILP instead", CHAIN_DP, len(model.stages), exc)
                chain = False
        if not chain:
            result = _solve_ilp(model, target_mib, solver, time_limit_s, node_limit, node_limit_needs_plan)
        if result is None:
            break
        plan = _replayed(graph, model, result, budget_bytes, unoptimized, started,
                         f"{result.solver} (tightened)" if attempt else result.solver)
        peak = plan.predicted_peak_bytes
        log.info("attempt %d: %d segments, simulated peak %.1f MiB (budget %.1f MiB)",
                 attempt, len(result.chosen), peak / MIB, budget_bytes / MIB)
        if peak <= budget_bytes:
            if chain and loosen and attempt == 0:
                return _loosened(graph, model, plan, budget_bytes, unoptimized, started)
            return plan
        target_mib -= (peak - budget_bytes) / MIB + 0.5
    if chain and loosen and target_mib == budget_bytes / MIB:  # no plan at the budget itself
        return _loosened(graph, model, None, budget_bytes, unoptimized, started)
    return None


def _loosened(graph: CostGraph, model: StageModel, plan: Plan | None, budget_bytes: int, unoptimized: int,
              started: float) -> Plan | None:
    """``plan`` (the chain DP's at the budget, or None when it found none), or a cheaper plan the
    DP finds at a target above the budget that still fits the budget in the simulator: the
    stage model's account is conservative, so its plans can leave room the simulator does not
    see used. Targets :data:`LOOSEN_STEPS` above the budget, in order, until one's plan goes
    over it, then :data:`LOOSEN_BISECT_STEPS` bisection steps between that target and the last
    that fitted (or the budget); only on models of at
    most :data:`LOOSEN_MAX_CANDIDATES` candidate segments and no keep options, where a DP
    solve takes a fraction of a second (with keep options, 0.3 s on a 17-layer GPT-2's 33
    stages)."""
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


def _replayed(graph: CostGraph, model: StageModel, result: _IlpResult, budget_bytes: int, unoptimized: int,
              started: float, solver: str | None = None) -> Plan:
    """``result``'s segments as a plan for ``budget_bytes``, its peak replayed in the simulator
    (it may exceed the budget); ``solver`` names it (``result.solver`` by default)."""
    segments = _segments(graph, model, result.chosen, result.kept)
    peak = simulate(graph, segments).peak_bytes
    return _to_plan(graph, segments, budget_bytes, unoptimized, peak, solver or result.solver,
                    time.perf_counter() - started, result)
