"""Replay one training step of a :class:`CostGraph` under a plan and predict its peak memory.

The replay follows the mechanics of eager autograd with non-reentrant
``torch.utils.checkpoint``, storage by storage:

* forward: a node allocates the storages it produces (and storages internal to the op that
  autograd saves); a storage is freed once no later node reads it, nothing saved it for
  backward, no checkpointed segment holds it as an input and the module does not return it.
  Inside a checkpointed segment, saves do not hold memory; the segment keeps its inputs.
* backward, nodes in reverse: each node allocates the gradients of its differentiable inputs
  (views of the whole input pass the gradient through, a ``select`` or ``slice`` fills a
  buffer of its input's size; the inputs of ``grad_shared_inputs`` hold the output's
  gradient itself, one buffer for all, which a later gradient is summed into out of place while
  another still holds it), frees its output gradient and releases what it saved.
  Parameter gradients stay allocated. The first backward node of a segment that needs a
  saved tensor recomputes the segment (up to its last saving node) into fresh storages.
* temporaries: where the profile measured that a node's forward or backward allocates more
  at its high point (``forward_peak_bytes``, ``backward_peak_bytes``) than the tensors the
  replay accounts for, the difference is added at that node. The part of a backward peak
  reached after the node's backward function has returned (``backward_late_scratch_bytes``, a
  bias gradient's reduction on CUDA) comes, in a recomputed segment, after the node's recomputed
  saved tensors are released: the function unpacked them, and they die with it.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> g = CostGraph(
    ...     nodes=(CostNode("x", "placeholder", kind="input", output_storages=(1,)),
    ...            CostNode("a", "relu", input_names=("x",), output_storages=(2,),
    ...                     saved_storages=(2,), output_bytes=100, requires_grad=True),
    ...            CostNode("b", "relu", input_names=("a",), output_storages=(3,),
    ...                     saved_storages=(3,), output_bytes=100, requires_grad=True)),
    ...     storages=(Storage(1, 100, True), Storage(2, 100), Storage(3, 100)),
    ...     output_names=("b",))
    >>> simulate(g).peak_bytes  # input, a, b, b's gradient, then a's gradient
    500
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.core.costgraph import CostGraph
from planner.core.memory_account import AboveLimit, MemoryAccount
from planner.core.plan import Segment
from planner.core.rerun import after_last_save_fraction

if TYPE_CHECKING:  # pragma: no cover
    from planner.core.offload import Transfers

__all__ = ["SimulationResult", "fits_budget", "peak_by_kind", "simulate", "validate_segments", "PEAK_KINDS"]


@dataclass(frozen=True)
class SimulationResult:
    """Predicted memory of one step: the peak, where it happens, and the whole timeline.

    ``timeline`` holds ``(phase, node_name, live_bytes)`` with phase ``forward``,
    ``recompute`` or ``backward``.
    """

    peak_bytes: int
    peak_phase: str
    peak_node: str
    timeline: tuple[tuple[str, str, int], ...]


def validate_segments(graph: CostGraph, segments: Iterable[Sequence[str]]) -> list[list[int]]:
    """Check that each segment is a contiguous run of recomputable compute nodes, disjoint.

    Returns the segments as sorted lists of node indices. Raises ``ValueError`` otherwise.
    """
    out: list[list[int]] = []
    taken: set[int] = set()
    rank = graph.replay_facts.compute_rank
    for seg in segments:
        idx = sorted(graph.index[name] for name in seg)
        if not idx:
            raise ValueError("empty segment")
        for i in idx:
            node = graph.nodes[i]
            if node.kind != "compute" or not node.recomputable:
                raise ValueError(f"node {node.name!r} cannot be recomputed")
            if i in taken:
                raise ValueError(f"node {node.name!r} is in two segments")
        ranks = [rank[i] for i in idx]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"segment starting at {graph.nodes[idx[0]].name!r} is not contiguous")
        taken.update(idx)
        out.append(idx)
    return out


def simulate(graph: CostGraph, segments: Iterable[Sequence[str] | Segment] = ()) -> SimulationResult:
    """Predict the peak bytes of one forward plus backward with ``segments`` recomputed.

    ``segments`` are :class:`planner.core.plan.Segment` objects or plain lists of node names (fully
    recomputed); each must be a contiguous run of recomputable compute nodes (see
    :func:`validate_segments`). No segments is the unoptimized step. In a selective segment the
    outputs of its ``kept_nodes`` are kept from the forward (held until the segment's recompute
    hands them to the backward) and those nodes are not re-run.
    """
    mem = MemoryAccount(persistent_bytes(graph))
    replay_plan(graph, segments, mem)
    assert mem.timeline is not None
    return SimulationResult(
        peak_bytes=mem.peak_bytes,
        peak_phase=mem.peak_at[0],
        peak_node=mem.peak_at[1],
        timeline=tuple(mem.timeline),
    )


def fits_budget(graph: CostGraph, segments: Iterable[Sequence[str] | Segment], budget_bytes: int) -> bool:
    """Whether :func:`simulate`'s peak with ``segments`` is at most ``budget_bytes``.

    The same replay, stopped at the first moment above the budget and without a timeline, so a
    plan that does not fit costs a fraction of a full replay (searches that try many plans
    near the budget reject most of them).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph(
        ...     nodes=(CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...            CostNode("a", "relu", input_names=("x",), output_storages=(2,),
        ...                     saved_storages=(2,), output_bytes=100, requires_grad=True)),
        ...     storages=(Storage(1, 100, True), Storage(2, 100)), output_names=("a",))
        >>> simulate(g).peak_bytes, fits_budget(g, (), 300), fits_budget(g, (), 299)
        (300, True, False)
    """
    mem = MemoryAccount(persistent_bytes(graph), limit_bytes=budget_bytes, record_timeline=False)
    if mem.peak_bytes > budget_bytes:
        return False
    try:
        replay_plan(graph, segments, mem)
    except AboveLimit:
        return False
    return True


#: The kinds :func:`peak_by_kind` splits the peak into, in the order it lists them.
PEAK_KINDS = ("parameters and buffers", "inputs", "parameter gradients", "activations", "activation gradients",
              "temporaries")


class _PeakSnapshot(MemoryAccount):
    """A :class:`MemoryAccount` that remembers what was live at its peak (for :func:`peak_by_kind`)."""

    def __init__(self, base_bytes: int) -> None:
        super().__init__(base_bytes)
        self.at_peak: tuple[list[tuple[object, int]], int] = ([], 0)

    def observe(self, phase: str, node: str, extra_bytes: int = 0) -> None:
        if self.live_bytes + extra_bytes > self.peak_bytes:
            self.at_peak = (list(self.size.items()), extra_bytes)
        super().observe(phase, node, extra_bytes)


def peak_by_kind(graph: CostGraph, segments: Iterable[Sequence[str] | Segment] = ()) -> dict[str, int]:
    """:func:`simulate`'s peak split into :data:`PEAK_KINDS`; the values sum to the peak.

    Parameters and buffers (constants too) and inputs are held all step; parameter gradients
    are the ``.grad`` of parameters; activations are forward outputs and what autograd saved
    (recomputed copies included); activation gradients flow back through the graph;
    temporaries are an op's own scratch at its high point.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph(
        ...     nodes=(CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...            CostNode("a", "relu", input_names=("x",), output_storages=(2,),
        ...                     saved_storages=(2,), output_bytes=100, requires_grad=True)),
        ...     storages=(Storage(1, 100, True), Storage(2, 100)), output_names=("a",))
        >>> {kind: size for kind, size in peak_by_kind(g).items() if size}
        {'inputs': 100, 'activations': 100, 'activation gradients': 100}
    """
    mem = _PeakSnapshot(persistent_bytes(graph))
    replay_plan(graph, segments, mem)
    out = dict.fromkeys(PEAK_KINDS, 0)
    sizes = graph.storage_by_key
    inputs = {k for n in graph.nodes if n.kind == "input" for k in n.output_storages}
    for k in graph.replay_facts.persistent:
        out["inputs" if k in inputs else "parameters and buffers"] += sizes[k].size_bytes
    live, extra_bytes = mem.at_peak
    for key, size in live:
        if isinstance(key, tuple) and key[0] == "shared_bytes":  # a gradient's bytes that two names hold
            key = key[1]
        if isinstance(key, tuple) and key[0] == "grad":
            out["parameter gradients" if isinstance(key[1], int) else "activation gradients"] += size
        else:
            out["activations"] += size
    out["temporaries"] += extra_bytes
    return out


def persistent_bytes(graph: CostGraph) -> int:
    sizes = graph.storage_by_key
    return sum(sizes[k].size_bytes for k in graph.replay_facts.persistent)


def replay_plan(graph: CostGraph, segments: Iterable[Sequence[str] | Segment], mem: MemoryAccount,
            transfers: Transfers | None = None) -> None:
    """Run the forward and backward of :func:`simulate` on ``mem``; ``transfers`` (where given)
    takes the forward-to-backward holds of the storages it moves to host memory
    (:mod:`planner.core.offload`)."""
    names: list[Sequence[str]] = []
    kept: list[frozenset[str]] = []
    for seg in segments:
        if isinstance(seg, Segment):
            names.append(seg.node_names)
            kept.append(frozenset(seg.kept_nodes))
        else:
            names.append(seg)
            kept.append(frozenset())
    seg_indices = validate_segments(graph, names)
    cached: list[set[int]] = [set() for _ in seg_indices]
    # storages of a kept node's inputs that ops inside it returned views of (a linear's reshaped
    # input): the policy's cache holds them until the segment is recomputed
    cache_views: list[list[int]] = [[] for _ in seg_indices]
    nodes = graph.nodes
    sizes = graph.storage_by_key
    facts = graph.replay_facts
    persistent = facts.persistent
    seg_of: dict[int, int] = {i: s for s, idx in enumerate(seg_indices) for i in idx}
    value_storages = facts.value_storages

    # Storages each segment keeps as inputs: read inside, produced before it; and saved inside,
    # produced outside (a custom autograd Function's saves land on the op after its forward:
    # the range holds them as the tensors they are, not as handles it could replay).
    first_made = facts.first_made
    seg_inputs: list[set[int]] = []
    for idx in seg_indices:
        inside = {nodes[i].name for i in idx}
        keep: set[int] = set()
        for i in idx:
            for name in nodes[i].input_names:
                if name not in inside:
                    keep.update(value_storages[name])
            keep.update(k for k in facts.saved[i] if first_made[k] < idx[0])
        seg_inputs.append(keep)

    # ---- forward ----
    for i, node in enumerate(nodes):
        s = seg_of.get(i)
        if s is not None and i == seg_indices[s][0]:
            for k in seg_inputs[s]:
                if transfers is None or not transfers.take_hold(mem, k, i):
                    mem.hold(k)
            mem.alloc(("segment_state", s), graph.segment_overhead_bytes)
        new_bytes = 0
        keep_output = s is not None and node.name in kept[s]
        lives_on = facts.lives_on[i]
        for k in facts.made[i]:
            if mem.alloc(k, sizes[k].size_bytes):
                new_bytes += sizes[k].size_bytes
                if k in lives_on:
                    mem.hold(k)  # the forward reference, dropped after the last reader
                if keep_output:
                    cached[s].add(k)
                    mem.hold(k)  # the selective policy's cache, emptied by the recompute
        if keep_output:
            for k in set(node.viewed_storages) - persistent - cached[s]:
                mem.hold(k)
                cache_views[s].append(k)
        if s is None:
            for k in facts.saved[i]:
                if transfers is None or not transfers.take_hold(mem, k, i):
                    mem.hold(k)
        elif graph.range_end_saves_held and i == seg_indices[s][-1]:
            # what is saved after a recorded op range's last op stays a tensor: held from here,
            # handed to the recompute as a selective policy's cache is. Those are its outputs;
            # the inputs it saves are saved before it runs, inside the range, and recomputed
            outputs = set(node.output_storages)
            for k in facts.saved[i]:
                if k in outputs and k not in persistent and k not in seg_inputs[s] and k not in cached[s]:
                    cached[s].add(k)
                    mem.hold(k)
        if node.kind == "compute":
            mem.observe("forward", node.name, max(0, node.forward_peak_bytes - new_bytes))
        for k in facts.made[i]:
            mem.free_if_unheld(k)
        for k in facts.forward_frees[i]:
            mem.release(k)
        if transfers is not None:
            transfers.forward_done(mem, i)

    # ---- backward ----
    grad_key = facts.grad_key
    differentiable = facts.differentiable
    starts = graph.loss_names or tuple(n for n in graph.output_names if n in differentiable)
    for name in starts:
        if name in differentiable:
            mem.alloc(grad_key[name], nodes[graph.index[name]].output_bytes)
            mem.hold(grad_key[name])

    recomputed: set[int] = set()
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.kind != "compute":
            continue
        s = seg_of.get(i)
        own = grad_key[node.name]
        runs_backward = own in mem.refs
        if transfers is not None:
            transfers.backward_needs(mem, i)
        recomputes = runs_backward and s is not None and s not in recomputed and bool(node.saved_storages)
        if recomputes:
            recomputed.add(s)
            _recompute(graph, seg_indices[s], seg_inputs[s], cached[s], persistent, mem)
            for k in cache_views[s]:
                mem.release(k)
        late = 0
        if runs_backward:
            transient = 0
            new_bytes = 0
            grads_made = False
            for key, size, shared in facts.input_grads[i]:
                if key in mem.refs and mem.is_shared(key):
                    # autograd sums into a gradient only where no other holds it; else into the
                    # new one, which becomes this input's own
                    mem.unshare(key, size)
                    new_bytes += size
                elif key in mem.refs:
                    transient += 0 if node.is_alias else size  # summed into the existing buffer
                elif shared:
                    mem.share(key, own)  # the output's gradient passed on: no new buffer
                    mem.hold(key)
                    grads_made = True
                elif node.is_alias and not grads_made and own in mem.refs and i not in facts.slicing_views:
                    if own in mem.buffer_of:  # a view of a gradient another name holds too
                        mem.share(key, own)
                    else:  # a view of the output gradient
                        mem.alloc(key, 0)
                        mem.size[key] = mem.size[own]
                        mem.size[own] = 0
                    mem.hold(key)
                    grads_made = True
                else:
                    mem.alloc(key, size)
                    mem.hold(key)
                    new_bytes += size
                    grads_made = True
            late = node.backward_late_scratch_bytes if s in recomputed else 0
            mem.observe("backward", node.name, max(transient, node.backward_peak_bytes - late - new_bytes))
            if late:
                # the function has returned: what it unpacked of the recompute is gone before
                # autograd reduces its outputs, so the late scratch comes on top of less
                _release_saved(facts.saved[i], s, recomputed, cached, mem)
                mem.observe("backward", node.name, max(0, node.backward_peak_bytes - new_bytes))
            mem.release(own)
        if not late:
            _release_saved(facts.saved[i], s, recomputed, cached, mem)
        if s is not None and i == seg_indices[s][0]:
            for k in seg_inputs[s]:
                mem.release(k)
            mem.free(("segment_state", s))
        if transfers is not None:
            transfers.backward_done(mem, i, s if recomputes else None)


def _release_saved(saved: Iterable[int], s: int | None, recomputed: set[int], cached: list[set[int]],
                   mem: MemoryAccount) -> None:
    """Drop a node's hold on what it saved for backward, once its backward is done."""
    for k in saved:
        if s is None:
            mem.release(k)
        elif s in recomputed:  # before its recompute, a segment's nodes hold nothing they saved
            mem.release(k if k in cached[s] else ("recomputed", k))


