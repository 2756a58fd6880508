"""A lower bound on the recompute any plan needs, that knows what a recompute holds in the
backward: the covering bound of :mod:`planner.bounds.covering` with the segments' structure added.

The covering bound lets a storage saved for backward be gone at any moment where nothing
reads it, once the node that made it runs again. It ignores that a segment's recompute brings
its activations back while its backward runs, so at checkpoint-every-layer's peak it can stay
at half the cheapest plan. Plans of checkpointed segments (:mod:`planner.core.simulate`) obey three
more rules, and this bound adds them with a binary ``brk[k]`` for "compute nodes ``k`` and
``k + 1`` do not lie in one segment":

* **A recompute restores what its segment saved.** A segment is recomputed at the backward of
  its last saving node, before the backward of any earlier node of it. So a storage its maker
  ``n`` re-creates is gone at the backward of node ``t`` only if ``n``'s segment ends before
  the first saving node at or after ``t``: a break between ``n`` and that node.
* **Its savers share its maker's segment, and everything between them runs again.** A saver
  outside that segment holds the storage (its own save, or its segment's input) until its
  backward. So in the forward, and in the backward until that saver's, the storage is gone only
  with no break from its maker to the saver, and every node in between (all before the
  segment's last save) running again, or, with ``kept_outputs``, kept by a selective policy.
* **A value read across a break is held.** A segment holds its inputs from its forward to the
  end of its backward: a storage read by a rerun node beyond a break after its maker is live
  through the forward and, in the backward, until that reader's.

In the forward a storage also stays until its last reader there. A transient (nothing saves
it) read by a rerun node whose maker does not rerun is held in the backward as the covering
bound holds it (:mod:`planner.bounds.backward_holds`), the selective policy charged once per
node a keeping segment covers. Every plan satisfies all of
these, kept outputs included (``kept_outputs=False`` bounds plans of whole segments only, which
is what the planner emits by default), so the least cost under them, proven by HiGHS (its dual
bound, valid at its time limit too) or by the LP relaxation with CBC, is a lower bound, never
below the covering bound's model. It is a MILP with one binary per node and per gap between
nodes, and a continuous variable per storage and over-budget backward moment, which HiGHS
does not close within minutes on real models, though its bound by then is well above the
covering bound's (docs/tuning.md#segment_covering_bound).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.bounds.covering import covering_bound
    >>> from planner.core.simulate import simulate
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):  # a chain of six 1 MiB nodes, each saving its own output
    ...     nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
    >>> simulate(g).peak_bytes // 2**20
    9
    >>> covering_bound(g, 6 * 2**20).value, segment_covering_bound(g, 6 * 2**20).value
    (3.0, 3.0)
    >>> covering_bound(g, 5 * 2**20).value, segment_covering_bound(g, 5 * 2**20).value  # no plan fits 5
    (4.0, inf)
"""

from __future__ import annotations

import logging
import math
import time

import pulp

from planner.bounds.backward_holds import BackwardHolds
from planner.bounds.covering import (
    MIB,
    LowerBound,
    check_bound_arguments,
    highs_lp_bound,
    least_rerun_cost,
    moments_over,
    proven_bound,
    settled_without_solving,
)
from planner.bounds.storage_uses import StorageUses
from planner.core.costgraph import CostGraph, CostNode
from planner.core.options import SolveOptions
from planner.solvers.stage_ilp import available_solvers
from planner.core.simulate import SimulationResult

__all__ = ["segment_covering_bound"]

log = logging.getLogger(__name__)


