"""Whether an overhead is reachable at all: a proven lower bound on the recompute of every plan.

:mod:`planner.bounds.covering` bounds the recompute cheaply, node by node, with no segments: it ignores
the memory a recompute adds in the backward. :mod:`planner.bounds.segment_covering` adds the segments'
breaks to it, and this module bounds it with the whole segment structure and the backward's
memory, at a solver's price, and returns the best of the three. The optimistic account of
:mod:`planner.solvers.relaxation` never predicts more than the simulator, moment by moment, for any
plan over its stages. Built with every compute node as its own stage, its candidates are all
the plans of segments the planner can emit, so its optimum is at most the cost of the
cheapest one that fits the budget, and so is any bound a MILP solver proves on that optimum:
HiGHS's dual bound (valid when it stops at its time limit too), or with CBC the optimum of
the LP relaxation. An infeasible account proves that no plan fits at all.

By default the account also chooses, node by node, which outputs a segment keeps from the
forward (:mod:`planner.bounds.kept_account`), so the bound covers every plan the planner emits, with
``selective=True`` too: a kept node inside a segment can hold less than any split of that
segment, so such a plan may cost less than the best plan of whole segments.
``kept_outputs=False`` bounds plans of whole segments only (a smaller model, a higher bound).

The bound holds for plans priced as :mod:`planner.core.rerun` and :func:`planner.solvers.keep.segment_with_kept`
price them, in the profile's node times (time, with the selective policy's cost) or
``FlopCounterMode``'s FLOPs (flops), and measured against the simulator's memory account
(validated against the allocator: docs/memory.md#prediction).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0,
    ...                           flops=10))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
    >>> found = recompute_bound(g, 7 * 2**20)
    >>> round(found.bound, 6), found.proven_infeasible
    (2.0, False)
    >>> recompute_bound(g, 7 * 2**20, objective="flops").bound
    20.0
    >>> recompute_bound(g, 2**20).proven_infeasible
    True
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import pulp

from planner.bounds.covering import (
    check_bound_arguments,
    covering_bound,
    lp_relaxation_bound,
    milp_dual_bound,
)
from planner.core.costgraph import CostGraph
from planner.solvers.keep import segment_with_kept
from planner.bounds.kept_account import KeptOutputsAccount
from planner.solvers.relaxation import OptimisticAccount
from planner.bounds.segment_covering import segment_covering_bound
from planner.core.simulate import simulate
from planner.solvers.stage_ilp import available_solvers
from planner.core.stages import build_stages

__all__ = ["RecomputeBound", "recompute_bound"]

log = logging.getLogger(__name__)

#: at most this long for the covering bound of :mod:`planner.bounds.covering`
#: (docs/tuning.md#covering_time_limit_s)
COVERING_TIME_LIMIT_S = 30.0


@dataclass(frozen=True)
class RecomputeBound:
    """A proven lower bound on the recompute of every plan that fits a budget.

    ``bound`` is in ms (objective ``"time"``) or FLOPs (``"flops"``); ``inf`` when no plan fits
    (``proven_infeasible``), 0 when the unoptimized step fits. ``best_plan`` is the cost of the
    cheapest plan the solve met that the simulator accepts (None when it met none): the optimum
    lies between the two. ``method`` says how the bound was proven.
    """

    objective: str
    budget_bytes: int
    bound: float
    best_plan: float | None
    method: str
    proven_infeasible: bool
    solve_s: float
    #: the bound covers plans with kept outputs too (else plans of whole segments only)
    kept_outputs: bool = True

    @property
    def gap(self) -> float | None:
        """How far ``best_plan`` can be above the optimum, relative to it (None: no plan met)."""
        if self.best_plan is None or math.isinf(self.bound):
            return None
        return (self.best_plan - self.bound) / self.bound if self.bound > 0 else 0.0


def recompute_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    objective: str = "time",
    time_limit_s: float = 120.0,
    solver: str | None = None,
    max_moments: int = 256,
    presolve: bool = True,
    kept_outputs: bool = True,
    with_account: bool = True,
) -> RecomputeBound:
    """The least recompute time (ms) or FLOPs that any plan fitting ``budget_bytes`` needs
    (with ``kept_outputs``, plans that keep outputs inside their segments too), proven by the
    optimistic account over every compute node (module docstring).

    With HiGHS (the default where installed) the account is solved as a MILP for up to
    ``time_limit_s`` and its best bound is read; with ``solver="CBC"`` its LP relaxation is
    solved (weaker, and only as fast as CBC's LP). The largest of that,
    :func:`planner.bounds.covering.covering_bound` (for at most :data:`COVERING_TIME_LIMIT_S`) and
    :func:`planner.bounds.segment_covering.segment_covering_bound` (for up to ``time_limit_s`` more) is
    returned. The account is constrained at the ``max_moments`` fullest moments of the
    unoptimized step (fewer moments can only lower the bound); on real models building it
    takes tens of seconds and HiGHS does not close its gap in minutes. ``presolve=False`` turns
    HiGHS's presolve off, where with it HiGHS may prove no bound at all. ``with_account=False``
    returns the covering bound alone, without the account's build; it covers plans with kept
    outputs. The segment covering bound is the one that knows a recompute's memory at a
    tolerable price. docs/tuning.md#recompute_bound has the times and bounds measured.

    Example:
        See the module docstring.

    Raises:
        InputError: see :func:`planner.bounds.covering.check_bound_arguments`.
    """
    check_bound_arguments(objective, budget_bytes, time_limit_s)
    started = time.perf_counter()
    if simulate(graph).peak_bytes <= budget_bytes:
        return RecomputeBound(objective, budget_bytes, 0.0, 0.0, "nothing to free", False, 0.0, kept_outputs)
    covering = covering_bound(graph, budget_bytes, objective=objective, solver=solver,
                              kept_outputs=kept_outputs or not with_account,
                              time_limit_s=min(time_limit_s, COVERING_TIME_LIMIT_S))
    if math.isinf(covering.value):
        return RecomputeBound(objective, budget_bytes, math.inf, None, covering.method, True,
                              time.perf_counter() - started, kept_outputs)
    if not with_account:
        return RecomputeBound(objective, budget_bytes, covering.value, None, covering.method, False,
                              time.perf_counter() - started, kept_outputs=True)
    with_segments = segment_covering_bound(graph, budget_bytes, objective=objective, kept_outputs=kept_outputs,
                                           max_moments=max_moments, time_limit_s=time_limit_s, solver=solver)
    if math.isinf(with_segments.value):
        return RecomputeBound(objective, budget_bytes, math.inf, None, with_segments.method, True,
                              time.perf_counter() - started, kept_outputs)
    cheap = max(covering, with_segments, key=lambda found: found.value)
    stages = build_stages(graph, max_stages=len(graph.compute_nodes))
    account = (KeptOutputsAccount if kept_outputs else OptimisticAccount)(graph, stages, budget_bytes)
    for phase, name, live in sorted(account.moments, key=lambda m: -m[2])[:max_moments]:
        account.add_moment(phase, name, live)
    price = account.run_ms if objective == "time" else account.run_flops
    if isinstance(account, KeptOutputsAccount):
        kept_price = account.kept_time_ms if objective == "time" else account.kept_flops
        account.prob.setObjective(account.cost_expression(price, kept_price, policy=objective == "time"))
    else:
        account.prob.setObjective(pulp.lpSum(v * price[run] for run, v in account.y.items()))
    log.info("optimistic account over %d stages: %d candidate segments, %d keepable nodes, %d moments, "
             "%d variables, built in %.1f s", len(stages), len(account.y), len(getattr(account, "x", ())),
             len(account.constrained), account.prob.numVariables(), time.perf_counter() - started)
    use_highs = solver != "CBC" and "HiGHS" in available_solvers()
    proven, infeasible, method = (milp_dual_bound(account.prob, time_limit_s, presolve) if use_highs
                                  else lp_relaxation_bound(account.prob, time_limit_s))
    best = None
    if use_highs and not infeasible and account.prob.sol_status in (pulp.LpSolutionOptimal,
                                                                    pulp.LpSolutionIntegerFeasible):
        best = _solution_cost(graph, account, objective)
    if infeasible:
        bound = math.inf
    else:
        bound = max(proven, cheap.value)
        if cheap.value > proven:
            method = cheap.method
    return RecomputeBound(objective, budget_bytes, bound, best, method, infeasible, time.perf_counter() - started,
                          kept_outputs)


def _solution_cost(graph: CostGraph, account: OptimisticAccount, objective: str) -> float | None:
    """The cost of the plan in ``account``'s solution, if the simulator fits it in the budget."""
    runs = account.chosen_runs()
    kept = set(account.chosen_kept()) if isinstance(account, KeptOutputsAccount) else set()
    segments = [segment_with_kept(graph, [n for st in account.stages[a : b + 1] for n in st.node_names], kept)
                for a, b in runs]
    if simulate(graph, segments).peak_bytes > account.budget_bytes:
        return None
    return float(sum(s.recompute_ms if objective == "time" else s.recompute_flops for s in segments))

