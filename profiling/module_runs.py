"""Runs of the module path: consecutive submodule calls of one loop body planned as one unit.

A layer written inline in ``forward`` over several module lists (``self.ln[i]``, ``self.fc1[i]``,
``self.fc2[i]``, with Python between the calls) has no submodule of its own to checkpoint, and
each call alone saves little. :func:`with_runs` merges, in a module-level :class:`CostGraph`
(:mod:`profiling.module_costgraph`), each run of units with paths ``<list>.<i>`` of one index
``i`` from different lists, consecutive in the forward (only the Python between them in
between), with the glue between them, into one node ``run:<first>..<last>``. The rewrite
(:mod:`rewrite.module_checkpoint`) checkpoints a run from its first call's start to its last
call's end as a range of the ops it dispatches (:mod:`rewrite.op_regions`), the Python between
the calls included in what it recomputes.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> unit = lambda path, out: CostNode(path, f"module:{path}", output_storages=(out,), module=path)
    >>> glue = lambda k: CostNode(f"glue_{k}", "glue", recomputable=False)
    >>> g = CostGraph((glue(0), unit("ln.0", 1), glue(1), unit("fc.0", 2), glue(2)),
    ...               (Storage(1, 8, False), Storage(2, 8, False)))
    >>> [n.name for n in with_runs(g).compute_nodes]
    ['glue_0', 'run:ln.0..fc.0', 'glue_2']
"""

from __future__ import annotations

import dataclasses

from planner.core.costgraph import CostGraph, CostNode

__all__ = ["with_runs", "run_span", "RUN_PREFIX"]

#: Name prefix of a run node; the rest is ``<first path>..<last path>``.
RUN_PREFIX = "run:"


def run_span(name: str) -> tuple[str, str] | None:
    """The first and last module path of a run node's name (None for other nodes).

    Example:
        >>> run_span("run:ln.0..fc2.0"), run_span("ln.0")
        (('ln.0', 'fc2.0'), None)
    """
    if not name.startswith(RUN_PREFIX):
        return None
    first, _, last = name[len(RUN_PREFIX):].partition("..")
    return first, last


def _list_index(node: CostNode) -> tuple[str, str] | None:
    if not node.op.startswith("module:") or not node.recomputable:
        return None
    head, _, tail = node.module.rpartition(".")
    return (head, tail) if head and tail.isdigit() else None


def _runs(graph: CostGraph) -> list[list[int]]:
    """Index lists (units and the glue between them) of each run of two or more units."""
    runs: list[list[int]] = []
    current: list[int] = []
    lists: set[str] = set()
    index = ""
    for i, node in enumerate(graph.nodes):
        if node.kind != "compute":
            continue
        if node.op == "glue":
            if current:
                current.append(i)
            continue
        key = _list_index(node)
        if key is not None and current and key[1] == index and key[0] not in lists:
            current.append(i)
            lists.add(key[0])
            continue
        if current:
            runs.append(current)
        current, lists, index = ([i], {key[0]}, key[1]) if key is not None else ([], set(), "")
    if current:
        runs.append(current)
    trimmed = []
    for run in runs:
        while run and graph.nodes[run[-1]].op == "glue":
            run.pop()
        if sum(1 for i in run if graph.nodes[i].op != "glue") >= 2:
            trimmed.append(run)
    return trimmed


def with_runs(graph: CostGraph) -> CostGraph:
    """``graph`` with each run of a loop body's unit calls merged into one recomputable node."""
    runs = _runs(graph)
    if not runs:
        return graph
    renamed: dict[str, str] = {}
    merged: dict[int, CostNode] = {}
    for run in runs:
        members = [graph.nodes[i] for i in run]
        units = [n for n in members if n.op != "glue"]
        name = f"{RUN_PREFIX}{units[0].module}..{units[-1].module}"
        inside = {n.name for n in members}
        reads = [r for n in members for r in n.input_names if r not in inside]
        merged[run[0]] = CostNode(
            name, f"modules:{units[0].module}..{units[-1].module}", input_names=tuple(dict.fromkeys(reads)),
            output_storages=tuple(dict.fromkeys(k for n in members for k in n.output_storages)),
            saved_storages=tuple(dict.fromkeys(k for n in members for k in n.saved_storages)),
            output_bytes=units[-1].output_bytes, requires_grad=units[-1].requires_grad,
            time_ms=sum(n.time_ms for n in members), recomputable=True, module=units[0].module,
            forward_peak_bytes=max(n.forward_peak_bytes for n in members),
            backward_peak_bytes=max(n.backward_peak_bytes for n in members), after_last_save_fraction=0.0)
        renamed.update({n.name: name for n in members})
    dropped = {i for run in runs for i in run[1:]}
    nodes = []
    for i, node in enumerate(graph.nodes):
        if i in dropped:
            continue
        node = merged.get(i, node)
        if any(r in renamed for r in node.input_names):
            node = dataclasses.replace(node, input_names=tuple(dict.fromkeys(
                renamed.get(r, r) for r in node.input_names if renamed.get(r, r) != node.name)))
        nodes.append(node)

    def rename(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(renamed.get(n, n) for n in names))

    return dataclasses.replace(graph, nodes=tuple(nodes), output_names=rename(graph.output_names),
                               loss_names=rename(graph.loss_names))
