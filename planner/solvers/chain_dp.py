"""The stage ILP's memory account (:mod:`planner.solvers.stage_model`) solved by dynamic programming
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

Kept outputs (selective models): a segment may keep, in each of its stages, one of the stage's
keep options (:class:`planner.solvers.stage_model.KeepOption`), as the ILP's ``keep`` variables do. A
kept option's storages are held from its stage on and its saved time comes off the cost. Those
choices are made stage by stage inside the segment's step, each followed by that stage's
memory check, and partial choices with the same held groups are compared like labels; the
labels past the segment carry which options they kept.

The labels are numpy arrays per (stage, held groups). Every label no other dominates is kept,
of labels within :data:`planner.solvers.chain_labels.STORED_RESOLUTION_MIB` of each other in
stored MiB the cheapest, so the result is the account's optimum to within that much memory a
label kept over one it dropped: a plan found fits, and the plan it may miss fits only a budget a
few KiB smaller (docs/tuning.md#stored_resolution_mib). Their number is what the search costs
(docs/tuning.md#default_max_labels has it on the largest models the default solve builds);
past ``max_labels`` it stops with :class:`ChainSearchTooLarge`. The room a
label needs for each segment from a stage comes from :mod:`planner.solvers.chain_rooms`, for all
of them at once, and the labels reaching a (stage, held groups) are pruned as they arrive
(:mod:`planner.solvers.chain_labels`).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.stages import build_stages
    >>> from planner.solvers.stage_model import build_stage_model
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
import dataclasses
import functools
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from planner.core.errors import PlannerError
from planner.solvers.chain_labels import Inbox, LabelWindow, pruned as _pruned
from planner.solvers.chain_rooms import SegmentRooms
from planner.solvers.stage_model import StageModel, holder_groups

__all__ = ["ChainPlan", "ChainSearchTooLarge", "DEFAULT_MAX_LABELS", "cheapest_plan", "cheapest_segments"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: labels kept before the search gives up (12 bytes each are held to the end, about 300 MB;
#: 20 with keep options)
DEFAULT_MAX_LABELS = 25_000_000


class ChainSearchTooLarge(PlannerError):
    """The search kept more labels than allowed; solve the model another way (the ILP)."""


@dataclass(frozen=True)
class ChainPlan:
    """The search's plan: the chosen segments as ``(first stage, last stage)``, and the keep
    options they use as ``(stage, index into model.keep_options[stage])``."""

    segments: list[tuple[int, int]]
    keeps: list[tuple[int, int]]
    #: labels the search kept: what it cost (docs/tuning.md#default_max_labels)
    labels: int = 0

#: slack on the memory constraints (MiB), as the ILP's feasibility tolerance
_TOLERANCE_MIB = 1e-6


@dataclass
class _Groups:
    """Storages with the same holders, as the ILP groups them: their MiB, where each becomes
    held, what of them is live in the forward at each stage, and the last stage they matter at."""

    mib: list[float] = field(default_factory=list)
    by_saver: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    by_segment: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    by_keep: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
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
                groups.by_keep[ref].append(g)
    return groups


@dataclass
class _Block:
    """How the labels of one (stage, held groups) were reached: each one's parent label, the
    segment that led to it (-1: a stage not recomputed) and the keep options it used there (a
    code of :class:`_KeepCodes`). Labels are numbered from ``first_id``."""

    first_id: int
    parent: np.ndarray
    segment: np.ndarray
    #: None for a model without keep options
    keeps: np.ndarray | None


class _KeepCodes:
    """Keep choices as a tree: code 0 keeps nothing; every other code is one more
    ``(stage, option)`` after the choices of its parent code."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, int]] = [(-1, -1, -1)]
        self._index: dict[tuple[int, int, int], int] = {}

    def extended(self, codes: np.ndarray, stage: int, option: int) -> np.ndarray:
        """The codes of ``codes`` each followed by ``(stage, option)``."""
        parents, inverse = np.unique(codes, return_inverse=True)
        fresh = np.empty(len(parents), dtype=np.int64)
        for i, parent in enumerate(parents.tolist()):
            key = (parent, stage, option)
            if key not in self._index:
                self._index[key] = len(self._entries)
                self._entries.append(key)
            fresh[i] = self._index[key]
        return fresh[inverse.reshape(-1)]

    def choices(self, code: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while code > 0:
            code, stage, option = self._entries[code]
            out.append((stage, option))
        return out


def cheapest_segments(model: StageModel, budget_mib: float, max_labels: int = DEFAULT_MAX_LABELS
                      ) -> list[tuple[int, int]] | None:
    """The candidate segments of ``model`` (as ``(first stage, last stage)``) that the ILP of
    :func:`planner.solvers.stage_ilp.solve_ilp` would choose at ``budget_mib``, at its optimum: the least
    recompute time (plus the ILP's per-segment tie-break) whose linear account fits; None when
    none fits. For a segments-only model; :func:`cheapest_plan` also chooses keep options.

    Raises:
        ChainSearchTooLarge: more than ``max_labels`` labels were kept.
        ValueError: the model has keep options (a selective model).
    """
    if any(model.keep_options):
        raise ValueError("cheapest_segments does not choose kept outputs; use cheapest_plan for selective models")
    plan = cheapest_plan(model, budget_mib, max_labels)
    return None if plan is None else plan.segments


def cheapest_plan(model: StageModel, budget_mib: float, max_labels: int = DEFAULT_MAX_LABELS) -> ChainPlan | None:
    """The segments and keep options of ``model`` that the ILP of :func:`planner.solvers.stage_ilp.solve_ilp`
    would choose at ``budget_mib``, at its optimum: the least recompute time (plus the ILP's
    per-segment tie-break, less the kept options' saved time) whose linear account fits; None
    when none fits.

    Raises:
        ChainSearchTooLarge: more than ``max_labels`` labels were kept.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> from planner.core.stages import build_stages
        >>> from planner.solvers.stage_model import build_stage_model
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 9):  # a matmul (4 ms, 1 MiB out), then a pointwise op (0.5 ms, 4 MiB out)
        ...     mm = i % 2 == 1
        ...     nodes.append(CostNode(f"n{i}", "mm" if mm else "gelu", input_names=(nodes[-1].name,),
        ...                           output_storages=(i,), saved_storages=(i,), output_bytes=(1 if mm else 4) * 2**20,
        ...                           requires_grad=True, time_ms=4.0 if mm else 0.5, flops=10**6 * mm,
        ...                           selective_save=mm))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, nodes[i].output_bytes or 2**20, i == 0) for i in range(9)),
        ...               ("n8",))
        >>> model = build_stage_model(g, build_stages(g, 8), max_segment_stages=8, selective=True)
        >>> plan = cheapest_plan(model, budget_mib=21.0)  # stage 0's matmul keeps its output: only n2 reruns there
        >>> plan.segments, plan.keeps, plan.labels > 0
        ([(0, 1), (3, 3), (5, 5)], [(0, 0)], True)
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
    has_options = [bool(options) for options in model.keep_options]
    selective = any(has_options)
    keep_codes = _KeepCodes()
    segment_rooms = SegmentRooms(mib=groups.mib, live=groups.live_mib, segment_ends=segment_ends,
                                 by_segment=groups.by_segment, room_forward=room_forward,
                                 room_backward=room_backward, recomputed=model.recomputed,
                                 segment_overhead=model.segment_overhead)

    def crossing(held: frozenset[int], j: int) -> float:
        return sum(groups.live_mib[g].get(j, 0.0) for g in held)

    def room_in_segment(held: frozenset[int], first: int, i: int) -> float:
        return min(room_forward[i] + crossing(held, i), room_backward[i] - model.recomputed[(first, i)])

    def kept_in_segment(held: frozenset[int], stored: np.ndarray, cost: np.ndarray, ids: np.ndarray,
                        first: int, last: int) -> dict[frozenset[int], tuple[np.ndarray, ...]]:
        """Labels entering segment (first, last) with its inputs held, through its stages: at
        each, keep nothing or one of the stage's options, then the stage's memory check."""
        states = {held: (stored, cost, ids, np.zeros(len(ids), dtype=np.int64))}
        for i in range(first, last + 1):
            arriving: dict[frozenset[int], list[tuple[np.ndarray, ...]]] = defaultdict(list)
            for now_held, (st, co, pa, kc) in states.items():
                arriving[now_held].append((st, co, pa, kc))
                for o, option in enumerate(model.keep_options[i]):
                    if i == last and not option.ends_segment_allowed:
                        continue
                    added = [g for g in groups.by_keep.get((i, o), ()) if g not in now_held]
                    added_mib = sum(groups.mib[g] for g in added)
                    arriving[now_held.union(added)].append((st + added_mib, co - option.saved_ms, pa,
                                                            keep_codes.extended(kc, i, o)))
            passed: dict[frozenset[int], list[tuple[np.ndarray, ...]]] = defaultdict(list)
            for now_held, chunks in arriving.items():
                st, co, pa, kc = (np.concatenate(parts) for parts in zip(*chunks))
                fits = st <= room_in_segment(now_held, first, i)
                if fits.any():
                    # groups no holder or forward-live use reaches past i no longer tell states apart
                    passed[frozenset(g for g in now_held if groups.last_stage[g] > i)].append(
                        (st[fits], co[fits], pa[fits], kc[fits]))
            states = {now_held: _pruned(*(np.concatenate(parts) for parts in zip(*chunks))) if len(chunks) > 1
                      else chunks[0] for now_held, chunks in passed.items()}
            if sum(len(arrays[0]) for arrays in states.values()) > max_labels:
                raise ChainSearchTooLarge(f"more than {max_labels} partial keep choices in segment ({first}, {last})")
        return states

    # the groups that still tell labels apart after each stage: a holder or a forward-live use later
    reaching_past = [frozenset(g for g, last in enumerate(groups.last_stage) if last > j) for j in range(stage_count)]
    # the segments from each stage, in the order chain_rooms gives their ends: cost and code
    segment_costs = {j: [model.run_ms[(j, b)] + 1e-3 * total_ms for b in sorted(ends)] for j, ends in segment_ends.items()}
    segment_codes = {j: [segment_code[(j, b)] for b in sorted(ends)] for j, ends in segment_ends.items()}
    window = LabelWindow([max(segment_ends.get(j, ()), default=j) + 1 for j in range(stage_count)])
    new_inbox = functools.partial(Inbox, window)
    incoming: list[dict[frozenset[int], Inbox]] = [defaultdict(new_inbox) for _ in range(stage_count + 1)]
    incoming[0][frozenset()].add(np.zeros(1), np.zeros(1), np.array([-1], dtype=np.int64), -1)
    final_costs: list[tuple[_Block, np.ndarray]] = []
    blocks: list[_Block] = []
    block_starts: list[int] = []
    next_id = 0
    for j in range(stage_count + 1):
        # every front of the stage before its labels join the window: they arrive only later
        fronts = [(held, inbox.front(selective, j)) for held, inbox in incoming[j].items()]
        incoming[j] = {}  # done with: free the chunks
        for held, (stored, cost, parent, segment, keeps) in fronts:
            block = _Block(next_id, parent, segment.astype(np.int32), keeps if selective else None)
            blocks.append(block)
            block_starts.append(next_id)
            next_id += len(stored)
            if next_id > max_labels:
                raise ChainSearchTooLarge(f"more than {max_labels} labels by stage {j} of {stage_count}")
            if j == stage_count:
                final_costs.append((block, cost))
                continue
            window.append(j, block.first_id, stored, cost)
            # stage j not recomputed: the groups it saves are held from here
            added = [g for g in groups.by_saver.get(j, ()) if g not in held]
            now_held = held.union(added)
            added_mib = sum(groups.mib[g] for g in added)
            room = min(room_forward[j] + crossing(now_held, j), room_backward[j]) - added_mib
            fits = int(np.searchsorted(stored, room, side="right"))
            if fits:
                still = now_held & reaching_past[j]
                incoming[j + 1][still].defer(block.first_id, fits, added_mib, 0.0, -1)
            # a segment from j to b: its inputs are held from here, its stages save nothing
            if j in segment_ends and not any(has_options[j:max(segment_ends[j]) + 1]):
                ends, rooms, added_mibs, inputs = segment_rooms.rooms(j, held)
                added_list, costs, codes = added_mibs.tolist(), segment_costs[j], segment_codes[j]
                for r, fits in enumerate(np.searchsorted(stored, rooms, side="right").tolist()):
                    if fits:
                        b = ends[r]
                        still = held.union(inputs[r]) & reaching_past[b]
                        incoming[b + 1][still].defer(block.first_id, fits, added_list[r], costs[r], codes[r])
                continue
            for b in segment_ends.get(j, ()):
                added = [g for g in groups.by_segment.get((j, b), ()) if g not in held]
                now_held = held.union(added)
                added_mib = sum(groups.mib[g] for g in added) + model.segment_overhead
                run_ms = model.run_ms[(j, b)] + 1e-3 * total_ms
                code = segment_code[(j, b)]
                if not any(has_options[j:b + 1]):
                    room = min(room_in_segment(now_held, j, i) for i in range(j, b + 1)) - added_mib
                    fits = int(np.searchsorted(stored, room, side="right"))
                    if fits:
                        still = now_held & reaching_past[b]
                        incoming[b + 1][still].defer(block.first_id, fits, added_mib, run_ms, code)
                    continue
                ids = np.arange(block.first_id, block.first_id + len(stored), dtype=np.int64)
                for after_held, (st, co, pa, kc) in kept_in_segment(now_held, stored + added_mib, cost + run_ms, ids,
                                                                    j, b).items():
                    still = after_held & reaching_past[b]
                    incoming[b + 1][still].add(st, co, pa, code, kc)
    log.debug("chain DP on %d stages, %d segments: %d labels", stage_count, len(segment_list), next_id)
    plan = _backtrack(blocks, block_starts, final_costs, segment_list, keep_codes)
    return None if plan is None else dataclasses.replace(plan, labels=next_id)


def _backtrack(blocks: list[_Block], block_starts: list[int], final_costs: list[tuple[_Block, np.ndarray]],
               segment_list: list[tuple[int, int]], keep_codes: _KeepCodes) -> ChainPlan | None:
    """The segments and keep options on the way to the cheapest label past the last stage
    (None: no label)."""
    best: tuple[float, int] | None = None
    for blk, cost in final_costs:
        if len(cost):
            i = int(np.argmin(cost))
            if best is None or cost[i] < best[0]:
                best = (float(cost[i]), blk.first_id + i)
    if best is None:
        return None
    chosen: list[tuple[int, int]] = []
    keeps: list[tuple[int, int]] = []
    label = best[1]
    while label >= 0:
        blk = blocks[bisect.bisect_right(block_starts, label) - 1]
        i = label - blk.first_id
        if blk.segment[i] >= 0:
            chosen.append(segment_list[int(blk.segment[i])])
            if blk.keeps is not None:
                keeps.extend(keep_codes.choices(int(blk.keeps[i])))
        label = int(blk.parent[i])
    return ChainPlan(sorted(chosen), sorted(keeps))
