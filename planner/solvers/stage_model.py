"""The numbers of the stage ILP's linear memory account (:mod:`planner.solvers.stage_ilp`), in MiB, and
its recompute times in ms: what each stage saves, reads and holds, which segments are
candidates, and, for a selective model, which outputs each stage may keep.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.stages import build_stages
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 5):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(5)), ("n4",))
    >>> model = build_stage_model(g, build_stages(g, 2), max_segment_stages=2)
    >>> model.segments   # (first stage, last stage) of every candidate segment
    [(0, 0), (0, 1), (1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.costgraph import MIB, CostGraph
from planner.solvers.keep import keepable_in_segment, kept_storages, policy_ms
from planner.core.rerun import stage_run_costs
from planner.core.stages import Stage

__all__ = ["KeepOption", "StageModel", "build_stage_model", "holder_groups"]


@dataclass(frozen=True)
class KeepOption:
    """A set of nodes of one stage whose outputs a selective segment keeps from the forward:
    the recompute time it saves and the storages it holds until the segment's recompute."""

    node_names: frozenset[str]
    saved_ms: float
    held_storages: frozenset[int]
    #: False when the option keeps the stage's last saving node: then the stage must not be
    #: the last of its segment
    ends_segment_allowed: bool = True


@dataclass(frozen=True)
class StageModel:
    """The numbers of the linear memory account, in MiB, and recompute times in ms.

    Memory is accounted storage by storage. A storage stays held while any of its holders
    has not run backward: a stage that saves it and is not recomputed, or a checkpointed
    segment that takes it as an input. ``holders[k]`` lists ``(stage, kind, ref)`` with kind
    ``"saver"`` (ref: the stage) or ``"input"`` (ref: the segment).
    """

    stages: list[Stage]
    base: float
    sizes: dict[int, float]
    produced_at: dict[int, int]
    forward_live: list[float]
    forward_live_keys: list[set[int]]
    holders: dict[int, list[tuple[int, str, object]]]
    param_grads: list[float]
    grads_in_flight: list[float]
    forward_transient: list[float]
    time_ms: list[float]
    flops: list[int]
    segments: list[tuple[int, int]]
    #: recompute time and FLOPs of every candidate segment (:mod:`planner.core.rerun`)
    run_ms: dict[tuple[int, int], float]
    run_flops: dict[tuple[int, int], int]
    recomputed: dict[tuple[int, int], float]
    segment_overhead: float
    #: per stage, the keep options a selective segment may use there (empty without selective)
    keep_options: list[list[KeepOption]]


def holder_groups(model: StageModel) -> dict[tuple[tuple[int, str, object], ...], list[int]]:
    """The storages of ``model`` grouped by their holders (sorted): a group is held exactly
    while any of its holders is, so the ILP (one ``held`` variable per multi-holder group) and
    the chain DP (:mod:`planner.solvers.chain_dp`) account each group as one."""
    groups: dict[tuple[tuple[int, str, object], ...], list[int]] = {}
    for k, holders in model.holders.items():
        groups.setdefault(tuple(sorted(set(holders), key=repr)), []).append(k)
    return groups


def keep_options_of(graph: CostGraph, stage: Stage, returned: set[int]) -> list[KeepOption]:
    """What a selective segment may keep in ``stage``: the outputs of its matmuls and
    convolutions (keepable nodes with FLOPs), Megatron's selective recompute.

    A segment's last node that saves something is never kept
    (:func:`planner.solvers.keep.keepable_in_segment`), so there are two options: the nodes before
    the stage's last saving node (allowed in any stage of a segment), and all of them (only in
    a stage that does not end its segment). An option keeping every keepable node made the ILP
    slower and its plans no cheaper (docs/tuning.md#keep_options_of), so it is not
    offered; the keep pass after the ILP (:func:`planner.solvers.keep.keep_outputs`) adds such nodes
    one by one where they fit.

    An option saves the time of the nodes it keeps less the selective policy's cost on the
    stage's nodes (``graph.selective_overhead_ms_per_node``); options that save nothing net are
    not offered. (The policy also slows the segment's other stages, which the ILP does not
    count; the plan's cost, from :func:`planner.solvers.keep.segment_with_kept`, does.)
    """
    policy_cost_ms = policy_ms(graph, stage.node_names)
    inner = keepable_in_segment(graph, stage.node_names)
    every = [name for name in stage.node_names if graph.node(name).selective_save]
    options: list[KeepOption] = []
    for candidates, anywhere in ((inner, True), (every, False)):
        chosen = [graph.node(name) for name in candidates]
        chosen = [n for n in chosen if n.flops > 0 and n.time_ms > 0]
        names = frozenset(n.name for n in chosen)
        saved_ms = sum(n.time_ms for n in chosen) - policy_cost_ms
        if not names or saved_ms <= 0 or any(o.node_names == names for o in options):
            continue
        held = frozenset(k for n in chosen for k in kept_storages(graph, n.name) if k not in returned)
        options.append(KeepOption(names, saved_ms, held, ends_segment_allowed=anywhere))
    return options


