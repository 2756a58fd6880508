"""The stage ILP's memory account (:mod:`planner.stage_model`) solved by dynamic programming
over the chain of stages, instead of by branch and bound.

A plan is a set of non-overlapping candidate segments. Walking the stages in order, what a plan
has stored by stage ``j`` only grows: a storage group is held from the first of its holders
that is active (a stage that saves it and is not recomputed, or a chosen segment that takes it
as an input). Both memory constraints at stage ``j`` (forward and backward) bound that stored
amount, less what is live in the forward anyway, plus terms known at ``j``. So a partial plan
up to stage ``j`` is summed up by a label: its recompute cost, its stored MiB (with the
segments' overhead), and which groups it holds that later stages can still add or read as
live. Labels with the same held groups are compared by (cost, stored): one that is no cheaper
and stores no less is dropped. The cheapest label past the last stage is the plan.

Kept outputs (selective models) are not modelled here; such models go to the ILP.

The labels are numpy arrays per (stage, held groups). Every label no other dominates is kept,
so the result is the account's optimum. Their number is what the search costs: about a
million (0.6 s) on a 24-layer GPT-2 on 491 stages, ten million (6 s) on a 94-layer one on
1,024 stages; past ``max_labels`` it stops with :class:`ChainSearchTooLarge`.

Example:
    >>> from planner.costgraph import CostGraph, CostNode, Storage
    >>> from planner.stages import build_stages
    >>> from planner.stage_model import build_stage_model
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):   # a chain; later nodes take longer to recompute
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=float(i)))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> model = build_stage_model(g, build_stages(g, 8), max_segment_stages=8)
    >>> cheapest_segments(model, budget_mib=12.0)     # everything fits: nothing recomputed
    []
    >>> cheapest_segments(model, budget_mib=9.0)      # the first three stages, recomputed as one
    [(0, 2)]
    >>> cheapest_segments(model, budget_mib=8.0)
    [(0, 2), (4, 4)]
    >>> cheapest_segments(model, budget_mib=7.0) is None
    True
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from planner.errors import PlannerError
from planner.stage_model import StageModel, holder_groups

__all__ = ["ChainSearchTooLarge", "DEFAULT_MAX_LABELS", "cheapest_segments"]

#: labels kept before the search gives up (12 bytes each are held to the end: about 300 MB)
DEFAULT_MAX_LABELS = 25_000_000


class ChainSearchTooLarge(PlannerError):
    """The search kept more labels than allowed; solve the model another way (the ILP)."""

#: slack on the memory constraints (MiB), as the ILP's feasibility tolerance
_TOLERANCE_MIB = 1e-6


@dataclass
class _Groups:
    """Storages with the same holders, as the ILP groups them: their MiB, where each becomes
    held, what of them is live in the forward at each stage, and the last stage they matter at."""

    mib: list[float] = field(default_factory=list)
    by_saver: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    by_segment: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    live_mib: list[dict[int, float]] = field(default_factory=list)
    last_stage: list[int] = field(default_factory=list)


def _groups(model: StageModel) -> _Groups:
    stage_count = len(model.stages)
    groups = _Groups()
    for g, (holders, keys) in enumerate(holder_groups(model).items()):
        groups.mib.append(sum(model.sizes[k] for k in keys))
        first = min(pos for pos, _, _ in holders)
        live: dict[int, float] = {}
        for j in range(first, stage_count):
            mib = sum(model.sizes[k] for k in keys if k in model.forward_live_keys[j])
            if mib:
                live[j] = mib
        groups.live_mib.append(live)
        groups.last_stage.append(max([pos for pos, _, _ in holders] + list(live)))
        for pos, kind, ref in holders:
            if kind == "saver":
                groups.by_saver[pos].append(g)
            elif kind == "input":
                groups.by_segment[ref].append(g)
            else:
                raise ValueError("cheapest_segments does not model kept outputs; use the ILP for selective models")
    return groups


@dataclass
class _Block:
    """How the labels of one (stage, held groups) were reached: each one's parent label and the
    segment that led to it (-1: a stage not recomputed). Labels are numbered from ``first_id``."""

    first_id: int
    parent: np.ndarray
    segment: np.ndarray


def _pruned(stored: np.ndarray, cost: np.ndarray, parent: np.ndarray, segment: np.ndarray
            ) -> tuple[np.ndarray, ...]:
    """The labels no other beats on both stored MiB and cost, by stored MiB."""
    order = np.lexsort((cost, stored))
    stored, cost, parent, segment = stored[order], cost[order], parent[order], segment[order]
    cheaper = np.ones(len(cost), dtype=bool)
    if len(cost) > 1:
        running = np.minimum.accumulate(cost)
        cheaper[1:] = cost[1:] < running[:-1] - 1e-12
    return stored[cheaper], cost[cheaper], parent[cheaper], segment[cheaper]


def cheapest_segments(model: StageModel, budget_mib: float, max_labels: int = DEFAULT_MAX_LABELS
                      ) -> list[tuple[int, int]] | None:
    """The candidate segments of ``model`` (as ``(first stage, last stage)``) that the ILP of
    :func:`planner.solve._solve_ilp` would choose at ``budget_mib``, at its optimum: the least
    recompute time (plus the ILP's per-segment tie-break) whose linear account fits; None when
    none fits.

    Raises:
        ChainSearchTooLarge: more than ``max_labels`` labels were kept.
        ValueError: the model has keep options (a selective model).
    """
    stage_count = len(model.stages)
    groups = _groups(model)
    total_ms = sum(model.time_ms) or 1.0
    segment_ends: dict[int, list[int]] = defaultdict(list)
    for a, b in model.segments:
        segment_ends[a].append(b)
    segment_list = sorted(model.segments)
    segment_code = {s: i for i, s in enumerate(segment_list)}
    room_forward = [budget_mib + _TOLERANCE_MIB - model.base - model.forward_live[j] - model.forward_transient[j]
                    for j in range(stage_count)]
    room_backward = [budget_mib + _TOLERANCE_MIB - model.base - model.param_grads[j] - model.grads_in_flight[j]
                     for j in range(stage_count)]

    def crossing(held: frozenset[int], j: int) -> float:
        return sum(groups.live_mib[g].get(j, 0.0) for g in held)

    incoming: list[dict[frozenset[int], list[tuple[np.ndarray, ...]]]] = [defaultdict(list)
                                                                          for _ in range(stage_count + 1)]
    empty_parent = np.array([-1], dtype=np.int64)
    incoming[0][frozenset()].append((np.zeros(1), np.zeros(1), empty_parent, np.array([-1], dtype=np.int64)))
    final_costs: list[tuple[_Block, np.ndarray]] = []
    blocks: list[_Block] = []
    block_starts: list[int] = []
    next_id = 0
    for j in range(stage_count + 1):
        for held, chunks in incoming[j].items():
            stored, cost, parent, segment = (np.concatenate(parts) for parts in zip(*chunks))
            stored, cost, parent, segment = _pruned(stored, cost, parent, segment)
            block = _Block(next_id, parent, segment.astype(np.int32))
            blocks.append(block)
            block_starts.append(next_id)
            next_id += len(stored)
            if next_id > max_labels:
                raise ChainSearchTooLarge(f"more than {max_labels} labels by stage {j} of {stage_count}")
            if j == stage_count:
                final_costs.append((block, cost))
                continue
            ids = np.arange(block.first_id, block.first_id + len(stored), dtype=np.int64)
            # stage j not recomputed: the groups it saves are held from here
            added = [g for g in groups.by_saver.get(j, ()) if g not in held]
            now_held = held.union(added)
            added_mib = sum(groups.mib[g] for g in added)
            room = min(room_forward[j] + crossing(now_held, j), room_backward[j]) - added_mib
            fits = int(np.searchsorted(stored, room, side="right"))
            if fits:
                still = frozenset(g for g in now_held if groups.last_stage[g] > j)
                incoming[j + 1][still].append((stored[:fits] + added_mib, cost[:fits], ids[:fits],
                                               np.full(fits, -1, dtype=np.int64)))
            # a segment from j to b: its inputs are held from here, its stages save nothing
            for b in segment_ends.get(j, ()):
                added = [g for g in groups.by_segment.get((j, b), ()) if g not in held]
                now_held = held.union(added)
                added_mib = sum(groups.mib[g] for g in added) + model.segment_overhead
                room = min(min(room_forward[i] + crossing(now_held, i),
                               room_backward[i] - model.recomputed[(j, i)]) for i in range(j, b + 1)) - added_mib
                fits = int(np.searchsorted(stored, room, side="right"))
                if fits:
                    still = frozenset(g for g in now_held if groups.last_stage[g] > b)
                    run_ms = model.run_ms[(j, b)] + 1e-3 * total_ms
                    incoming[b + 1][still].append((stored[:fits] + added_mib, cost[:fits] + run_ms, ids[:fits],
                                                   np.full(fits, segment_code[(j, b)], dtype=np.int64)))
        incoming[j] = {}  # done with: free the chunks
    return _backtrack(blocks, block_starts, final_costs, segment_list)


def _backtrack(blocks: list[_Block], block_starts: list[int], final_costs: list[tuple[_Block, np.ndarray]],
               segment_list: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The segments on the way to the cheapest label past the last stage (None: no label)."""
    best: tuple[float, int] | None = None
    for blk, cost in final_costs:
        if len(cost):
            i = int(np.argmin(cost))
            if best is None or cost[i] < best[0]:
                best = (float(cost[i]), blk.first_id + i)
    if best is None:
        return None
    chosen: list[tuple[int, int]] = []
    label = best[1]
    while label >= 0:
        blk = blocks[bisect.bisect_right(block_starts, label) - 1]
        i = label - blk.first_id
        if blk.segment[i] >= 0:
            chosen.append(segment_list[int(blk.segment[i])])
        label = int(blk.parent[i])
    return sorted(chosen)