class _SegmentCoveringModel:
    """The MILP of the module docstring for one graph and budget."""

    def __init__(self, graph: CostGraph, unoptimized: SimulationResult, budget_bytes: int, objective: str,
                 max_moments: int, kept_outputs: bool) -> None:
        uses = StorageUses(graph)
        self.uses = uses
        compute = list(graph.compute_nodes)
        self.rank = {n.name: i for i, n in enumerate(compute)}
        runs_backward = {name for phase, name, _ in unoptimized.timeline if phase == "backward"}
        #: for each compute rank, the first rank at or after it whose backward recomputes its segment
        self.next_saver: list[int | None] = [None] * len(compute)
        following: int | None = None
        for i in range(len(compute) - 1, -1, -1):
            if compute[i].saved_storages and compute[i].name in runs_backward:
                following = i
            self.next_saver[i] = following

        self.prob = pulp.LpProblem("segment_covering_bound", pulp.LpMinimize)
        ordered = sorted(uses.rerunnable, key=self.rank.__getitem__)
        self.x = {name: self.prob.add_variable(f"rerun_{self.rank[name]}", cat=pulp.LpBinary) for name in ordered}
        #: kept by a selective policy (not rerun; what it made stays held until its segment's recompute)
        self.kept = {name: self.prob.add_variable(f"kept_{self.rank[name]}", cat=pulp.LpBinary)
                     for name in ordered if kept_outputs and graph.node(name).selective_save}
        for name, kept in self.kept.items():
            self.prob += kept + self.x[name] <= 1, f"kept_{self.rank[name]}_is_not_rerun"
        policy_ms = graph.selective_overhead_ms_per_node if objective == "time" else 0.0
        self.brk = [self.prob.add_variable(f"break_after_{k}", cat=pulp.LpBinary) for k in range(len(compute) - 1)]

        #: per freeable storage: dropped in the forward; contiguous from its maker to each saver
        #: (by rank); held for a rerun reader beyond a break
        self.dropped: dict[int, pulp.LpVariable] = {}
        self.contiguous: dict[int, list[tuple[int, pulp.LpVariable]]] = {}
        self.held_for: dict[int, list[tuple[int, pulp.LpVariable]]] = {}
        for _, maker, _, k, savers in uses.freeable:
            self._add_storage(compute, k, maker, savers)
        self.transients = uses.add_transients(self.prob, self.x, self.kept)
        self.moments = moments_over(graph, unoptimized, budget_bytes, max_moments)
        # a kept maker releases a transient only where its selective segment reaches the
        # moment's recompute; the policy's cost is charged once per node such a segment covers
        self.holds = BackwardHolds(
            graph, uses, self.prob, self.x, kept=None if policy_ms > 0 else self.kept,
            may_keep=frozenset(self.kept), policy_ms_per_node=policy_ms,
            backward_positions=[uses.position[name] for phase, name, _ in self.moments if phase == "backward"],
            runs_backward=runs_backward)
        for name, kept in self.kept.items():
            if policy_ms > 0:
                self.prob += kept <= self.holds.spread_at(self.rank[name]), f"kept_{self.rank[name]}_runs_the_policy"
        self.prob.setObjective(pulp.lpSum(least_rerun_cost(graph, graph.node(name), objective) * v
                                          for name, v in self.x.items()) + self.holds.spread_cost)

        self.infeasible = False
        self.gone_variables = 0
        for c, (phase, name, live) in enumerate(self.moments):
            self._add_moment(c, phase, name, (live - budget_bytes) / MIB)
            if self.infeasible:
                break

    def _add_storage(self, compute: list[CostNode], k: int, maker: str, savers: set[str]) -> None:
        prob, x, brk = self.prob, self.x, self.brk
        made = self.rank[maker]
        dropped = prob.add_variable(f"dropped_{k}", lowBound=0, upBound=1)
        prob += dropped <= x[maker], f"dropped_{k}_only_if_its_maker_reruns"
        chain: list[tuple[int, pulp.LpVariable]] = []
        previous = made
        for saver in sorted({self.rank[s] for s in savers} - {made}):
            together = prob.add_variable(f"contiguous_{k}_to_{saver}", lowBound=0, upBound=1)
            if chain:
                prob += together <= chain[-1][1], f"contiguous_{k}_to_{saver}_nested"
            for b in range(previous, saver):
                prob += together + brk[b] <= 1, f"contiguous_{k}_to_{saver}_no_break_{b}"
                between = compute[b]
                if between.name not in x:
                    prob += together <= 0, f"contiguous_{k}_to_{saver}_not_rerunnable_{b}"
                elif b != made:
                    prob += (together <= x[between.name] + self.kept.get(between.name, 0),
                             f"contiguous_{k}_to_{saver}_reruns_{b}")
            saver_name = compute[saver].name
            if saver_name not in self.uses.stop_before:
                # a saver outside its segments holds what it saved (planner.bounds.saver_holds)
                prob += (together <= x[saver_name] + self.kept.get(saver_name, 0),
                         f"contiguous_{k}_to_{saver}_saver_reruns")
            chain.append((saver, together))
            previous = saver
        if chain:
            prob += dropped <= chain[-1][1], f"dropped_{k}_with_every_saver_in_segment"
        held: list[tuple[int, pulp.LpVariable]] = []
        for reader in self.uses.readers.get(k, []):
            at = self.rank[reader]
            if reader in savers or at <= made:
                continue
            holds = prob.add_variable(f"held_{k}_for_{at}", lowBound=0, upBound=1)
            for b in range(made, at):
                prob += holds >= x[reader] + brk[b] - 1, f"held_{k}_for_{at}_across_break_{b}"
            prob += dropped + holds <= 1, f"dropped_{k}_not_held_for_{at}"
            held.append((at, holds))
        self.dropped[k] = dropped
        self.contiguous[k] = chain
        self.held_for[k] = held

    def _add_moment(self, c: int, phase: str, name: str, excess_mib: float) -> None:
        uses = self.uses
        here = uses.position[name]
        at = self.rank[name]
        terms = []
        for first, maker, mib, k, savers in uses.freeable:
            if first > here:
                continue  # not saved yet (forward) or no longer needed (backward)
            if phase == "forward":
                if maker == name or uses.last_use.get(k, -1) >= here:
                    continue  # being made, or still to be read in the forward
                terms.append(mib * self.dropped[k])
                continue
            if name in savers:
                continue  # this backward reads it
            gone = self.prob.add_variable(f"gone_{k}_at_{c}", lowBound=0, upBound=1)
            self.gone_variables += 1
            self.prob += gone <= self.x[maker], f"gone_{k}_at_{c}_only_if_its_maker_reruns"
            trigger = self.next_saver[at]
            if trigger is not None:
                self.prob += (gone <= pulp.lpSum(self.brk[b] for b in range(self.rank[maker], trigger)),
                              f"gone_{k}_at_{c}_before_its_recompute")
            reached = [together for saver, together in self.contiguous[k] if saver <= at]
            if reached:
                self.prob += gone <= reached[-1], f"gone_{k}_at_{c}_with_its_savers_in_segment"
            for reader, holds in self.held_for[k]:
                if reader <= at:
                    self.prob += gone + holds <= 1, f"gone_{k}_at_{c}_not_held_for_{reader}"
            terms.append(mib * gone)
        if not terms:
            self.infeasible = True
            return
        if phase == "forward":
            held = [mib * v for last, v, mib in self.transients if last < here]
        else:
            held = self.holds.held_mib(here)
        self.prob += pulp.lpSum(terms) - pulp.lpSum(held) >= excess_mib, f"moment_{c}_{phase}_{name}"


