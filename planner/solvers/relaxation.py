"""Prove a plan the cheapest, or find a cheaper one: an optimistic memory account that the
simulator makes exact.

The ILP of :mod:`planner.solvers.solve` accounts memory conservatively, so it can pass over a cheaper
plan the simulator would accept. This module builds the opposite: a memory account over the
same chain of stages that never predicts more than the simulator, moment by moment, for any
plan. Its cheapest plan is then a lower bound on every plan's recompute time. Solved, replayed
in the simulator, and cut off (a no-good constraint on exactly that set of segments) when it
does not fit, the first candidate that fits is the cheapest plan over these stages (within the
MIP gap); a candidate that costs as much as the plan in hand proves that plan the cheapest.

The account starts from the unoptimized step's live bytes at each moment (a node's forward or
backward) over the budget and changes only what a plan provably changes there:

* a storage saved for backward is gone only if every node holding it at that moment is
  recomputed, and it is not the input of a segment that has started (forward: its last
  forward reader has run; backward: the savers still holding it are those at or before the
  node);
* a segment's inputs are held from its first forward node to its first node's backward, which
  adds the ones the unoptimized step had already freed;
* during a segment's backward, what its recompute saved for the nodes at or before the moment
  is back (once the recompute has run: a saving node at or after the moment, inside the segment,
  runs backward);
* each segment holds ``graph.segment_overhead_bytes`` over the same span.

Everything else the simulator counts (what a recompute allocates and frees on the way, its
temporaries) is left out, which can only lower the account.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.stages import build_stages
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
    >>> stages = build_stages(g, max_stages=32)
    >>> def run(prob):
    ...     prob.solve(pulp.PULP_CBC_CMD(msg=False))
    ...     return "CBC"
    >>> found = search_cheapest(g, stages, 7 * 2**20, float("inf"), run)
    >>> found.runs, found.cost_ms, found.proven
    ([(0, 1)], 2.0, True)
    >>> simulate(g, [["n1", "n2"]]).peak_bytes <= 7 * 2**20 < simulate(g).peak_bytes
    True
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pulp

from planner.core.costgraph import CostGraph
from planner.core.rerun import stage_run_costs
from planner.core.simulate import simulate
from planner.core.stages import Stage

__all__ = ["OptimisticAccount", "RelaxedSearchResult", "search_cheapest"]

log = logging.getLogger(__name__)

_ACCEPTED = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
Run = tuple[int, int]


@dataclass(frozen=True)
class RelaxedSearchResult:
    """What the search ended with.

    ``runs`` are ``(first_stage, last_stage)`` of a plan that fits and costs less than the plan
    in hand, or None. ``proven`` says that no plan over these stages costs less than what the
    search returns (``runs``, or else the plan in hand), within the MIP gap, by the simulator's
    account; False when the search stopped at its candidate limit, its time limit or a solver
    time limit first.
    """

    runs: list[Run] | None
    cost_ms: float
    proven: bool
    candidates: int
    #: a solve of the account stopped at the solver's time limit (its candidate was not its optimum)
    hit_time_limit: bool = False


class OptimisticAccount:
    """The optimistic memory account of one budget over a chain of stages, as a PuLP model.

    ``y[(a, b)]`` is the binary "stages ``a..b`` run as one checkpointed segment";
    :meth:`add_moment` constrains one moment of the unoptimized step (``moments`` lists those
    over the budget). The objective is the recompute time, with a tie-break towards fewer
    segments far below any node's time; ``run_ms`` and ``run_flops`` price every run, for
    another objective (:mod:`planner.bounds.reach` sets its own).
    """

    def __init__(self, graph: CostGraph, stages: list[Stage], budget_bytes: int) -> None:
        self.graph = graph
        self.stages = stages
        self.budget_bytes = budget_bytes
        nodes = graph.nodes
        self.pos = {n.name: i for i, n in enumerate(nodes)}
        sizes = graph.storage_by_key
        self.size = {k: s.size_bytes for k, s in sizes.items()}
        persistent = {k for k, s in sizes.items() if s.persistent}
        values = {n.name: [k for k in n.output_storages if k not in persistent] for n in nodes}
        self.made_at: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        for i, node in enumerate(nodes):
            for k in (*node.output_storages, *node.saved_storages):
                if k not in persistent:
                    self.made_at.setdefault(k, i)
                    self.last_use[k] = max(self.last_use.get(k, i), i)
            for name in node.input_names:
                for k in values[name]:
                    self.last_use[k] = max(self.last_use.get(k, i), i)
        self.returned = {k for name in graph.held_output_names for k in values[name]}
        self.stage_of = {name: j for j, st in enumerate(stages) for name in st.node_names}
        self.first_pos = [self.pos[st.node_names[0]] for st in stages]
        self.last_pos = [self.pos[st.node_names[-1]] for st in stages]
        # savers of each freeable storage, by position
        savers: dict[int, list[int]] = {}
        for node in graph.compute_nodes:
            for k in set(node.saved_storages) - persistent - self.returned:
                savers.setdefault(k, []).append(self.pos[node.name])
        self.savers = {k: sorted(ps) for k, ps in savers.items()}
        # readers of each storage, by stage, to find the segments it is an input of
        self.reader_stages: dict[int, list[int]] = {}
        for node in graph.compute_nodes:
            j = self.stage_of[node.name]
            for name in node.input_names:
                for k in values[name]:
                    self.reader_stages.setdefault(k, []).append(j)
        self.stage_of_made = {k: self._stage_at(p) for k, p in self.made_at.items()}
        #: storages something may hold past their unoptimized lifetime (a subclass adds to it)
        self.holdable: set[int] = set(self.reader_stages)

        unoptimized = simulate(graph)
        self.moments = [(phase, name, live) for phase, name, live in unoptimized.timeline if live > budget_bytes]
        runs_backward = {name for phase, name, _ in unoptimized.timeline if phase == "backward"}
        self.saving_backward = sorted(self.pos[n.name] for n in graph.compute_nodes
                                      if n.saved_storages and n.name in runs_backward)
        self.run_ms, self.run_flops = stage_run_costs(graph, stages)
        count = len(stages)
        self.runs = [(a, b) for a in range(count) for b in range(a, count)
                     if all(stages[j].recomputable for j in range(a, b + 1))]
        self._fresh = {run: self._fresh_saved(run, persistent, values) for run in self.runs}

        self.prob = pulp.LpProblem("optimistic_account", pulp.LpMinimize)
        self.y = {run: self._var(f"recompute_stages_{run[0]}_to_{run[1]}", cat="Binary") for run in self.runs}
        total_ms = graph.forward_ms or 1.0
        # a tie-break towards fewer segments, far below any node's time
        self.prob += pulp.lpSum(v * (self.cost_ms([r]) + 1e-6 * total_ms) for r, v in self.y.items())
        self.covering: list[list[pulp.LpVariable]] = [[] for _ in stages]
        for (a, b), v in self.y.items():
            for j in range(a, b + 1):
                self.covering[j].append(v)
        for j, cover in enumerate(self.covering):
            if len(cover) > 1:
                self.prob += pulp.lpSum(cover) <= 1, f"one_segment_over_stage_{j}"
        self._freed: dict[tuple[int, int], pulp.LpVariable] = {}
        self._held: dict[tuple[int, int], pulp.LpVariable | None] = {}
        self.constrained: set[tuple[str, str]] = set()

    def _var(self, name: str, **kwargs: object) -> pulp.LpVariable:
        if hasattr(self.prob, "add_variable"):
            return self.prob.add_variable(name, **kwargs)
        return pulp.LpVariable(name, **kwargs)  # pragma: no cover - PuLP before 3.3

    def _stage_at(self, position: int) -> int:
        """The stage whose first node is at or before ``position`` (-1 before the first)."""
        return bisect.bisect_right(self.first_pos, position) - 1

    def cost_ms(self, runs: list[Run]) -> float:
        """Recompute time of the stage runs ``runs`` (:mod:`planner.core.rerun`)."""
        return sum(self.run_ms[run] for run in runs)

    def _fresh_saved(self, run: Run, persistent: set[int], values: dict[str, list[int]]) -> tuple[list[int], list[int]]:
        """What the run's recompute saves afresh (storages its nodes save that are not its
        inputs), as positions of their first savers, ascending, and the running total of their
        bytes."""
        a, b = run
        names = [n for st in self.stages[a : b + 1] for n in st.node_names]
        inside = set(names)
        inputs = {k for n in names for i in self.graph.node(n).input_names if i not in inside for k in values[i]}
        first: dict[int, int] = {}
        for n in names:
            for k in self.graph.node(n).saved_storages:
                if k not in persistent and k not in inputs:
                    first.setdefault(k, self.pos[n])
        pairs = sorted((p, self.size[k]) for k, p in first.items())
        return [p for p, _ in pairs], list(itertools.accumulate(size for _, size in pairs))

    def _freed_var(self, k: int, holders: int) -> pulp.LpVariable:
        """1 only if the first ``holders`` savers of ``k`` (by position) are all recomputed."""
        key = (k, holders)
        if key not in self._freed:
            v = self._freed[key] = self._var(f"freed_{k}_by_{holders}", lowBound=0, upBound=1)
            for j in sorted({self.stage_of[self.graph.nodes[p].name] for p in self.savers[k][:holders]}):
                if not self.stages[j].recomputable:
                    self.prob += v <= 0, f"freed_{k}_by_{holders}_kept_at_stage_{j}"
                    break
                self.prob += v <= pulp.lpSum(self.covering[j]), f"freed_{k}_by_{holders}_needs_stage_{j}"
        return self._freed[key]

    def _held_var(self, k: int, stage: int) -> pulp.LpVariable | None:
        """At least 1 when a chosen segment starting at or before ``stage`` reads ``k`` made
        before it (so holds it as an input); None when no segment can."""
        key = (k, stage)
        if key in self._held:
            return self._held[key]
        made = self.stage_of_made.get(k, -1)
        if stage <= made:
            self._held[key] = None
            return None
        earlier = self._held_var(k, stage - 1)
        readers = [j for j in self.reader_stages.get(k, ()) if j >= stage]
        starting = [self.y[(stage, b)] for b in range(min(readers), len(self.stages)) if (stage, b) in self.y] \
            if readers else []
        if earlier is None and not starting:
            self._held[key] = None
            return None
        v = self._var(f"input_{k}_held_at_stage_{stage}", lowBound=0, upBound=1)
        if earlier is not None:
            self.prob += v >= earlier, f"input_{k}_held_at_stage_{stage}_after_{stage - 1}"
        if starting:
            self.prob += v >= pulp.lpSum(starting), f"input_{k}_held_by_segments_from_{stage}"
        self._held[key] = v
        return v

    def _holds(self, k: int, phase: str, position: int, stage: int) -> list[tuple[str, pulp.LpVariable]]:
        """What may hold storage ``k`` at a moment beyond the unoptimized step, each ``(reason,
        variable at least 1 when it holds)``: here a segment that has it as an input."""
        held = self._held_var(k, stage)
        return [] if held is None else [("input", held)]

    def next_saving_backward(self, position: int) -> int:
        """The first node at or after ``position`` that saves something and runs backward (its
        position; past the last node when none): where a segment over it has recomputed by then."""
        at = bisect.bisect_left(self.saving_backward, position)
        return self.saving_backward[at] if at < len(self.saving_backward) else len(self.pos)

    def chosen_runs(self) -> list[Run]:
        """The segments of the last solution, as ``(first_stage, last_stage)``."""
        return sorted(r for r, v in self.y.items() if (v.value() or 0) > 0.5)

    def _live_unoptimized(self, k: int, phase: str, position: int) -> bool:
        if k in self.returned:
            return True
        if phase == "forward":
            return self.made_at[k] <= position and (self.last_use[k] >= position or k in self.savers)
        return k in self.savers and self.savers[k][0] <= position

    def add_moment(self, phase: str, name: str, live_bytes: int) -> None:
        """Constrain the account at one moment of the unoptimized step to fit the budget."""
        if (phase, name) in self.constrained:
            return
        index = len(self.constrained)
        self.constrained.add((phase, name))
        q = self.pos[name]
        stage = self._stage_at(q)
        freed = []
        for k, holders in self.savers.items():
            if phase == "forward":
                if not (self.made_at[k] < q and self.last_use[k] < q):
                    continue
                count = len(holders)
            else:
                count = sum(p <= q for p in holders)
                if count == 0:
                    continue
            credit = self._freed_var(k, count)
            holds = self._holds(k, phase, q, stage)
            if holds:
                limited = self._var(f"freed_{k}_at_moment_{index}", lowBound=0, upBound=1)
                self.prob += limited <= credit, f"freed_{k}_at_moment_{index}_by_savers"
                for why, hold in holds:
                    self.prob += limited <= 1 - hold, f"freed_{k}_at_moment_{index}_unless_{why}"
                credit = limited
            freed.append(self.size[k] * credit)
        added = []
        overhead = self.graph.segment_overhead_bytes
        next_saving = self.next_saving_backward(q)
        for (a, b), v in self.y.items():
            if a > stage:
                continue
            extra = overhead
            if phase == "backward" and b >= stage and next_saving <= self.last_pos[b]:
                # inside the segment, after its recompute ran (at a saving node at or after q
                # inside it): what it saved for the nodes up to q is held again
                positions, running_bytes = self._fresh[(a, b)]
                upto = bisect.bisect_right(positions, q)
                extra += running_bytes[upto - 1] if upto else 0
            if extra:
                added.append(extra * v)
        for k in self.holdable:
            if k in self.made_at and not self._live_unoptimized(k, phase, q):
                holds = self._holds(k, phase, q, stage)
                if len(holds) == 1:
                    added.append(self.size[k] * holds[0][1])
                elif holds:  # held while any of them holds it
                    either = self._var(f"held_{k}_at_moment_{index}", lowBound=0, upBound=1)
                    for why, hold in holds:
                        self.prob += either >= hold, f"held_{k}_at_moment_{index}_as_{why}"
                    added.append(self.size[k] * either)
        self.prob += (pulp.lpSum(freed) - pulp.lpSum(added) >= live_bytes - self.budget_bytes,
                      f"fits_at_{phase}_of_{name}")

    def exclude(self, runs: list[Run], index: int) -> None:
        """A no-good cut: never this exact set of segments again."""
        chosen = set(runs)
        self.prob += (pulp.lpSum(v for r, v in self.y.items() if r in chosen)
                      - pulp.lpSum(v for r, v in self.y.items() if r not in chosen) <= len(chosen) - 1,
                      f"not_candidate_{index}")


def search_cheapest(
    graph: CostGraph,
    stages: list[Stage],
    budget_bytes: int,
    incumbent_ms: float,
    run_milp: Callable[[pulp.LpProblem], str],
    *,
    max_candidates: int = 32,
    max_moments: int = 256,
    time_limit_s: float = 30.0,
) -> RelaxedSearchResult:
    """The cheapest plan over ``stages`` that fits ``budget_bytes`` if it costs less than
    ``incumbent_ms`` (the plan in hand; ``inf`` when there is none), by the search in the
    module docstring. A finite ``incumbent_ms`` is also a cut-off in the MILP (its objective at
    most that), so the solver prunes what cannot beat it, which shortens the search where the
    plan in hand is cheap (docs/tuning.md#search_cheapest).

    ``run_milp(prob)`` solves a PuLP problem (the caller's solver, gap and time limit) and
    returns the solver's name. At most ``max_candidates`` candidates are replayed; the account
    starts from the ``max_moments`` fullest moments over the budget and adds those where a
    rejected candidate is over it. ``time_limit_s`` stops the search between candidates.

    Example:
        See the module docstring.
    """
    started = time.perf_counter()
    account = OptimisticAccount(graph, stages, budget_bytes)
    if not account.moments:
        return RelaxedSearchResult([], 0.0, True, 0)
    for phase, name, live in sorted(account.moments, key=lambda m: -m[2])[:max_moments]:
        account.add_moment(phase, name, live)
    over = {(phase, name): live for phase, name, live in account.moments}
    if math.isfinite(incumbent_ms):
        # a cut-off: the solver prunes every branch that cannot beat the plan in hand
        account.prob += account.prob.objective <= incumbent_ms, "cheaper_than_the_plan_in_hand"
    stopped = False
    for candidate in range(max_candidates):
        run_milp(account.prob)
        if account.prob.status == pulp.LpStatusInfeasible:
            return RelaxedSearchResult(None, incumbent_ms, True, candidate)
        if account.prob.sol_status not in _ACCEPTED:
            log.info("optimistic account: no solution (%s); stopping", pulp.LpStatus[account.prob.status])
            break
        optimal = account.prob.sol_status == pulp.LpSolutionOptimal
        stopped = stopped or not optimal
        runs = account.chosen_runs()
        cost = account.cost_ms(runs)
        if cost >= incumbent_ms - 1e-9:
            # the account's optimum (within the gap) costs as much: nothing over these stages is cheaper
            return RelaxedSearchResult(None, incumbent_ms, optimal, candidate + 1, stopped)
        names = [[n for st in stages[a : b + 1] for n in st.node_names] for a, b in runs]
        replay = simulate(graph, names)
        log.info("optimistic account: candidate %d, %d segments, %.2f ms, simulated peak %d bytes (budget %d)",
                 candidate, len(runs), cost, replay.peak_bytes, budget_bytes)
        if replay.peak_bytes <= budget_bytes:
            return RelaxedSearchResult(runs, cost, optimal, candidate + 1, stopped)
        account.exclude(runs, candidate)
        for phase, name, live in replay.timeline:
            if live > budget_bytes and (phase, name) in over:
                account.add_moment(phase, name, over[(phase, name)])
        if time.perf_counter() - started > time_limit_s:
            break
    return RelaxedSearchResult(None, incumbent_ms, False, max_candidates, stopped)
