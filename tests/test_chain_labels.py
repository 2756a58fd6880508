"""The chain DP's two shortcuts against their definitions: the inbox that prunes labels as they
arrive keeps what pruning them all at once keeps, and the segment rooms computed for all the
segments from a stage at once are the per-stage, per-segment sums."""

from __future__ import annotations

import numpy as np
import pytest

from graphs import MIB, random_dag
from planner import simulate
from planner.core.stages import build_stages
from planner.solvers import chain_labels
from planner.solvers.chain_dp import _groups
from planner.solvers.chain_labels import Inbox, pruned
from planner.solvers.chain_rooms import SegmentRooms
from planner.solvers.stage_model import build_stage_model


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("merge_at", [1, 8, chain_labels.MERGE_AT_LABELS])
def test_the_inbox_keeps_what_pruning_every_label_at_once_keeps(seed, merge_at, monkeypatch):
    """Chunks sorted by stored MiB, as the DP's are, with many equal stored MiB and costs: the
    inbox's front is :func:`pruned` of all the labels in arrival order, parents and segment
    codes included, however often it merges."""
    monkeypatch.setattr(chain_labels, "MERGE_AT_LABELS", merge_at)
    rng = np.random.default_rng(seed)
    inbox = Inbox()
    stored_parts, cost_parts, parent_parts, segment_parts = [], [], [], []
    next_parent = 0
    for code in range(int(rng.integers(1, 30))):
        n = int(rng.integers(1, 40))
        stored = np.sort(rng.integers(0, 30, n) * 0.5)
        cost = np.sort(rng.integers(0, 12, n) + (rng.random(n) < 0.3) * 0.25)[::-1].copy()
        parent = np.arange(next_parent, next_parent + n)
        next_parent += n
        inbox.add(stored, cost, parent, code)
        stored_parts.append(stored), cost_parts.append(cost), parent_parts.append(parent)
        segment_parts.append(np.full(n, code))
    expected = pruned(*(np.concatenate(parts) for parts in (stored_parts, cost_parts, parent_parts, segment_parts)))
    front = inbox.front(selective=False)
    for got, want in zip(front, expected):
        assert got.tolist() == want.tolist()
    assert not front[4].any()


@pytest.mark.parametrize("seed", range(10))
def test_segment_rooms_are_the_per_stage_sums(seed):
    """For every start stage and a few held sets, :meth:`SegmentRooms.rooms` gives, per segment,
    the least over its stages of the forward room plus what the held groups and its inputs
    leave live there and of the backward room less what it holds again, less what its inputs
    add: the chain DP's memory check written out."""
    g = random_dag(seed, 14 + seed)
    model = build_stage_model(g, build_stages(g, 4 + seed % 6), max_segment_stages=1 + seed % 5)
    groups = _groups(model)
    budget = simulate(g).peak_bytes * 0.7 / MIB
    stage_count = len(model.stages)
    room_forward = [budget - model.base - model.forward_live[j] - model.forward_transient[j]
                    for j in range(stage_count)]
    room_backward = [budget - model.base - model.param_grads[j] - model.grads_in_flight[j] for j in range(stage_count)]
    ends: dict[int, list[int]] = {}
    for a, b in model.segments:
        ends.setdefault(a, []).append(b)
    rooms = SegmentRooms(mib=groups.mib, live=groups.live_mib, segment_ends=ends, by_segment=groups.by_segment,
                         room_forward=room_forward, room_backward=room_backward, recomputed=model.recomputed,
                         segment_overhead=model.segment_overhead)
    rng = np.random.default_rng(seed)
    for j in sorted(ends):
        for _ in range(3):
            held = frozenset(g for g in range(len(groups.mib)) if rng.random() < 0.4)
            got_ends, got_room, got_added, got_inputs = rooms.rooms(j, held)
            assert got_ends == sorted(ends[j])
            for r, b in enumerate(got_ends):
                added = [g for g in groups.by_segment.get((j, b), ()) if g not in held]
                now_held = held | set(added)
                added_mib = sum(groups.mib[g] for g in added) + model.segment_overhead
                crossing = [sum(groups.live_mib[g].get(i, 0.0) for g in now_held) for i in range(j, b + 1)]
                room = min(min(room_forward[i] + crossing[i - j], room_backward[i] - model.recomputed[(j, i)])
                           for i in range(j, b + 1)) - added_mib
                assert got_added[r] == pytest.approx(added_mib, abs=1e-9)
                assert got_room[r] == pytest.approx(room, abs=1e-9)
                assert got_inputs[r] == frozenset(groups.by_segment.get((j, b), ()))


@pytest.mark.parametrize("seed", range(10))
def test_deferred_arrivals_give_the_front_added_chunks_give(seed):
    """Labels deferred as (first id, count, added MiB, added cost, segment) of a window's fronts,
    built when the front is asked for, make the front that adding the same shifted prefixes as
    arrays makes, parents and segment codes included."""
    rng = np.random.default_rng(seed)
    stage_count = 6
    window = chain_labels.LabelWindow([stage_count] * stage_count)
    fronts, next_id = [], 0
    for stage in range(stage_count - 1):
        n = int(rng.integers(1, 300))
        stored, cost = pruned(np.sort(rng.random(n) * 50), np.sort(rng.random(n) * 20)[::-1].copy())
        window.append(stage, next_id, stored, cost)
        fronts.append((next_id, stored, cost))
        next_id += len(stored)
    deferred, added = Inbox(window), Inbox()
    for code in range(int(rng.integers(1, 60))):
        first_id, stored, cost = fronts[int(rng.integers(len(fronts)))]
        count = int(rng.integers(1, len(stored) + 1))
        mib, ms = float(rng.random() * 5), float(rng.random() * 3)
        deferred.defer(first_id, count, mib, ms, code)
        added.add(stored[:count] + mib, cost[:count] + ms, np.arange(first_id, first_id + count), code)
    for got, want in zip(deferred.front(False, stage_count), added.front(False)):
        assert got.tolist() == want.tolist()
