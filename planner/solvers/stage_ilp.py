"""MILP plumbing: which solvers run here, and one stage model solved as an integer linear program.

The stage model (:mod:`planner.solvers.stage_model`) is a chain of stages. A binary variable ``y[a, b]``
says that stages ``a..b`` run as one checkpointed segment. The ILP minimises the forward time
of everything recomputed subject to a memory account at every stage, in the forward and in
the backward. Memory is tracked storage by storage: a continuous ``held[k, j]`` is at least
1 when a stage at or before ``j`` that saves storage ``k`` is not recomputed, or when a
chosen segment starting at or before ``j`` takes ``k`` as an input; ``held`` never
decreases with ``j`` (backward releases a storage only after its earliest holder ran). A
segment being recomputed adds the fresh copies of what its stages up to ``j`` save. Parameter
gradients accumulated so far, gradients in flight and measured temporaries are constants.
Every constraint is named, so an infeasible model can be explained. A solve that stops early
is judged by ``sol_status``, not ``status``.

Example:
    >>> set(available_solvers()) <= set(KNOWN_SOLVERS)
    True
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import pulp

from planner.core.errors import SolverError
from planner.milp.highs import NO_PROBING, PlannerHiGHS, stopped_at_node_limit
from planner.solvers.stage_model import StageModel, holder_groups

__all__ = ["MIP_GAP", "KNOWN_SOLVERS", "available_solvers", "solved_lp_relaxation"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Relative MIP gap the solvers stop at (docs/tuning.md#mip_gap).
MIP_GAP = 0.01
#: ``sol_status`` values that carry a usable solution
_ACCEPTED = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


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


def choose_solver(name: str | None) -> str:
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
    (:mod:`planner.milp.highs`; CBC ignores it)."""
    if name == "HiGHS":
        options: dict[str, Any] = dict(NO_PROBING) if presolve else {"presolve": "off"}
        if node_limit is not None:
            options["mip_max_nodes"] = node_limit
        return PlannerHiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=MIP_GAP, **options)
    return _cbc(time_limit_s)


@dataclass(frozen=True)
class IlpResult:
    """One ILP solve: the chosen ``(first_stage, last_stage)`` runs and how the solver ended."""

    chosen: list[tuple[int, int]]
    solver: str
    #: proven relative gap between this solution and the best bound; None when not known
    gap: float | None
    hit_time_limit: bool
    #: nodes the chosen keep options keep (selective models only)
    kept: frozenset[str] = frozenset()
    #: solved by the chain DP (exact over the stage model) rather than a MILP solver
    by_chain_dp: bool = False
    #: labels the chain DP kept (0 for a MILP)
    chain_labels: int = 0


def run_solver(prob: pulp.LpProblem, name: str, time_limit_s: float, presolve: bool = True,
                node_limit: int | None = None) -> str:
    """Solve ``prob`` with ``name``; when that solver fails to run, with another installed one.
    ``presolve=False`` turns HiGHS's presolve off, for the exact search's models, where it can
    run far past the time limit (docs/tuning.md#run_solver)."""
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


def solve_ilp(
    model: StageModel,
    budget_mib: float | None,
    solver_name: str | None,
    time_limit_s: float,
    node_limit: int | None = None,
    node_limit_needs_plan: bool = False,
) -> IlpResult | None:
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
    name = choose_solver(solver_name)
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
    name = run_solver(prob, name, time_limit_s, node_limit=node_limit)
    if node_limit_needs_plan and prob.sol_status == pulp.LpSolutionNoSolutionFound and stopped_at_node_limit(prob):
        left_s = time_limit_s - (time.perf_counter() - solve_started)
        log.info("%s found no plan in %d branch-and-bound nodes; going on for up to %.1f s", name, node_limit,
                 left_s)
        if left_s > 0:
            name = run_solver(prob, name, left_s)
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
    return IlpResult(sorted(chosen), name, gap, hit_time_limit, kept)