def segment_covering_bound(
    graph: CostGraph,
    budget_bytes: int,
    *,
    objective: str = "time",
    kept_outputs: bool = True,
    max_moments: int = 256,
    time_limit_s: float = SolveOptions.time_limit_s,
    solver: str | None = None,
) -> LowerBound:
    """The least recompute time (ms) or FLOPs any plan fitting ``budget_bytes`` needs, by the
    MILP of the module docstring over the ``max_moments`` fullest moments of the unoptimized
    step (fewer moments can only lower it): HiGHS's dual bound after at most ``time_limit_s``
    (where installed, unless ``solver="CBC"``), else, or when HiGHS stops before proving any,
    the LP relaxation (CBC); where HiGHS stops before closing
    the gap, the larger of that and the LP relaxation by HiGHS (within ``time_limit_s`` more).
    ``kept_outputs=False`` bounds plans of whole segments only. ``inf`` when no plan fits by this account, 0 when the
    unoptimized step fits.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 64, True),))
        >>> segment_covering_bound(g, 64).value, segment_covering_bound(g, 63).value
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
    model = _SegmentCoveringModel(graph, unoptimized, budget_bytes, objective, max_moments, kept_outputs)
    if model.infeasible:
        return LowerBound(math.inf, "nothing freeable at a moment over the budget")
    value, method = proven_bound(model.prob, time_limit_s, solver)
    if solver != "CBC" and "within the" not in method and "HiGHS" in available_solvers():
        # HiGHS's root can take longer than its time limit where its LP relaxation alone
        # proves more (docs/tuning.md#segment_covering_bound)
        relaxed = highs_lp_bound(model.prob, time_limit_s)
        if relaxed > value:
            value, method = relaxed, "LP relaxation (HiGHS)"
    log.info("segment covering bound (%s%s): %s over %d moments, %d nodes, %d storage-moment variables, %.1f s",
             objective, "" if kept_outputs else ", segments only", value, len(model.moments), len(model.x),
             model.gone_variables, time.perf_counter() - started)
    return LowerBound(value, f"segment covering ILP: {method}")