def _recompute(
    graph: CostGraph, idx: list[int], inputs: set[int], cached: set[int], persistent: set[int], mem: MemoryAccount
) -> None:
    """Re-run a segment's forward into fresh storages, up to its last saving node.

    Storages in ``cached`` (kept by a selective policy) are handed over instead of recomputed.
    """
    nodes = graph.nodes
    sizes = graph.storage_by_key
    stop = max(i for i in idx if nodes[i].saved_storages)
    run = [i for i in idx if i <= stop]
    # the recompute stops once the last node has saved its tensors: one that saves only what
    # existed before it ran (planner.core.rerun) never runs its kernel, so makes no output there
    skipped = stop if after_last_save_fraction(graph, nodes[stop]) >= 1.0 else -1
    inside = {nodes[i].name for i in run}
    last_use: dict[int, int] = {}
    for i in run:
        for k in nodes[i].output_storages:
            last_use[k] = max(last_use.get(k, i), i)
        for name in nodes[i].input_names:
            if name in inside:
                for k in nodes[graph.index[name]].output_storages:
                    last_use[k] = max(last_use.get(k, i), i)
    def key(k: int) -> object:
        return k if k in cached else ("recomputed", k)

    for i in run:
        node = nodes[i]
        made = () if i == skipped else node.output_storages
        fresh = [k for k in (*made, *node.saved_storages)
                 if k not in persistent and k not in inputs and k not in cached]
        new_bytes = 0
        for k in fresh:
            if mem.alloc(("recomputed", k), sizes[k].size_bytes):
                new_bytes += sizes[k].size_bytes
                if last_use.get(k, i) > i:
                    mem.hold(("recomputed", k))
        for k in set(node.saved_storages) - persistent - inputs:
            mem.hold(key(k))
        reruns = i != skipped and not any(k in cached for k in node.output_storages)
        mem.observe("recompute", node.name, max(0, node.forward_peak_bytes - new_bytes) if reruns else 0)
        for k in set(fresh):
            mem.free_if_unheld(("recomputed", k))
        read = {k for name in node.input_names if name in inside for k in nodes[graph.index[name]].output_storages}
        for k in read - inputs - persistent - cached:
            if last_use.get(k) == i:
                mem.release(("recomputed", k))
    for k in cached:
        mem.release(k)  # the policy's cache is empty once the recompute has run
