"""A lower bound on the recompute any plan needs to fit a budget: how far from optimal a plan
can be, and whether a target overhead is reachable at all on the profiled costs.

Compare a plan's replay with the unoptimized one, moment by moment (a node's forward or
backward; :func:`planner.core.simulate.simulate`). Outside the recompute, a plan changes what is
live only in two ways, whatever its segments and kept outputs:

* **Saved storages it frees.** A storage saved for backward, live in the unoptimized step from
  its first saver's forward to its last saver's backward, can be gone only if the node that
  made it runs again in a recompute: otherwise the backward has nothing to read it from. It is
  never gone where it is being used: at the forward of its maker or of a node reading it, and
  at the backward of a node that saved it; nor before a later reader's forward. In plans of
  whole segments a node outside every segment also holds what it saved until its backward
  (:mod:`planner.bounds.saver_holds`).
* **Transient inputs it holds longer.** A storage nothing saves is freed after its last reader
  in the unoptimized step. If a node reading it runs again in a recompute while the node that
  made it does not, the plan must hold it from the forward until that recompute: it is live
  at every forward moment after its last reader (a segment input, or a kept output). In the
  backward, a segment input stays until the backward of its segment's first node, so it is
  live at the backward of every node from the reader on; a kept output is released by its
  segment's recompute, which comes first only where the segment reaches that moment's
  recompute and pays the selective policy on every node up to it
  (:mod:`planner.bounds.backward_holds`). Without this hold the bound would count as free,
  for one, a residual add rerun without the projection before it
  (docs/benchmarks/bound_gap.md measures what the hold closes).

So with a binary ``x[n]`` for "node ``n`` runs again", every plan that fits satisfies, at each
moment where the unoptimized step exceeds the budget::

    sum(bytes freeable there whose maker n has x[n] = 1) - sum(transients held there) >= live - budget

and recomputes at least ``sum(cost[n] * x[n])``, where ``cost[n]`` is what a recompute spends
on ``n`` at the least (all of it, or the share before its last save when it can end a
segment; :mod:`planner.core.rerun`). The least cost over these covering constraints, proven by
HiGHS (its dual bound) or, with CBC, by the LP relaxation, is a lower bound on the recompute
of every plan, kept outputs included, by the plan's own account (the simulator's memory and
the profile's costs); ``kept_outputs=False`` bounds plans of whole segments, where every such
transient is held. It is far cheaper than :mod:`planner.bounds.reach` (one binary per node and
per node a selective policy may span, no segment breaks; docs/tuning.md#covering_time_limit_s
has its times). Because it ignores the memory a recompute itself adds in the backward, and
that a segment reruns every node up to its last save, it can stay below the cheapest plan.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i, ms in enumerate([4.0, 1.0, 2.0], start=1):
    ...     nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=100, requires_grad=True, time_ms=ms))
    >>> g = CostGraph(tuple(nodes), (Storage(0, 100, True), *(Storage(i, 100) for i in (1, 2, 3))), ("n3",))
    >>> simulate(g).peak_bytes  # at n3's backward: n3's gradient and n2's next to it
    600
    >>> recompute_lower_bound_ms(g, 550)  # 50 bytes to free where n2 needs its own: rerun n1
    4.0
    >>> recompute_lower_bound_ms(g, 450)  # 150 there, but only n1's 100 can go: no plan fits
    inf
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import pulp

from planner.bounds.backward_holds import BackwardHolds
from planner.bounds.saver_holds import FreedStorages
from planner.bounds.storage_uses import StorageUses
from planner.core.costgraph import MIB, CostGraph, CostNode
from planner.core.errors import InputError
from planner.milp.highs import HighsOverrunError, PlannerHiGHS
from planner.solvers.stage_ilp import MIP_GAP, available_solvers, solved_lp_relaxation
from planner.core.rerun import after_last_save_fraction, after_last_save_time_fraction
from planner.core.simulate import SimulationResult, simulate

__all__ = ["LowerBound", "check_bound_arguments", "covering_bound", "highs_lp_bound", "moments_over",
           "least_rerun_cost", "lp_relaxation_bound", "milp_dual_bound", "proven_bound", "recompute_lower_bound_ms",
           "settled_without_solving"]

log = logging.getLogger(__name__)

OBJECTIVES = ("time", "flops")


@dataclass(frozen=True)
class LowerBound:
    """A proven lower bound: ``value`` (ms or FLOPs; ``inf`` when no plan fits by the account),
    how it was proven, and the nodes the solver's best solution reruns (empty when it has
    none, as after an LP relaxation)."""

    value: float
    method: str
    reruns: tuple[str, ...] = ()


def milp_dual_bound(prob: pulp.LpProblem, time_limit_s: float, presolve: bool = True,
                    gap: float = MIP_GAP) -> tuple[float, bool, str]:
    """HiGHS's proven bound on ``prob``'s optimum (a minimisation): ``(bound, infeasible, method)``.
    The dual bound is valid when HiGHS stops at its time limit too. A solve abandoned far past
    its time limit (:class:`planner.milp.highs.HighsOverrunError`) gives the LP relaxation's bound."""
    options = {} if presolve else {"presolve": "off"}
    try:
        prob.solve(PlannerHiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=gap, **options))
    except HighsOverrunError:
        return lp_relaxation_bound(prob, time_limit_s)
    if prob.status == pulp.LpStatusInfeasible:
        return math.inf, True, "MILP infeasible (HiGHS)"
    info = prob.solverModel.getInfo()
    status = str(prob.solverModel.getModelStatus())
    bound = float(info.mip_dual_bound)
    if not math.isfinite(bound):
        return 0.0, False, f"HiGHS proved no bound ({status})"
    closed = "Optimal" in status
    return max(0.0, bound), False, (f"MILP optimum within the {gap * 100:g} % gap (HiGHS)" if closed
                                    else f"MILP bound after {time_limit_s:g} s (HiGHS)")


