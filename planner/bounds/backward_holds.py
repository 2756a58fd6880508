"""What a plan holds in the backward that the unoptimized step has already freed: the
transients a recomputed node reads from outside its segment, for the covering bounds of
:mod:`planner.bounds.covering` and :mod:`planner.bounds.segment_covering`.

A transient is a storage nothing saves for backward: the unoptimized step frees it after its
last reader in the forward. When a reader ``r`` runs again in a recompute while the transient's
maker ``m`` does not, the recompute needs the transient, so the plan holds it:

* **m outside r's segment**: the segment holds it as an input from its forward until the
  backward of its first node, so at the backward of every node from ``r`` on (a residual add
  rerun without the projection before it holds the projection's output through the whole
  backward of everything after it, the loss included).
* **m kept in r's segment** by a selective policy: the policy's cache holds it until the
  segment is recomputed, at the backward of the segment's last node that saves something and
  runs backward. At the backward of node ``t`` it is released only if the segment reaches the
  first such node at or after ``t`` (``trigger``), and every node of a segment that keeps
  anything pays the policy's cost (``selective_overhead_ms_per_node``,
  :func:`planner.solvers.keep.policy_ms`). So a release at ``t`` costs the policy on every node
  from ``m`` to ``t``'s trigger: ``spread[j]`` (node ``j`` lies in a segment that keeps
  something) bounds each release from above, and the objective pays for it.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.bounds.storage_uses import StorageUses
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,)),
    ...          CostNode("lin", "op", input_names=("x",), output_storages=(1,), saved_storages=(0,)),
    ...          CostNode("add", "op", input_names=("lin", "x"), output_storages=(2,)),
    ...          CostNode("norm", "op", input_names=("add",), output_storages=(3,), saved_storages=(2,))]
    >>> g = CostGraph(tuple(nodes), (Storage(0, 2**20, True), *(Storage(k, 2**20) for k in (1, 2, 3))), ("norm",))
    >>> prob = pulp.LpProblem("holds", pulp.LpMinimize)
    >>> rerun = {n: prob.add_variable(n, cat=pulp.LpBinary) for n in ("lin", "add", "norm")}
    >>> holds = BackwardHolds(g, StorageUses(g), prob, rerun, backward_positions=[3])
    >>> prob += rerun["add"] == 1
    >>> prob.setObjective(pulp.lpSum(holds.held_mib(3)) + rerun["lin"] * 2)
    >>> _ = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    >>> pulp.value(prob.objective)  # add reruns without lin: lin's 1 MiB held at norm's backward
    1.0
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
import pulp

from planner.bounds.storage_uses import StorageUses
from planner.core.costgraph import MIB, CostGraph

__all__ = ["BackwardHolds", "MAX_RELEASE_STOPS", "held_transient_bytes", "trigger_ranks"]

#: the triggers a release chain shares across transients; a moment between two of them is
#: charged up to the earlier one only (a weaker charge, and fewer constraints)
MAX_RELEASE_STOPS = 32


def trigger_ranks(graph: CostGraph, runs_backward: set[str]) -> list[int | None]:
    """For each compute rank, the first rank at or after it whose node saves something and
    runs backward (``runs_backward``): the node whose backward recomputes a segment over both.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("a", "op", saved_storages=(1,)), CostNode("b", "op"),
        ...                CostNode("c", "op", saved_storages=(2,)), CostNode("d", "op")),
        ...               (Storage(1, 8), Storage(2, 8)))
        >>> trigger_ranks(g, {"a", "b", "c", "d"})
        [0, 2, 2, None]
    """
    compute = list(graph.compute_nodes)
    following: int | None = None
    out: list[int | None] = [None] * len(compute)
    for i in range(len(compute) - 1, -1, -1):
        if compute[i].saved_storages and compute[i].name in runs_backward:
            following = i
        out[i] = following
    return out


def held_transient_bytes(graph: CostGraph, reruns: Collection[str], node: str) -> int:
    """The bytes of transients held at ``node``'s backward by a plan of whole segments that
    reruns ``reruns`` (each a segment's input where its maker does not rerun): what a bound that
    lets those transients go at that moment would count as free.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("lin", "op", input_names=("x",), output_storages=(1,)),
        ...                CostNode("add", "op", input_names=("lin",), output_storages=(2,)),
        ...                CostNode("norm", "op", input_names=("add",), output_storages=(3,), saved_storages=(2,))),
        ...               (Storage(0, 8, True), Storage(1, 64), Storage(2, 64), Storage(3, 8)), ("norm",))
        >>> held_transient_bytes(g, {"add"}, "norm"), held_transient_bytes(g, {"lin", "add"}, "norm")
        (64, 0)
    """
    uses = StorageUses(graph)
    here = uses.position[node]
    return sum(uses.sizes[k].size_bytes for k in uses.transient_keys if uses.maker[k] not in reruns
               and any(r in reruns and uses.position[r] <= here for r in uses.readers[k]))


class BackwardHolds:
    """The transients held at backward moments (module docstring), added to ``prob``.

    ``rerun`` maps rerunnable node names to their "runs again" variables. ``kept`` (the model's
    own keep variables) excuses a hold where the model keeps the maker; makers in ``may_keep``
    that ``kept`` does not cover are released only as the policy's cost allows, at
    ``policy_ms_per_node`` per node (0: never charged). ``backward_positions`` are the
    positions (in ``graph.nodes``) of the backward moments the model constrains;
    ``runs_backward`` the nodes whose backward runs (None: every compute node, which can only
    place triggers earlier and so release more). Read the held MiB at a moment with
    :meth:`held_mib`; :attr:`spread_cost` goes into the objective.
    """

    def __init__(self, graph: CostGraph, uses: StorageUses, prob: pulp.LpProblem,
                 rerun: dict[str, pulp.LpVariable], *, kept: dict[str, pulp.LpVariable] | None = None,
                 may_keep: frozenset[str] = frozenset(), policy_ms_per_node: float = 0.0,
                 backward_positions: Sequence[int] = (), runs_backward: set[str] | None = None) -> None:
        self.prob = prob
        self.uses = uses
        compute = list(graph.compute_nodes)
        self.rank = {n.name: i for i, n in enumerate(compute)}
        ranks_at = {uses.position[n.name]: i for i, n in enumerate(compute)}
        triggers = trigger_ranks(graph, {n.name for n in compute} if runs_backward is None else runs_backward)
        #: per backward position, its trigger rank (None: no later node recomputes anything)
        self.trigger = {p: triggers[ranks_at[p]] for p in backward_positions if p in ranks_at}
        kept = kept or {}
        released = policy_ms_per_node > 0
        self.policy_ms_per_node = policy_ms_per_node
        self.spread: dict[int, pulp.LpVariable] = {}
        self.spread_cost: pulp.LpAffineExpression | float = 0.0
        #: every moment's trigger, and the few of them the shared release chains stop at
        self._triggers = sorted({t for t in self.trigger.values() if t is not None}) if released else []
        step = -(-len(self._triggers) // MAX_RELEASE_STOPS) if self._triggers else 1
        self._stops = self._triggers[::step]
        self._between: list[pulp.LpVariable] = []
        #: per transient: (MiB, readers' positions, their hold variables, releases or None)
        self.chains: list[tuple[float, list[int], list[pulp.LpVariable], _Releases | None]] = []
        self._held: dict[tuple[int, int, int], pulp.LpVariable] = {}
        for k in uses.transient_keys:
            maker = uses.maker[k]
            chargeable = maker not in may_keep or maker in kept
            if not chargeable and not released:
                continue
            readers = sorted(uses.readers[k], key=uses.position.__getitem__)
            excuse = kept.get(maker, 0) if chargeable else 0
            positions, chain = [], []
            for r in readers:
                held = prob.add_variable(f"held_{k}_back_from_{uses.position[r]}", lowBound=0, upBound=1)
                prob += held >= rerun[r] - rerun.get(maker, 0) - excuse, f"hold_{k}_back_for_{r}"
                if chain:
                    prob += held >= chain[-1], f"hold_{k}_back_from_{r}_on"
                positions.append(uses.position[r])
                chain.append(held)
            releases = None if chargeable else self._releases(k, self.rank[maker])
            self.chains.append((uses.sizes[k].size_bytes / MIB, positions, chain, releases))

    def _spread(self, j: int) -> pulp.LpVariable:
        """Whether compute rank ``j`` lies in a segment that keeps something (the policy runs on it)."""
        if j not in self.spread:
            self.spread[j] = self.prob.add_variable(f"policy_on_{j}", cat=pulp.LpBinary)
            self.spread_cost = self.spread_cost + self.policy_ms_per_node * self.spread[j]
        return self.spread[j]

    def spread_at(self, j: int) -> pulp.LpVariable:
        """Whether compute rank ``j`` lies in a segment that keeps something, charged at the
        policy's cost in :attr:`spread_cost`."""
        return self._spread(j)

    def _within(self, v: pulp.LpVariable, first: int, last: int, name: str) -> None:
        for j in range(first, last + 1):
            self.prob += v <= self._spread(j), f"{name}_on_{j}"

    def _shared(self, i: int) -> pulp.LpVariable:
        """At most ``spread`` on every rank after stop ``i - 1`` up to stop ``i``."""
        while len(self._between) <= i:
            at = len(self._between)
            v = self.prob.add_variable(f"policy_to_stop_{at}", lowBound=0, upBound=1)
            self._within(v, self._stops[at - 1] + 1 if at else 0, self._stops[at], f"policy_to_stop_{at}")
            self._between.append(v)
        return self._between[i]

    def _releases(self, k: int, made: int) -> _Releases | None:
        """Whether the maker's segment (keeping it, so selective) reaches each trigger: the first
        trigger after the maker, then each stop after that."""
        after = bisect.bisect_right(self._triggers, made)
        if after == len(self._triggers):
            return None  # no moment's recompute comes after the maker: nothing can release it
        first = self._triggers[after]
        initial = self.prob.add_variable(f"released_{k}_by_{first}", lowBound=0, upBound=1)
        self._within(initial, made, first, f"released_{k}_by_{first}")
        by_stop: dict[int, pulp.LpVariable] = {}
        previous, reached = initial, first
        for i in range(bisect.bisect_right(self._stops, first), len(self._stops)):
            v = self.prob.add_variable(f"released_{k}_by_{self._stops[i]}", lowBound=0, upBound=1)
            self.prob += v <= previous, f"released_{k}_by_{self._stops[i]}_nested"
            if not by_stop:  # from the first trigger on, up to a stop not shared with other makers
                self._within(v, reached + 1, self._stops[i], f"released_{k}_by_{self._stops[i]}")
            else:
                self.prob += v <= self._shared(i), f"released_{k}_by_{self._stops[i]}_shared"
            by_stop[i] = v
            previous = v
        return _Releases(first, initial, by_stop)

    def held_mib(self, here: int) -> list[pulp.LpAffineExpression]:
        """The MiB of transients held at the backward of the node at position ``here`` (one of
        ``backward_positions``)."""
        trigger = self.trigger.get(here)
        # the last stop at or before the trigger: a segment reaching the trigger reaches it
        stop = -1 if trigger is None else bisect.bisect_right(self._stops, trigger) - 1
        terms = []
        for c, (mib, positions, chain, releases) in enumerate(self.chains):
            reached = bisect.bisect_right(positions, here) - 1
            if reached < 0:
                continue
            release = None if releases is None or trigger is None else releases.by(stop)
            if release is None:
                terms.append(mib * chain[reached])
                continue
            key = (c, reached, stop)
            if key not in self._held:
                held = self.prob.add_variable(f"held_{c}_{reached}_until_{stop}", lowBound=0, upBound=1)
                self.prob += held >= chain[reached] - release, f"held_{c}_{reached}_unless_released_by_{stop}"
                self._held[key] = held
            terms.append(mib * self._held[key])
        return terms


class _Releases:
    """One transient's release variables: by its first trigger after the maker, and by each
    shared stop after that."""

    def __init__(self, first: int, initial: pulp.LpVariable, by_stop: dict[int, pulp.LpVariable]) -> None:
        self.first = first
        self.initial = initial
        self.by_stop = by_stop

    def by(self, stop: int) -> pulp.LpVariable:
        """The release by a moment whose trigger is at or after the maker's first one, and whose
        last stop at or before its trigger is ``stop``."""
        return self.by_stop.get(stop, self.initial)
