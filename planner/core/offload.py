"""Saved storages moved to host memory: the link's speeds, and the replay with the copies in it.

A storage autograd holds from the forward to the backward (saved by a node outside every
checkpointed segment, or an input a segment keeps for its recompute) can be copied to pinned
host memory on a side stream while the forward goes on, and copied back before the backward
needs it. The replay here is :func:`planner.core.simulate.simulate`'s, with the copies on a
timeline of the compute:

* forward: node ``i`` takes ``time_ms``. An offloaded storage's device-to-host copy is queued
  on the D2H stream when its first holder has run, and takes ``size / d2h`` once the copies
  queued before it are done. Its device memory is released at the first node boundary after
  the copy completes (and after its last forward reader, as without offload).
* backward: node ``i`` takes ``time_ms`` times the step's backward-to-forward ratio, plus its
  segment's recompute where it recomputes one. An offloaded node's storages come back
  together, fetched when the backward reaches its trigger node: the latest node at which,
  on those compute times, every fetch queued one after the other on the H2D stream lands by
  the first backward node that needs it (:class:`Transfers`). A fetch allocates its device
  buffers when it is issued and takes ``size / h2d`` once the copies queued before it and the
  storage's own D2H copy are done. Where a fetch is not back when its node runs, the compute
  waits: that wait is the exposed transfer time.

So the peak follows the copies, not the ideal: a storage whose copy lags stays on the device.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> def relu(name, src):
    ...     k = ord(name) - ord("a") + 2
    ...     return CostNode(name, "relu", input_names=(src,), output_storages=(k,), saved_storages=(k,),
    ...                     output_bytes=1000, requires_grad=True, time_ms=1.0)
    >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
    ...                relu("a", "x"), relu("b", "a"), relu("c", "b"), relu("d", "c")),
    ...               tuple(Storage(k, 1000, k == 1) for k in range(1, 6)), output_names=("d",), step_ms=12.0)
    >>> link = OffloadSpec(h2d_gbps=1e-3, d2h_gbps=1e-3)   # 1,000 bytes per ms each way
    >>> r = simulate_offload(g, (), ("a", "b"), link)
    >>> r.peak_bytes, simulate_offload(g, (), (), link).peak_bytes, r.exposed_ms, r.offloaded_bytes
    (6000, 7000, 0.0, 2000)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.core.costgraph import CostGraph
from planner.core.plan import Segment
from planner.core.rerun import rerun_cost

from planner.core.memory_account import AboveLimit, MemoryAccount
from planner.core.simulate import persistent_bytes, replay_plan, validate_segments

__all__ = ["OffloadSpec", "HOST_LINKS", "OffloadSimulation", "Transfers", "simulate_offload",
           "offloadable_nodes", "backward_ratio"]

GIB = 2**30


@dataclass(frozen=True)
class OffloadSpec:
    """The host link as the planner prices it: GB/s (10**9 bytes a second) host-to-device and
    device-to-host, and the pinned host memory the offloaded storages may take at once.

    Example:
        >>> spec = OffloadSpec(h2d_gbps=50.0, d2h_gbps=50.0)
        >>> spec.h2d_ms(50 * 10**6), spec.pinned_host_bytes // GIB
        (1.0, 32)
    """

    h2d_gbps: float
    d2h_gbps: float
    pinned_host_bytes: int = 32 * GIB

    def __post_init__(self) -> None:
        for name in ("h2d_gbps", "d2h_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive number of GB/s, got {value!r}")
        if isinstance(self.pinned_host_bytes, bool) or not isinstance(self.pinned_host_bytes, int) \
                or self.pinned_host_bytes < 0:
            raise ValueError(f"pinned_host_bytes must be a non-negative int, got {self.pinned_host_bytes!r}")

    def h2d_ms(self, size_bytes: int) -> float:
        """Milliseconds to copy ``size_bytes`` from host to device."""
        return size_bytes / (self.h2d_gbps * 1e6)

    def d2h_ms(self, size_bytes: int) -> float:
        """Milliseconds to copy ``size_bytes`` from device to host."""
        return size_bytes / (self.d2h_gbps * 1e6)


#: Host links by device name, with a reused pinned pool (sources: docs/tuning.md#host_links): an H100
#: over PCIe Gen5 x16 moves about 50 GB/s each way; a GH200 about 400 GB/s to and 170 from the device.
HOST_LINKS: dict[str, OffloadSpec] = {
    "h100": OffloadSpec(h2d_gbps=50.0, d2h_gbps=50.0),
    "h200": OffloadSpec(h2d_gbps=50.0, d2h_gbps=50.0),
    "a100": OffloadSpec(h2d_gbps=25.0, d2h_gbps=25.0),
    "gh200": OffloadSpec(h2d_gbps=400.0, d2h_gbps=170.0),
}


@dataclass(frozen=True)
class OffloadSimulation:
    """A replay with offloaded storages: the device peak (where and when), the timeline as
    :class:`planner.core.simulate.SimulationResult` has it, the compute's waits for copies
    (``exposed_ms``), the most bytes in pinned host memory at once and the bytes offloaded."""

    peak_bytes: int
    peak_phase: str
    peak_node: str
    timeline: tuple[tuple[str, str, int], ...]
    exposed_ms: float
    host_peak_bytes: int
    offloaded_bytes: int
    #: the nodes whose outputs moved, in execution order, and the backward node issuing each fetch
    offloaded: tuple[str, ...] = ()
    triggers: tuple[str, ...] = ()


def backward_ratio(graph: CostGraph) -> float:
    """The step's backward time over its forward time (2 where the profile has no step time):
    a node's backward is priced at its forward time times this.

    Example:
        >>> from planner.core.costgraph import CostGraph
        >>> backward_ratio(CostGraph((), (), step_ms=0.0))
        2.0
    """
    forward_ms = graph.forward_ms
    if forward_ms <= 0 or graph.step_ms <= forward_ms:
        return 2.0
    return (graph.step_ms - forward_ms) / forward_ms






def _segment_inputs(graph: CostGraph, idx: Sequence[int]) -> set[int]:
    nodes = graph.nodes
    inside = {nodes[i].name for i in idx}
    value_storages = graph.replay_facts.value_storages
    return {k for i in idx for name in nodes[i].input_names if name not in inside for k in value_storages[name]}


def offloadable_nodes(graph: CostGraph, segments: Iterable[Sequence[str] | Segment] = ()) -> dict[str, tuple[int, ...]]:
    """Per node, in execution order, the storages it makes that a plan with ``segments`` holds
    from the forward to the backward (saved outside every segment, or kept as a segment's
    input): what offloading that node's outputs moves. Parameters, buffers, inputs and the
    outputs the caller holds are never offloaded.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...                CostNode("a", "relu", input_names=("x",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=8, requires_grad=True),
        ...                CostNode("b", "sum", input_names=("a",), output_storages=(3,), output_bytes=8,
        ...                         requires_grad=True)),
        ...               (Storage(1, 8, True), Storage(2, 8), Storage(3, 8)), output_names=("b",))
        >>> offloadable_nodes(g)
        {'a': (2,)}
    """

    seg_list = list(segments)
    names = [s.node_names if isinstance(s, Segment) else s for s in seg_list]
    seg_idx = validate_segments(graph, names)
    in_segment = {i for idx in seg_idx for i in idx}
    facts = graph.replay_facts
    held: set[int] = set()
    for i in range(len(graph.nodes)):
        if i not in in_segment:
            held.update(facts.saved[i])
    for idx in seg_idx:
        held |= _segment_inputs(graph, idx)
    held -= facts.returned | facts.persistent
    out: dict[str, tuple[int, ...]] = {}
    taken: set[int] = set()
    for node in graph.nodes:
        mine = tuple(k for k in node.output_storages if k in held and k not in taken)
        if mine:
            taken.update(mine)
            out[node.name] = mine
    return out


class Transfers:
    """The copies of one replay: called by :func:`planner.core.simulate.replay_plan` where it would
    hold a saved storage, after each forward node, and around each backward node.

    ``storages_by_node``: what each offloaded node moves, together, back before the first
    backward node that needs one of them (its need). ``triggers``: the backward node issuing
    each node's fetch (computed where not given: :meth:`_just_in_time`)."""

    def __init__(self, graph: CostGraph, segments: Sequence[Sequence[str] | Segment],
                 storages_by_node: dict[str, tuple[int, ...]], spec: OffloadSpec,
                 triggers: dict[str, str] | None = None) -> None:

        self.graph = graph
        self.spec = spec
        self.sizes = {k: graph.storage_by_key[k].size_bytes for ks in storages_by_node.values() for k in ks}
        names = [s.node_names if isinstance(s, Segment) else s for s in segments]
        seg_idx = validate_segments(graph, names)
        self.recompute_ms = recompute_ms = [
            (s.recompute_ms if isinstance(s, Segment) else rerun_cost(graph, s)[0]) + graph.segment_overhead_ms
            for s in segments]
        facts = graph.replay_facts
        self.in_segment = in_segment = {i for idx in seg_idx for i in idx}
        need: dict[int, int] = {}
        for i in range(len(graph.nodes)):
            if i not in in_segment:
                for k in facts.saved[i]:
                    if k in self.sizes:
                        need[k] = max(need.get(k, i), i)
        recompute_at: dict[int, float] = {}
        for s, idx in enumerate(seg_idx):
            savers = [i for i in idx if graph.nodes[i].saved_storages]
            trigger = max(savers) if savers else idx[-1]
            recompute_at[trigger] = recompute_ms[s]
            for k in _segment_inputs(graph, idx) & self.sizes.keys():
                need[k] = max(need.get(k, trigger), trigger)
        self.ratio = backward_ratio(graph)
        # when each compute node's backward would start, were no copy waited for
        start_ms: dict[int, float] = {}
        clock = graph.forward_ms
        for i in range(len(graph.nodes) - 1, -1, -1):
            if graph.nodes[i].kind == "compute":
                start_ms[i] = clock
                clock += graph.nodes[i].time_ms * self.ratio + recompute_at.get(i, 0.0)
        self.node_need = {name: max(need[k] for k in ks) for name, ks in storages_by_node.items() if ks}
        self.order = sorted(self.node_need, key=lambda n: (-self.node_need[n], graph.index[n]))
        self.storages_by_node = storages_by_node
        self.triggers = dict(triggers) if triggers is not None else self._just_in_time(start_ms)
        self.issue_at: dict[int, list[str]] = {}
        self.need_at: dict[int, list[str]] = {}
        for name in self.order:
            self.issue_at.setdefault(graph.index[self.triggers[name]], []).append(name)
            self.need_at.setdefault(self.node_need[name], []).append(name)
        self.clock_ms = 0.0
        self.exposed_ms = 0.0
        self.holds: dict[int, int] = {}
        self.packed_at: dict[int, int] = {}
        self.pending_d2h: list[int] = []
        self.d2h_free_ms = 0.0
        self.d2h_done: dict[int, float] = {}
        self.h2d_free_ms = 0.0
        self.fetched: dict[str, float] = {}
        self.host_bytes = 0
        self.host_peak_bytes = 0

    def _just_in_time(self, start_ms: dict[int, float]) -> dict[str, str]:
        """Per offloaded node, the backward node whose start is the latest at which its fetch
        can be issued for every fetch to land by its need, queued in need order. A trigger is a
        node outside every segment whose output gets a gradient (where the runtime's gradient
        hook fires); without one before the need, the need itself fetches."""
        graph = self.graph
        differentiable = graph.replay_facts.differentiable
        eligible = [i for i in sorted(start_ms, key=lambda i: start_ms[i])  # backward order
                    if i not in self.in_segment and graph.nodes[i].name in differentiable]
        latest_finish = float("inf")
        out: dict[str, str] = {}
        for name in reversed(self.order):
            finish = min(start_ms[self.node_need[name]], latest_finish)
            begin = finish - self.spec.h2d_ms(sum(self.sizes[k] for k in self.storages_by_node[name]))
            latest_finish = begin
            candidates = [i for i in eligible if i >= self.node_need[name]]
            chosen = candidates[0] if candidates else self.node_need[name]
            for i in candidates[1:]:
                if start_ms[i] > begin:
                    break
                chosen = i
            out[name] = graph.nodes[chosen].name
        return out

    def take_hold(self, mem: MemoryAccount, k: int, i: int) -> bool:
        """Count a forward-to-backward hold of ``k`` at node ``i``; False where ``k`` stays."""
        if k not in self.sizes:
            return False
        if k not in self.holds:
            self.holds[k] = 0
            self.packed_at[k] = i
            mem.hold(k)  # the D2H copy reads it until done
        self.holds[k] += 1
        return True

    def _queue_copies(self, i: int) -> None:
        for k, at in self.packed_at.items():
            if at == i and k not in self.d2h_done:
                start = max(self.clock_ms, self.d2h_free_ms)
                self.d2h_free_ms = self.d2h_done[k] = start + self.spec.d2h_ms(self.sizes[k])
                self.pending_d2h.append(k)
                self.host_bytes += self.sizes[k]
                self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def _land_copies(self, mem: MemoryAccount) -> None:
        still = []
        for k in self.pending_d2h:
            if self.d2h_done[k] <= self.clock_ms:
                mem.release(k)
            else:
                still.append(k)
        self.pending_d2h = still

    def forward_done(self, mem: MemoryAccount, i: int) -> None:
        """Node ``i``'s forward has run: queue the copies it packed, land those that are done."""
        self.clock_ms += self.graph.nodes[i].time_ms
        self._queue_copies(i)
        self._land_copies(mem)

    def _fetch(self, mem: MemoryAccount, name: str) -> None:
        done = self.clock_ms
        for k in self.storages_by_node[name]:
            holds = self.holds.get(k, 0)
            if k in self.pending_d2h:  # its copy to the host has not landed: it never left
                self.pending_d2h.remove(k)
                for _ in range(holds):
                    mem.hold(k)
                mem.release(k)
                continue
            if k not in self.d2h_done:  # never packed (its holder did not run)
                continue
            mem.alloc(k, self.sizes[k])
            for _ in range(holds):
                mem.hold(k)
            start = max(self.clock_ms, self.h2d_free_ms, self.d2h_done[k])
            self.h2d_free_ms = done = start + self.spec.h2d_ms(self.sizes[k])
        self.fetched[name] = done

    def backward_needs(self, mem: MemoryAccount, i: int) -> None:
        """Node ``i``'s backward is next: issue the fetches it triggers; what it needs must be
        back, and the compute waits for it."""
        self._land_copies(mem)
        for name in self.issue_at.get(i, ()):
            if name not in self.fetched:
                self._fetch(mem, name)
        for name in self.need_at.get(i, ()):
            if name not in self.fetched:
                self._fetch(mem, name)
            ready = self.fetched[name]
            if ready > self.clock_ms:
                self.exposed_ms += ready - self.clock_ms
                self.clock_ms = ready
            self.host_bytes -= sum(self.sizes[k] for k in self.storages_by_node[name] if k in self.d2h_done)

    def backward_done(self, mem: MemoryAccount, i: int, recomputed_segment: int | None) -> None:
        """Node ``i``'s backward has run (after its segment's recompute, where it ran one)."""
        self.clock_ms += self.graph.nodes[i].time_ms * self.ratio
        if recomputed_segment is not None:
            self.clock_ms += self.recompute_ms[recomputed_segment]
        self._land_copies(mem)