def lp_relaxation_bound(prob: pulp.LpProblem, time_limit_s: float) -> tuple[float, bool, str]:
    """The optimum of ``prob``'s LP relaxation (CBC): ``(bound, infeasible, method)``."""
    relaxed = solved_lp_relaxation(prob, time_limit_s)
    if relaxed.status == pulp.LpStatusInfeasible:
        return math.inf, True, "LP relaxation infeasible (CBC)"
    if relaxed.status != pulp.LpStatusOptimal:
        return 0.0, False, f"LP relaxation not solved (CBC: {pulp.LpStatus[relaxed.status]})"
    return max(0.0, float(pulp.value(relaxed.objective) or 0.0)), False, "LP relaxation (CBC)"


def moments_over(graph: CostGraph, unoptimized: SimulationResult, budget_bytes: int,
                 max_moments: int) -> list[tuple[str, str, int]]:
    """The unoptimized replay's moments above ``budget_bytes``, highest first, ``max_moments``
    at most, each backward moment without its node's late scratch
    (``CostNode.backward_late_scratch_bytes``): a plan that recomputes the node releases the
    node's saved tensors before taking it (:mod:`planner.core.simulate`), which a moment's rule
    (a backward keeps what it reads) cannot express, so only the part before it is a demand
    every plan meets.

    Example:
        >>> from planner.core.costgraph import CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("a", "op", input_names=("x",), output_storages=(1,), saved_storages=(0,),
        ...                         output_bytes=MIB, requires_grad=True, backward_peak_bytes=3 * MIB,
        ...                         backward_late_scratch_bytes=2 * MIB)),
        ...               (Storage(0, MIB, True), Storage(1, MIB)), output_names=("a",))
        >>> [(phase, name, live / MIB) for phase, name, live in simulate(g).timeline]
        [('forward', 'a', 2.0), ('backward', 'a', 6.0)]
        >>> [(phase, name, live / MIB) for phase, name, live in moments_over(g, simulate(g), 0, 8)]
        [('backward', 'a', 4.0), ('forward', 'a', 2.0)]
    """
    late = {n.name: n.backward_late_scratch_bytes for n in graph.compute_nodes if n.backward_late_scratch_bytes}
    moments = [(phase, name, live - late.get(name, 0) if phase == "backward" else live)
               for phase, name, live in unoptimized.timeline]
    return sorted((m for m in moments if m[2] > budget_bytes), key=lambda m: -m[2])[:max_moments]


def settled_without_solving(graph: CostGraph, budget_bytes: int) -> tuple[SimulationResult, LowerBound | None]:
    """The unoptimized replay, and the bound when no solve is needed: 0 when the unoptimized
    step fits, ``inf`` when parameters and inputs alone exceed the budget (else None)."""
    unoptimized = simulate(graph)
    if unoptimized.peak_bytes <= budget_bytes:
        return unoptimized, LowerBound(0.0, "nothing to free")
    if sum(s.size_bytes for s in graph.storages if s.persistent) > budget_bytes:
        return unoptimized, LowerBound(math.inf, "parameters and inputs alone exceed the budget")
    return unoptimized, None


