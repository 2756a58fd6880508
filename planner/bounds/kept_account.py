"""The optimistic memory account of :mod:`planner.solvers.relaxation`, extended to plans with kept outputs.

A selective segment (:mod:`planner.solvers.keep`) keeps the outputs of some of its nodes from the
forward instead of recomputing them: a kept node is not re-run, and what it allocated stays
held (by the selective policy's cache) from its forward until its segment's recompute, with
the input storages its ops returned views of. :class:`KeptOutputsAccount` adds that choice to
the account, node by node, and stays optimistic: for every plan of segments with kept outputs
it never predicts more than :func:`planner.core.simulate.simulate`, moment by moment.

* ``x[j]``: node ``j`` is kept. Only a node :func:`planner.solvers.keep.keepable_in_segment` allows: one
  the profiler marked ``selective_save``, in a segment that goes on to a later node saving
  something for backward (so the same segment covers ``j``'s stage and that node's stage).
* what ``j`` holds is counted from its forward on, and in the backward until its segment's
  recompute has run (at the segment's first saving node, in reverse, that runs backward):
  each such storage is freed at a moment only if no kept node holds it then, and one the
  unoptimized step had already freed is added back while one does.
* ``kept_time_ms[j]``, ``kept_flops[j]``: what keeping ``j`` takes off its segment's recompute
  (it runs wholly before the segment's last saver, so its whole time and FLOPs);
  ``policy_ms[t]`` the selective policy's cost on stage ``t`` (``selective_overhead_ms_per_node``
  on each of its nodes), charged while ``selective[t]`` (its segment keeps something).

Which segment covers a node, and where it ends, is read from per-stage sums of the segment
variables (``joined[t]``: one segment covers stages ``t`` and ``t + 1``), so the extension adds
variables and constraints in proportion to nodes times stages, not to segments times nodes.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.simulate import simulate
    >>> from planner.core.stages import build_stages
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i, (ms, mib) in enumerate([(8.0, 1), (1.0, 4)] * 3, start=1):  # slow-small, fast-large
    ...     nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=mib * 2**20, requires_grad=True,
    ...                           time_ms=ms, selective_save=True))
    >>> g = CostGraph(tuple(nodes), (Storage(0, 2**20, True), *(Storage(i, n.output_bytes)
    ...               for i, n in enumerate(nodes) if i)), ("n6",))
    >>> account = KeptOutputsAccount(g, build_stages(g, max_stages=6), 20 * 2**20)
    >>> for phase, name, live in account.moments:
    ...     account.add_moment(phase, name, live)
    >>> account.prob.setObjective(account.cost_expression(account.run_ms, account.kept_time_ms))
    >>> _ = account.prob.solve(pulp.PULP_CBC_CMD(msg=False))
    >>> round(pulp.value(account.prob.objective), 6), account.chosen_runs(), account.chosen_kept()
    (1.0, [(0, 3)], ['n1', 'n2', 'n3'])
    >>> from planner.solvers.keep import segment_with_kept
    >>> plan = [segment_with_kept(g, ("n1", "n2", "n3", "n4"), {"n1", "n2", "n3"})]
    >>> plan[0].recompute_ms, simulate(g, plan).peak_bytes <= 20 * 2**20  # the simulator agrees
    (1.0, True)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pulp

from planner.core.costgraph import CostGraph
from planner.solvers.keep import kept_storages
from planner.solvers.relaxation import OptimisticAccount
from planner.core.stages import Stage

__all__ = ["KeptOutputsAccount"]

log = logging.getLogger(__name__)


class KeptOutputsAccount(OptimisticAccount):
    """:class:`planner.solvers.relaxation.OptimisticAccount` with a keep decision per node (module
    docstring). Set the objective with :meth:`cost_expression`; read the chosen plan with
    :meth:`chosen_runs` and :meth:`chosen_kept`."""

    def __init__(self, graph: CostGraph, stages: list[Stage], budget_bytes: int) -> None:
        super().__init__(graph, stages, budget_bytes)
        count = len(stages)
        starting: list[list[pulp.LpVariable]] = [[] for _ in stages]
        ending: list[list[pulp.LpVariable]] = [[] for _ in stages]
        for (a, b), v in self.y.items():
            starting[a].append(v)
            ending[b].append(v)
        # covered[t] = segments over stage t; joined[t] = one segment over t and t + 1
        self.joined: list[pulp.LpVariable] = []
        self.covered: list[pulp.LpVariable] = []
        covered_before = None
        for t in range(count):
            covered = pulp.lpSum(starting[t]) + (covered_before if covered_before is not None else 0)
            var = self._var(f"covered_stage_{t}", lowBound=0, upBound=1)
            self.prob += var == covered, f"covered_stage_{t}_sum"
            self.covered.append(var)
            joined = self._var(f"joined_stage_{t}_to_next", lowBound=0, upBound=1)
            self.prob += joined == var - pulp.lpSum(ending[t]), f"joined_stage_{t}_sum"
            self.joined.append(joined)
            covered_before = joined

        nodes = graph.nodes
        compute_positions = [self.pos[n.name] for n in graph.compute_nodes]
        self.kept_time_ms: dict[str, float] = {}
        self.kept_flops: dict[str, int] = {}
        self.x: dict[str, pulp.LpVariable] = {}
        #: storages each kept node holds until its segment's recompute
        self.cached: dict[str, list[int]] = {}
        self.selective: dict[int, pulp.LpVariable] = {}
        self.policy_ms = {t: graph.selective_overhead_ms_per_node * len(st.node_names) for t, st in enumerate(stages)}
        next_saver = len(nodes)
        later_saver: dict[int, int] = {}
        for p in reversed(compute_positions):
            later_saver[p] = next_saver
            if nodes[p].saved_storages:
                next_saver = p
        for p in compute_positions:
            node = nodes[p]
            j = self.stage_of[node.name]
            if not (node.selective_save and self.stages[j].recomputable) or later_saver[p] >= len(nodes):
                continue
            last = self._stage_at(later_saver[p])
            held = [k for k in sorted(kept_storages(graph, node.name))
                    if self.made_at.get(k) == p or k in node.viewed_storages]
            v = self.x[node.name] = self._var(f"keep_{node.name}", cat="Binary")
            self.kept_time_ms[node.name] = node.time_ms
            self.kept_flops[node.name] = node.flops
            self.cached[node.name] = held
            self.prob += v <= self.covered[j], f"keep_{node.name}_inside_a_segment"
            for t in range(j, last):
                self.prob += v <= self.joined[t], f"keep_{node.name}_before_a_saver_{t}"
            for t in range(j, last + 1):
                self.prob += self._selective_var(t) >= v, f"keep_{node.name}_makes_stage_{t}_selective"
        for t in range(count - 1) if self.x else ():
            if self.stages[t].recomputable and self.stages[t + 1].recomputable:
                here, after = self._selective_var(t), self._selective_var(t + 1)
                self.prob += after >= here + self.joined[t] - 1, f"selective_stage_{t}_spreads_on"
                self.prob += here >= after + self.joined[t] - 1, f"selective_stage_{t + 1}_spreads_back"
        self.keepers: dict[int, list[str]] = {}
        for name, held in self.cached.items():
            for k in held:
                self.keepers.setdefault(k, []).append(name)
        self.holdable |= set(self.keepers)
        self._not_recomputed: dict[tuple[str, int], pulp.LpVariable] = {}
        log.info("kept outputs: %d candidate nodes over %d stages", len(self.x), count)

    def _selective_var(self, stage: int) -> pulp.LpVariable:
        if stage not in self.selective:
            self.selective[stage] = self._var(f"selective_stage_{stage}", lowBound=0, upBound=1)
        return self.selective[stage]

    def _not_recomputed_var(self, name: str, stage: int) -> pulp.LpVariable:
        """At least 1 when ``name`` is kept and its segment ends at or before ``stage``."""
        key = (name, stage)
        if key not in self._not_recomputed:
            j = self.stage_of[name]
            v = self._var(f"kept_{name}_until_after_stage_{stage}", lowBound=0, upBound=1)
            self.prob += v >= self.x[name] - self.joined[stage], f"kept_{name}_cut_after_stage_{stage}"
            if stage > j:
                self.prob += v >= self._not_recomputed_var(name, stage - 1), f"kept_{name}_still_after_stage_{stage}"
            self._not_recomputed[key] = v
        return self._not_recomputed[key]

    def _holds(self, k: int, phase: str, position: int, stage: int) -> list[tuple[str, pulp.LpVariable]]:
        holds = super()._holds(k, phase, position, stage)
        for name in self.keepers.get(k, ()):
            p = self.pos[name]
            if phase == "forward":
                if p <= position:
                    holds.append((f"kept_by_{name}", self.x[name]))
                continue
            # backward: held until the recompute, which runs at the segment's first saving node
            # (in reverse) that runs backward; not yet run at this moment when the segment ends
            # before the next such node
            after = self.next_saving_backward(position)
            if after <= p:
                continue
            last = len(self.stages) - 1 if after >= len(self.pos) else self._stage_at(after) - 1
            if last < self.stage_of[name]:
                continue  # the segment over the node reaches that saving node
            holds.append((f"kept_by_{name}", self._not_recomputed_var(name, last)))
        return holds

    def cost_expression(self, run_price: Mapping[tuple[int, int], float],
                        kept_price: Mapping[str, float], *, policy: bool = True) -> pulp.LpAffineExpression:
        """The recompute of a plan: ``run_price`` of each segment, less ``kept_price`` of each
        kept node, plus (``policy``) the selective policy's time on every stage of a segment
        that keeps something.

        Example:
            See the module docstring.
        """
        total = pulp.lpSum(v * run_price[run] for run, v in self.y.items())
        total -= pulp.lpSum(v * kept_price[name] for name, v in self.x.items())
        if policy:
            total += pulp.lpSum(v * self.policy_ms[t] for t, v in self.selective.items() if self.policy_ms[t])
        return total

    def chosen_kept(self) -> list[str]:
        """The kept nodes of the last solution, in graph order."""
        return sorted((n for n, v in self.x.items() if (v.value() or 0) > 0.5), key=self.pos.__getitem__)