def _storages_of(graph: CostGraph, segments: Sequence[Sequence[str] | Segment],
                 offloaded: Iterable[str]) -> dict[str, tuple[int, ...]]:
    movable = offloadable_nodes(graph, segments)
    out: dict[str, tuple[int, ...]] = {}
    for name in offloaded:
        if name not in graph.index:
            raise ValueError(f"offloaded node {name!r} is not a node of the graph")
        if movable.get(name):
            out[name] = movable[name]
    return out


def simulate_offload(graph: CostGraph, segments: Iterable[Sequence[str] | Segment], offloaded: Iterable[str],
                     spec: OffloadSpec, *, limit_bytes: float = math.inf,
                     triggers: dict[str, str] | None = None) -> OffloadSimulation:
    """Replay one step with ``segments`` recomputed and the held outputs of the ``offloaded``
    nodes (:func:`offloadable_nodes`; others are ignored) moved to host memory over ``spec``'s
    link. With ``limit_bytes`` the replay stops at the first moment above it and reports that
    moment as the peak (a plan that does not fit costs a fraction of a full replay).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(1,)),
        ...                CostNode("a", "relu", input_names=("x",), output_storages=(2,), saved_storages=(2,),
        ...                         output_bytes=100, requires_grad=True, time_ms=1.0)),
        ...               (Storage(1, 100, True), Storage(2, 100)), output_names=("a",), output_held=False,
        ...               loss_names=("a",))
        >>> simulate_offload(g, (), ("a",), OffloadSpec(1.0, 1.0)).offloaded_bytes   # the loss is held
        0
    """

    seg_list = list(segments)
    storages = _storages_of(graph, seg_list, offloaded)
    transfers = Transfers(graph, seg_list, storages, spec, triggers)
    mem = MemoryAccount(persistent_bytes(graph), limit_bytes=limit_bytes)
    try:
        replay_plan(graph, seg_list, mem, transfers)
    except AboveLimit:
        pass
    return OffloadSimulation(
        peak_bytes=mem.peak_bytes, peak_phase=mem.peak_at[0], peak_node=mem.peak_at[1],
        timeline=tuple(mem.timeline or ()), exposed_ms=transfers.exposed_ms,
        host_peak_bytes=transfers.host_peak_bytes, offloaded_bytes=sum(transfers.sizes.values()),
        offloaded=tuple(transfers.order[::-1]), triggers=tuple(transfers.triggers[n] for n in transfers.order[::-1]))