def proven_bound(prob: pulp.LpProblem, time_limit_s: float, solver: str | None) -> tuple[float, str]:
    """A proven lower bound on ``prob``'s optimum and how: HiGHS's dual bound within the 0.01 %
    gap or after ``time_limit_s`` (where installed, unless ``solver="CBC"``), else, or when
    HiGHS stops before proving any, the LP relaxation (CBC)."""
    if solver != "CBC" and "HiGHS" in available_solvers():
        value, _, method = milp_dual_bound(prob, time_limit_s, gap=1e-4)
        if "no bound" not in method:
            return value, method
    value, _, method = lp_relaxation_bound(prob, time_limit_s)
    return value, method


def check_bound_arguments(objective: str, budget_bytes: int, time_limit_s: float) -> None:
    """Raise :class:`InputError` saying what to pass for an unknown objective, a budget that is
    not a positive number of bytes, or a time limit that is not positive."""
    if objective not in OBJECTIVES:
        raise InputError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise InputError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if not time_limit_s > 0:
        raise InputError(f"time_limit_s must be positive, got {time_limit_s!r}")


def least_rerun_cost(graph: CostGraph, node: CostNode, objective: str = "time") -> float:
    """The least a recompute that runs ``node`` (wholly or in part) spends on it: all of it, or,
    when it can end a segment partway (its last save before its end), the share before that.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> g = CostGraph((CostNode("sdpa", "attention", time_ms=10.0, flops=100, after_last_save_fraction=0.5,
        ...                         after_last_save_time_fraction=0.2),), ())
        >>> least_rerun_cost(g, g.node("sdpa")), least_rerun_cost(g, g.node("sdpa"), "flops")
        (8.0, 50.0)
    """
    full = node.time_ms if objective == "time" else float(node.flops)
    share = after_last_save_fraction(graph, node)
    if not 0.0 < share < 1.0:
        return full  # a node that saves only its inputs is skipped, not run, when it ends a segment
    if objective == "flops":
        return float(math.floor(full * (1.0 - share)))  # planner.core.rerun rounds the share's FLOPs
    return full * (1.0 - after_last_save_time_fraction(graph, node))


class _CoveringModel:
    """The covering ILP of the module docstring for one graph and budget."""

    def __init__(self, graph: CostGraph, unoptimized: SimulationResult, budget_bytes: int, objective: str,
                 max_moments: int, kept_outputs: bool = True, released: bool = False) -> None:
        uses = StorageUses(graph)
        position = uses.position
        self.inputs_of = uses.inputs_of
        self.prob = pulp.LpProblem("recompute_lower_bound", pulp.LpMinimize)
        self.x = {name: self.prob.add_variable(f"rerun_{i}", cat=pulp.LpBinary)
                  for i, name in enumerate(sorted(uses.rerunnable))}
        # transients a rerun reader makes the plan hold: (last use, held variable, MiB)
        self.transients = uses.add_transients(self.prob, self.x)
        #: a moment where nothing can be freed and the budget is exceeded: no plan fits
        self.infeasible = False
        self.moments = moments_over(graph, unoptimized, budget_bytes, max_moments)
        # a kept maker can release a transient before the backward moments that read it;
        # ``released`` lets every maker do so for free
        may_keep = frozenset(n.name for n in graph.compute_nodes if n.selective_save or released) \
            if kept_outputs else frozenset()
        # what each moment can free (planner.bounds.saver_holds)
        self.freed = FreedStorages(uses, self.prob, self.x, may_keep)
        self.holds = BackwardHolds(
            graph, uses, self.prob, self.x, may_keep=may_keep,
            policy_ms_per_node=graph.selective_overhead_ms_per_node if objective == "time" and not released else 0.0,
            backward_positions=[position[name] for phase, name, _ in self.moments if phase == "backward"],
            runs_backward={name for phase, name, _ in unoptimized.timeline if phase == "backward"})
        self.prob.setObjective(pulp.lpSum(least_rerun_cost(graph, graph.node(name), objective) * v
                                          for name, v in self.x.items()) + self.holds.spread_cost)
        for c, (phase, name, live) in enumerate(self.moments):
            self._add_moment(c, phase, name, position[name], (live - budget_bytes) / MIB)

    def _add_moment(self, c: int, phase: str, name: str, here: int, excess_mib: float) -> None:
        freed = self.freed.terms(phase, name, here)
        if not freed:
            self.infeasible = True
            return
        if phase == "forward":
            held = [mib * v for last, v, mib in self.transients if last < here]
        else:
            held = self.holds.held_mib(here)
        self.prob += (pulp.lpSum(mib * v for mib, v in freed) - pulp.lpSum(held) >= excess_mib,
                      f"moment_{c}_{phase}_{name}")


