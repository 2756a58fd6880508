"""The module path's cost model: a module-level profile (:mod:`profiling.module_profile`) as the
:class:`CostGraph` every solver reads.

Compute nodes alternate between one glue node for what runs between units (never recomputed)
and one node per unit (recomputable when its module is called once), so every segment a solver
picks is exactly one unit call.

Example:
    >>> import torch
    >>> from profiling.module_profile import profile_modules
    >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> model = torch.nn.Sequential(block(), block(), block())
    >>> graph = module_cost_graph(profile_modules(model, (torch.randn(4, 8),), timing_repeats=1))
    >>> [n.name for n in graph.compute_nodes][:3]
    ['glue_0', '0', 'glue_1']
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace

from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.simulate import simulate
from profiling.module_profile import ModuleProfile, unit_node_name

__all__ = ["module_cost_graph"]

log = logging.getLogger(__name__)


def module_cost_graph(profile: ModuleProfile) -> CostGraph:
    """The profile as a :class:`CostGraph`: persistent nodes, then ``glue_0, <unit>, glue_1,
    <unit>, ..., glue_n`` (units named by :func:`profiling.module_profile.unit_node_name`). A unit node allocates its outputs and what autograd saved inside it;
    a glue node what was saved, or first seen, between units (it reads the previous unit's
    outputs). The measured unoptimized peak above the replay's is held all step as one more
    persistent storage, so a plan's prediction includes what the hooks cannot see."""
    calls, units = profile.calls, profile.units
    nodes: list[CostNode] = []
    producer: dict[int, str] = {}
    for key, kind in sorted(profile.persistent.items()):
        name = f"{kind}_{key}"
        nodes.append(CostNode(name, "placeholder" if kind == "input" else "get_attr", kind=kind,
                              output_storages=(key,), output_bytes=profile.storage_bytes[key] if kind == "param" else 0,
                              requires_grad=kind == "param"))
        producer[key] = name
    spans = [(calls[u.call].start_seq, calls[u.call].end_seq) for u in units]
    gap_saves: list[list[int]] = [[] for _ in range(len(units) + 1)]
    unit_saves: list[list[int]] = [[] for _ in units]
    for seq, key, _ in profile.saves:
        gap = sum(1 for start, _ in spans if start < seq)
        if gap and seq < spans[gap - 1][1]:
            unit_saves[gap - 1].append(key)
        else:
            gap_saves[gap].append(key)

    def glue(k: int, before: tuple[int, ...], previous: str | None) -> None:
        saved = tuple(dict.fromkeys(gap_saves[k]))
        fresh = tuple(key for key in dict.fromkeys((*saved, *before)) if key not in producer)
        name = f"glue_{k}"
        reads = {producer[key] for key in saved if key in producer}
        reads.update({previous} if previous else set())
        nodes.append(CostNode(name, "glue", input_names=tuple(sorted(reads)), output_storages=fresh,
                              saved_storages=saved, recomputable=False))
        for key in fresh:
            producer[key] = name

    previous: str | None = None
    for k, unit in enumerate(units):
        call = calls[unit.call]
        glue(k, call.input_keys, previous)
        name = unit_node_name(unit)
        reads = [producer[key] for key in (*call.input_keys, *profile.unit_param_keys[unit.call]) if key in producer]
        saved = tuple(dict.fromkeys(unit_saves[k]))
        outputs = tuple(call.output_keys)
        nodes.append(CostNode(
            name, f"module:{unit.path or '<root>'}", input_names=tuple(dict.fromkeys(reads)), output_storages=outputs,
            saved_storages=saved, output_bytes=call.output_bytes, requires_grad=call.requires_grad,
            is_alias=any(key in producer for key in outputs), time_ms=statistics.median(call.time_ms),
            recomputable=unit.checkpointable, module=unit.path, after_last_save_fraction=0.0))
        for key in (*outputs, *saved):
            producer.setdefault(key, name)
        previous = name
    glue(len(units), profile.output_keys, previous)
    outputs = tuple(dict.fromkeys(producer[key] for key in profile.output_keys if key in producer))
    storages = tuple(Storage(key, size, key in profile.persistent) for key, size in sorted(profile.storage_bytes.items())
                     if key in producer or key in profile.persistent)
    graph = CostGraph(tuple(nodes), storages, output_names=outputs or (f"glue_{len(units)}",),
                      step_ms=profile.step_ms, measured_peak_bytes=profile.measured_peak_bytes,
                      output_held=profile.output_held,
                      metadata={"capture": "modules"})
    return calibrated(graph)


def calibrated(graph: CostGraph) -> CostGraph:
    """``graph`` with the measured unoptimized peak's bytes that the replay misses (temporaries
    the hooks cannot see) added at the node where the replay peaks, as that node's forward or
    backward temporaries: they then count where that node runs, not all step. Where that cannot
    reach the measured peak, they are held all step instead."""
    measured = graph.measured_peak_bytes or 0
    result = simulate(graph)
    if measured <= result.peak_bytes:
        return graph
    node = graph.node(result.peak_node) if result.peak_node in graph.index else None
    if node is not None and node.kind == "compute" and result.peak_phase in ("forward", "backward"):
        field_name = "forward_peak_bytes" if result.peak_phase == "forward" else "backward_peak_bytes"
        # start above what the node allocates itself, so that the temporaries are what it peaks at
        near = node.output_bytes + sum(graph.node(name).output_bytes for name in node.input_names)
        extra = measured - result.peak_bytes + 2 * near
        best: CostGraph | None = None
        for _ in range(4):
            trial = replace(graph, nodes=tuple(replace(n, **{field_name: extra}) if n.name == node.name else n
                                               for n in graph.nodes))
            peak = simulate(trial).peak_bytes
            if peak < measured:
                extra += measured - peak
                continue
            best = trial
            if peak == measured:
                break
            extra -= peak - measured
        if best is not None:
            log.debug("module profile: %d bytes measured above the replay's peak added at %s's %s",
                      measured - result.peak_bytes, node.name, result.peak_phase)
            return best
    key = max(s.key for s in graph.storages) + 1
    log.debug("module profile: %d bytes measured above the replay's peak are held all step", measured - result.peak_bytes)
    return replace(graph, storages=(*graph.storages, Storage(key, measured - result.peak_bytes, True)))