def build_stage_model(graph: CostGraph, stages: list[Stage], max_segment_stages: int,
                 selective: bool = False) -> StageModel:
    sizes_b = graph.storage_by_key
    persistent = {k for k, s in sizes_b.items() if s.persistent}
    stage_of = {name: j for j, st in enumerate(stages) for name in st.node_names}
    k_count = len(stages)
    nodes = [n for n in graph.nodes if n.name in stage_of]
    differentiable = {n.name for n in graph.nodes if n.requires_grad}

    returned = {k for name in graph.held_output_names for k in graph.node(name).output_storages} - persistent
    starts = graph.loss_names or tuple(n for n in graph.output_names if n in differentiable)
    base_bytes = graph.persistent_bytes + sum(sizes_b[k].size_bytes for k in returned)
    base_bytes += sum(graph.node(n).output_bytes for n in starts)

    produced_at: dict[int, int] = {}
    last_read: dict[int, int] = {}
    savers: dict[int, set[int]] = {}
    reads: list[set[int]] = [set() for _ in stages]
    saves: list[set[int]] = [set() for _ in stages]
    time_ms = [0.0] * k_count
    flops = [0] * k_count
    transient = [0.0] * k_count
    grads = [0.0] * k_count
    for node in nodes:
        j = stage_of[node.name]
        time_ms[j] += node.time_ms
        flops[j] += node.flops
        for k in (*node.output_storages, *node.saved_storages):
            if k not in persistent:
                produced_at.setdefault(k, j)
                last_read[k] = max(last_read.get(k, j), j)
        for k in node.saved_storages:
            if k not in persistent:
                savers.setdefault(k, set()).add(j)
                saves[j].add(k)
        for name in node.input_names:
            for k in graph.node(name).output_storages:
                if k not in persistent:
                    reads[j].add(k)
                    last_read[k] = max(last_read.get(k, j), j)
        transient[j] = max(transient[j], node.forward_peak_bytes / MIB, node.output_bytes / MIB)
        if node.requires_grad:
            inputs = sum(graph.node(n).output_bytes for n in set(node.input_names) if n in differentiable
                         and graph.node(n).kind == "compute")
            grads[j] = max(grads[j], (node.output_bytes + max(inputs, node.backward_peak_bytes)) / MIB)

    # gradients of values made before stage j and read after it are held during j's backward
    crossing_grads = [0.0] * k_count
    last_reader: dict[str, int] = {}
    for node in nodes:
        for name in node.input_names:
            last_reader[name] = max(last_reader.get(name, -1), stage_of[node.name])
    for node in nodes:
        if node.name not in differentiable or node.is_alias or node.name not in last_reader:
            continue
        for j in range(stage_of[node.name] + 1, last_reader[node.name]):
            crossing_grads[j] += node.output_bytes / MIB
    grads = [g + c for g, c in zip(grads, crossing_grads)]

    param_last_stage: dict[int, int] = {}
    param_bytes: dict[int, int] = {}
    for node in nodes:
        for name in node.input_names:
            src = graph.node(name)
            if src.kind == "param" and src.requires_grad and src.output_storages:
                key = src.output_storages[0]
                param_last_stage[key] = max(param_last_stage.get(key, -1), stage_of[node.name])
                param_bytes[key] = src.output_bytes
    param_grads = [0.0] * k_count
    for key, j in param_last_stage.items():
        for i in range(j + 1):
            param_grads[i] += param_bytes[key] / MIB

    forward_live = [0.0] * k_count
    forward_live_keys: list[set[int]] = [set() for _ in stages]
    for k, p in produced_at.items():
        if k in returned:
            continue
        for j in range(p, last_read[k]):
            forward_live[j] += sizes_b[k].size_bytes / MIB
            forward_live_keys[j].add(k)

    holders: dict[int, list[tuple[int, str, object]]] = {}
    for k, qs in savers.items():
        if k not in returned:
            holders.setdefault(k, []).extend((q, "saver", q) for q in qs)
    keep_options = [(keep_options_of(graph, st, returned) if selective and st.recomputable else [])
                    for st in stages]
    for j, options in enumerate(keep_options):
        for o, option in enumerate(options):
            for k in option.held_storages:
                produced_at.setdefault(k, j)
                holders.setdefault(k, []).append((j, "kept", (j, o)))
    segments: list[tuple[int, int]] = []
    # recomputed[(a, j)]: what a segment from a holds again by stage j's backward (the storages
    # it saves through j, made inside it), for each candidate segment's stages
    recomputed: dict[tuple[int, int], float] = {}
    for a in range(k_count):
        seen: set[int] = set()
        fresh = 0.0
        inputs: set[int] = set()
        for b in range(a, min(k_count, a + max_segment_stages)):
            if not stages[b].recomputable:
                break
            for k in saves[b]:
                if k not in seen and produced_at[k] >= a:
                    seen.add(k)
                    fresh += sizes_b[k].size_bytes / MIB
            recomputed[(a, b)] = fresh
            segments.append((a, b))
            inputs |= {k for k in reads[b] if produced_at.get(k, a) < a}
            for k in inputs - returned:
                holders.setdefault(k, []).append((a, "input", (a, b)))
    run_ms, run_flops = stage_run_costs(graph, stages, segments)
    return StageModel(
        stages=stages,
        base=base_bytes / MIB,
        sizes={k: sizes_b[k].size_bytes / MIB for k in produced_at},
        produced_at=produced_at,
        forward_live=forward_live,
        forward_live_keys=forward_live_keys,
        holders=holders,
        param_grads=param_grads,
        grads_in_flight=grads,
        forward_transient=transient,
        time_ms=time_ms,
        flops=flops,
        segments=segments,
        run_ms=run_ms,
        run_flops=run_flops,
        recomputed=recomputed,
        segment_overhead=graph.segment_overhead_bytes / MIB,
        keep_options=keep_options,
    )