def covering_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    objective: str = "time",
    kept_outputs: bool = True,
    max_moments: int = 256,
    time_limit_s: float = 30.0,
    solver: str | None = None,
) -> LowerBound:
    """The least recompute time (ms) or FLOPs any plan fitting ``budget_bytes`` needs, by the
    covering ILP of the module docstring over the ``max_moments`` fullest moments of the
    unoptimized step (fewer moments can only lower it): HiGHS's dual bound after at most
    ``time_limit_s`` (where installed, unless ``solver="CBC"``; see :func:`proven_bound`), else the
    LP relaxation. Where HiGHS stops before closing the gap, the larger of that, its LP
    relaxation by HiGHS (:func:`highs_lp_bound`) and, with kept outputs, the same model without
    backward holds (each within ``time_limit_s`` more). ``inf`` when no plan fits by this
    account, 0 when the unoptimized step fits. ``kept_outputs=False`` bounds plans of whole
    segments only, where every transient a recomputed node reads from outside its segment
    stays held through the backward.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 64, True),))
        >>> covering_bound(g, 64).value, covering_bound(g, 63).value
        (0.0, inf)

    Raises:
        InputError: an unknown objective, a budget that is not a positive number of bytes, or a
            time limit that is not positive.
    """
    check_bound_arguments(objective, budget_bytes, time_limit_s)
    started = time.perf_counter()
    unoptimized, settled = settled_without_solving(graph, budget_bytes)
    if settled is not None:
        return settled
    model = _CoveringModel(graph, unoptimized, budget_bytes, objective, max_moments, kept_outputs)
    if model.infeasible:
        return LowerBound(math.inf, "nothing freeable at a moment over the budget")
    value, method = proven_bound(model.prob, time_limit_s, solver)
    reruns = tuple(name for name, v in model.x.items() if v.value() is not None and v.value() > 0.5)
    if solver != "CBC" and "within the" not in method and "HiGHS" in available_solvers():
        # HiGHS can stall before its root bound on the larger models with kept outputs, whose
        # LP relaxation it solves in seconds; and the model without backward holds bounds every
        # plan too, closing in a fraction of the time
        relaxed = highs_lp_bound(model.prob, time_limit_s)
        if relaxed > value:
            value, method = relaxed, "LP relaxation (HiGHS)"
        if kept_outputs:
            simple = _CoveringModel(graph, unoptimized, budget_bytes, objective, max_moments, released=True)
            simple_value, simple_method = proven_bound(simple.prob, time_limit_s, solver)
            if simple_value > value:
                value, method = simple_value, f"{simple_method}, transients released"
    log.info("covering bound (%s%s): %s over %d moments, %d nodes, %d transients, %.2f s", objective,
             "" if kept_outputs else ", segments only", value,
             len(model.moments), len(model.x), len(model.transients), time.perf_counter() - started)
    return LowerBound(value, f"covering ILP{'' if kept_outputs else ', segments only'}: {method}", reruns)


def highs_lp_bound(prob: pulp.LpProblem, time_limit_s: float) -> float:
    """The optimum of ``prob``'s LP relaxation (a minimisation) by HiGHS, a lower bound on its
    optimum; 0 when HiGHS does not solve it within ``time_limit_s``.

    Example:
        >>> prob = pulp.LpProblem("cover", pulp.LpMinimize)
        >>> x, y = (prob.add_variable(name, cat=pulp.LpBinary) for name in "xy")
        >>> prob += 2 * x + 3 * y
        >>> prob += x + y >= 1.5, "cover"
        >>> highs_lp_bound(prob, 10.0)  # x = 1, y = 0.5; the integer optimum is 5
        3.5
    """
    try:
        prob.solve(PlannerHiGHS(msg=False, mip=False, timeLimit=time_limit_s, threads=1))
    except HighsOverrunError:
        return 0.0
    if prob.status != pulp.LpStatusOptimal:
        return 0.0
    return max(0.0, float(pulp.value(prob.objective) or 0.0))


def recompute_lower_bound_ms(graph: CostGraph, budget_bytes: int, *, max_moments: int = 256,
                             solver: str | None = None) -> float:
    """The least recompute time (ms) any plan fitting ``budget_bytes`` needs: :func:`covering_bound`.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 64, True),))
        >>> recompute_lower_bound_ms(g, 64), recompute_lower_bound_ms(g, 63)
        (0.0, inf)
    """
    return covering_bound(graph, budget_bytes, max_moments=max_moments, solver=solver).value
