"""What a replay of a :class:`planner.core.costgraph.CostGraph` needs that no plan changes.

:func:`planner.core.simulate.simulate` replays a step once per candidate plan, and the searches
replay hundreds of plans of one graph (:mod:`planner.solvers.refine`, :mod:`planner.solvers.keep`). Which
storages persist, who reads a storage last, what each node allocates, frees and saves, and
the gradient buffers of its inputs are the graph's alone, so they are derived once
(``CostGraph.replay_facts``, cached on the graph) instead of on every replay.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> w = CostNode("w", "param", kind="param", output_storages=(0,), output_bytes=32, requires_grad=True)
    >>> mm = CostNode("mm", "mm", input_names=("w",), output_storages=(1,), saved_storages=(0, 1),
    ...               output_bytes=64, requires_grad=True)
    >>> g = CostGraph((w, mm), (Storage(0, 32, True), Storage(1, 64)), output_names=("mm",))
    >>> facts = g.replay_facts
    >>> facts.made[1], facts.saved[1], sorted(facts.returned), facts.input_grads[1]
    ((1,), (1,), [1], ((('grad', 0), 32, False),))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # costgraph imports this module to cache the facts on the graph
    from planner.core.costgraph import CostGraph

__all__ = ["ReplayFacts", "replay_facts", "SLICING_VIEW_OPS"]

#: Views that select part of their input: their backward writes the output gradient into a fresh
#: zero-filled buffer of the input's size (``select_backward``, ``slice_backward``), where a view
#: of the whole input (``view``, ``transpose``, ``unsqueeze``) passes a view of the gradient on.
SLICING_VIEW_OPS = frozenset({"aten.select.int", "aten.slice.Tensor", "aten.narrow.default", "aten.diagonal.default",
                              "aten.as_strided.default", "aten.unfold.default"})


@dataclass(frozen=True)
class ReplayFacts:
    """Per-graph facts of a replay; per-node tuples are indexed by node position.

    ``persistent``: storages held for the whole step (parameters, buffers, inputs).
    ``value_storages``: each node's output storages that are not persistent, by name.
    ``last_use``: the last node position that produces or reads each such storage, or saves it
    after an earlier node made it (a custom Function saves its input after its forward's ops).
    ``returned``: the storages the caller holds through the backward (``held_output_names``).
    ``compute_rank``: each compute node's position among the compute nodes, by node position.
    ``made``: what each node allocates in the forward (outputs, then saved storages; not
    persistent, each once). ``first_made``: the first node position whose ``made`` holds each
    storage. ``lives_on``: those of ``made`` a later node reads or the module
    returns. ``saved``: what each node saves for backward (not persistent). ``forward_frees``:
    the storages whose last reader the node is (not returned). ``grad_key``: each node's
    gradient buffer (tied weights share one). ``differentiable``: the nodes whose outputs
    require grad. ``input_grads``: per node, the buffer and size of each differentiable
    input's gradient, each input once, and whether it is the node's output gradient itself
    (``grad_shared_inputs``). ``slicing_views``: the positions of views whose backward makes their
    input's gradient a buffer of its own (:data:`SLICING_VIEW_OPS`).
    """

    persistent: frozenset[int]
    value_storages: dict[str, tuple[int, ...]]
    last_use: dict[int, int]
    returned: frozenset[int]
    compute_rank: dict[int, int]
    made: tuple[tuple[int, ...], ...]
    first_made: dict[int, int]
    lives_on: tuple[frozenset[int], ...]
    saved: tuple[tuple[int, ...], ...]
    forward_frees: tuple[tuple[int, ...], ...]
    grad_key: dict[str, object]
    differentiable: frozenset[str]
    input_grads: tuple[tuple[tuple[object, int, bool], ...], ...]
    slicing_views: frozenset[int]


def replay_facts(graph: CostGraph) -> ReplayFacts:
    """Derive :class:`ReplayFacts` for ``graph`` (use ``graph.replay_facts``, which caches them)."""
    nodes = graph.nodes
    sizes = graph.storage_by_key
    persistent = frozenset(k for k, s in sizes.items() if s.persistent)
    value_storages = {n.name: tuple(k for k in n.output_storages if k not in persistent) for n in nodes}
    made = tuple(tuple(dict.fromkeys(k for k in (*n.output_storages, *n.saved_storages) if k not in persistent))
                 for n in nodes)
    first_made: dict[int, int] = {}
    for i, keys in enumerate(made):
        for k in keys:
            first_made.setdefault(k, i)
    last_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for k in value_storages[node.name]:
            last_use[k] = max(last_use.get(k, i), i)
        for name in node.input_names:
            for k in value_storages[name]:
                last_use[k] = max(last_use.get(k, i), i)
        for k in node.saved_storages:  # saved after an earlier node made it (a Function's input): lives to then
            if first_made.get(k, i) < i:
                last_use[k] = max(last_use.get(k, i), i)
    # outputs the caller drops live until the forward ends (the loss is taken), not longer
    dropped = () if graph.output_held else tuple(dict.fromkeys(
        k for name in graph.output_names if name not in graph.loss_names for k in value_storages[name]))
    for k in dropped:
        last_use[k] = len(nodes) - 1
    returned = frozenset(k for name in graph.held_output_names for k in value_storages[name])
    compute_positions = [i for i, n in enumerate(nodes) if n.kind == "compute"]
    lives_on = tuple(frozenset(k for k in made[i] if last_use.get(k, i) > i or k in returned)
                     for i in range(len(nodes)))
    saved = tuple(tuple(dict.fromkeys(k for k in n.saved_storages if k not in persistent)) for n in nodes)
    forward_frees = tuple(
        tuple(k for k in dict.fromkeys((*(k for name in n.input_names for k in value_storages[name]),
                                        *(k for k in n.saved_storages if first_made.get(k, i) < i),
                                        *(dropped if i == len(nodes) - 1 else ())))
              if last_use.get(k) == i and k not in returned)
        for i, n in enumerate(nodes))
    grad_key: dict[str, object] = {
        n.name: ("grad", n.output_storages[0]) if n.kind == "param" and n.output_storages else ("grad", n.name)
        for n in nodes}
    differentiable = frozenset(n.name for n in nodes if n.requires_grad)
    input_grads = tuple(
        tuple((grad_key[name], nodes[graph.index[name]].output_bytes, name in n.grad_shared_inputs)
              for name in dict.fromkeys(n.input_names) if name in differentiable)
        for n in nodes)
    return ReplayFacts(persistent, value_storages, last_use, returned,
                       {pos: r for r, pos in enumerate(compute_positions)}, made, first_made, lives_on, saved, forward_frees,
                       grad_key, differentiable, input_grads,
                       frozenset(i for i, n in enumerate(nodes) if n.is_alias and n.op in SLICING_VIEW_OPS))
