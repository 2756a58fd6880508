"""Who makes, reads and saves each storage of a profiled graph, as the covering bounds see it
(:mod:`planner.bounds.covering`, :mod:`planner.bounds.segment_covering`).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,)),
    ...          CostNode("a", "op", input_names=("x",), output_storages=(1,)),
    ...          CostNode("b", "op", input_names=("a",), output_storages=(2,), saved_storages=(1,))]
    >>> uses = StorageUses(CostGraph(tuple(nodes), (Storage(0, 2**20, True), Storage(1, 2**20), Storage(2, 2**20)),
    ...                              ("b",)))
    >>> [(maker, mib, k, sorted(savers)) for _, maker, mib, k, savers in uses.freeable]
    [('a', 1.0, 1, ['b'])]
"""

from __future__ import annotations

import pulp

from planner.core.costgraph import MIB, CostGraph
from planner.core.rerun import after_last_save_fraction

__all__ = ["StorageUses"]


class StorageUses:
    """Who makes, reads and saves each storage of ``graph``, as both covering bounds see it.

    ``freeable`` lists the saved storages a plan can free (made and saved by rerunnable nodes
    only, neither persistent nor returned) as ``(first saver's position, maker, MiB, storage,
    savers)``; ``transient_keys`` the storages nothing saves that rerunnable nodes read.
    Positions index ``graph.nodes``.
    """

    def __init__(self, graph: CostGraph) -> None:
        self.sizes = graph.storage_by_key
        self.persistent = {k for k, s in self.sizes.items() if s.persistent}
        self.position = {n.name: i for i, n in enumerate(graph.nodes)}
        values = {n.name: tuple(k for k in n.output_storages if k not in self.persistent) for n in graph.nodes}
        returned = {k for name in graph.held_output_names for k in values[name]}
        self.maker: dict[int, str] = {}
        self.savers: dict[int, set[str]] = {}
        #: the last position reading each storage, as the simulator frees storages nothing saved
        self.last_use: dict[int, int] = {}
        for i, node in enumerate(graph.nodes):
            for k in (*node.output_storages, *node.saved_storages):
                self.maker.setdefault(k, node.name)
            for k in node.saved_storages:
                self.savers.setdefault(k, set()).add(node.name)
            for k in (*values[node.name], *(k for name in node.input_names for k in values[name])):
                self.last_use[k] = max(self.last_use.get(k, i), i)
        self.inputs_of = {n.name: {k for name in n.input_names for k in values[name]} for n in graph.nodes}
        self.rerunnable = {n.name for n in graph.compute_nodes if n.recomputable}
        #: rerunnable nodes that save only their inputs: a recompute ending at one stops before
        #: running it, so it may sit in a segment without running again
        self.stop_before = {name for name in self.rerunnable
                            if after_last_save_fraction(graph, graph.node(name)) >= 1.0}
        #: storage -> the rerunnable nodes reading it
        self.readers: dict[int, list[str]] = {}
        for n in graph.compute_nodes:
            if n.name in self.rerunnable:
                for k in self.inputs_of[n.name]:
                    self.readers.setdefault(k, []).append(n.name)
        self.freeable: list[tuple[int, str, float, int, set[str]]] = []
        for k, names in self.savers.items():
            if (k in self.persistent or k in returned or self.maker[k] not in self.rerunnable
                    or not names <= self.rerunnable):
                continue
            self.freeable.append((min(self.position[n] for n in names), self.maker[k],
                                  self.sizes[k].size_bytes / MIB, k, names))
        self.transient_keys = [k for k in self.maker if k not in self.persistent and k not in returned
                               and k not in self.savers and k in self.readers]

    def add_transients(self, prob: pulp.LpProblem, rerun: dict[str, pulp.LpVariable],
                       kept: dict[str, pulp.LpVariable] | None = None) -> list[tuple[int, pulp.LpVariable, float]]:
        """Add to ``prob`` whether each transient is held: for a rerun reader whose maker does
        not rerun, or (``kept``: a selective policy keeps that node) because its maker is kept.
        Returns ``(last use, held variable, MiB)`` per transient."""
        transients = []
        for k in self.transient_keys:
            held = prob.add_variable(f"held_{k}", lowBound=0, upBound=1)
            for r in self.readers[k]:
                prob += (held >= rerun[r] - rerun.get(self.maker[k], 0), f"hold_{k}_for_{r}")
            if kept and self.maker[k] in kept:
                prob += held >= kept[self.maker[k]], f"hold_{k}_kept"
            transients.append((self.last_use[k], held, self.sizes[k].size_bytes / MIB))
        return transients
