"""Whole layers checkpointed as module calls: a candidate of the graph-break path.

The graph-break path checkpoints ranges of the ops a step dispatches, and each op of a range is
recorded and replayed in Python (``CostGraph.range_overhead_ms_per_node``). On a model of many
small ops that overhead can make its plan dearer than what a person writes for the same model:
each layer's submodule call rerun eagerly by ``torch.utils.checkpoint``
(:class:`rewrite.module_checkpoint.ModuleCheckpointedModule`, as HuggingFace's
``gradient_checkpointing_enable()`` does), which replays nothing op by op. :func:`module_layer_plans`
prices every k-th child of each module list that way on the op-stream profile (the same op times,
no per-op overhead), and :func:`cheaper_module_layers` measures those predicted cheaper than the
graph-break plan (or, where the op ranges find no plan for the budget, any) and returns the
first whose step fits the budget. It needs torch;
:mod:`planner.graph_break_plan` calls it.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 7):   # three layers of two ops each
    ...     nodes.append(CostNode(f"n{i}", "aten.relu.default", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0, module=f"layers.{(i - 1) // 2}"))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",),
    ...               range_overhead_ms_per_node=0.5)
    >>> [(layers.plan.solver, layers.paths, layers.plan.recompute_ms) for layers in module_layer_plans(g, 2**30)]
    [('hand-placed (module calls): every layer', ('layers.0', 'layers.1', 'layers.2'), 6.0), \
('hand-placed (module calls): every 2nd layer', ('layers.0', 'layers.2'), 4.0)]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

from planner.core.costgraph import CostGraph
from planner.core.plan import GIB, Plan
from planner.core.simulate import simulate
from planner.solvers.hand_policies import (EVERY_KTH_LAYER_MAX_K, every_kth_layer_name, module_list_blocks,
                                           recomputable_runs, repeated_blocks)
from planner.solvers.keep import segment_with_kept
from profiling.measure import measure_step_peak_bytes
from rewrite.module_checkpoint import ModuleCheckpointedModule

__all__ = ["ModuleLayers", "module_layer_plans", "cheaper_module_layers", "MAX_MEASURED_LAYER_PLANS"]

log = logging.getLogger(__name__)

#: At most this many module-layer plans are measured against one graph-break plan.
MAX_MEASURED_LAYER_PLANS = 2


class ModuleLayers(NamedTuple):
    """A plan over an op-stream profile whose segments are whole submodule calls, and their paths."""

    plan: Plan
    paths: tuple[str, ...]


def module_layer_plans(graph: CostGraph, budget_bytes: int) -> list[ModuleLayers]:
    """Every k-th child (k = 1 .. ``EVERY_KTH_LAYER_MAX_K``) of each module list of ``graph`` (an
    op-stream profile) checkpointed as one module call, as plans for ``budget_bytes``: each
    child's recomputable runs of ops priced as a checkpoint reruns them, without
    ``graph.range_overhead_ms_per_node``; the peak is the simulator's. Plans that checkpoint the
    same children appear once. Lists run as one loop body (``ln[i]``, ``enc[i]``, ``proj[i]``)
    are left out: their layer is no one submodule, so no module call checkpoints it."""
    plain = dataclasses.replace(graph, range_overhead_ms_per_node=0.0, range_end_saves_held=False)
    layers = {tuple(stack) for stack in repeated_blocks(plain)}
    stacks = [stack for stack in module_list_blocks(plain) if tuple(names for _, names in stack) in layers]
    blocks = [block for stack in stacks for block in stack]
    runs_of = dict(zip((path for path, _ in blocks), recomputable_runs(plain, [names for _, names in blocks])))
    unoptimized_bytes = simulate(plain).peak_bytes
    plans: list[ModuleLayers] = []
    seen: set[tuple[str, ...]] = set()
    for k in range(1, EVERY_KTH_LAYER_MAX_K + 1):
        paths = tuple(path for stack in stacks if len(stack) > k or k == 1
                      for index, (path, _) in enumerate(stack) if index % k == 0 and runs_of[path])
        if not paths or paths in seen:
            continue
        seen.add(paths)
        segments = tuple(segment_with_kept(plain, run) for path in paths for run in runs_of[path])
        plans.append(ModuleLayers(Plan(
            budget_bytes, simulate(plain, segments).peak_bytes, unoptimized_bytes, segments, plain.forward_ms,
            plain.step_ms, plain.forward_flops, f"hand-placed (module calls): {every_kth_layer_name(k)}", 0.0,
            measured_unoptimized_peak_bytes=plain.measured_peak_bytes, capture="modules"), paths))
    return plans


def cheaper_module_layers(model: Any, inputs: Any, step: Any, graph: CostGraph, budget_bytes: int, room_bytes: int,
                          tolerance: float, than: Plan | None = None) -> ModuleCheckpointedModule | None:
    """``model`` with the module-layer plan (:func:`module_layer_plans`) predicted cheapest among
    those simulated within ``tolerance`` of ``budget_bytes`` (and, given ``than``, the graph-break
    plan solved on ``graph``, cheaper than it) whose measured step peak fits ``room_bytes``; at
    most :data:`MAX_MEASURED_LAYER_PLANS` are measured. None where none is cheaper or fits."""
    if than is not None and not than.segments:
        return None
    cheaper = sorted((layers for layers in module_layer_plans(graph, budget_bytes)
                      if (than is None or layers.plan.recompute_ms < than.recompute_ms)
                      and layers.plan.predicted_peak_bytes <= budget_bytes * (1 + tolerance)),
                     key=lambda layers: layers.plan.recompute_ms)
    for layers in cheaper[:MAX_MEASURED_LAYER_PLANS]:
        opt = ModuleCheckpointedModule(model, layers.plan, layers.paths, cost_graph=graph)
        peak_bytes = measure_step_peak_bytes(opt, inputs, step)
        if peak_bytes <= room_bytes:
            log.info("graph-break path: %s (%d module calls, %.1f ms predicted%s), measured peak %.4f GiB of "
                     "%.4f GiB budget", layers.plan.solver, len(layers.paths), layers.plan.recompute_ms,
                     "" if than is None else f" against the op ranges' {than.recompute_ms:.1f} ms",
                     peak_bytes / GIB, budget_bytes / GIB)
            opt.plan = dataclasses.replace(layers.plan, measured_peak_bytes=peak_bytes)
            return opt
        log.debug("%s measured %d bytes, above the room of %d", layers.plan.solver, peak_bytes, room_bytes)
    return None
