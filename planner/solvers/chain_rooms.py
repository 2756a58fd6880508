"""The room a chain-DP label needs below it to take each segment from one stage, for all the
segments from that stage at once.

For a segment ``(j, b)`` entered with the groups ``held``, the chain DP
(:mod:`planner.solvers.chain_dp`) needs the least, over the segment's stages ``i``, of the room
left in the forward (``room_forward[i]`` plus what of the now-held groups is live there anyway)
and in the backward (``room_backward[i]`` less what the segment holds again by ``i``), less what
taking its inputs adds. Summed one stage and one segment at a time in Python, that is most of
a solve on many stages with long segments (docs/tuning.md#merge_at_labels times both).
:class:`SegmentRooms` builds, once per start stage, matrices over the segments from it and the
stages they span, so that one label block's rooms for all its segments are a few array
operations.

Example:
    >>> rooms = SegmentRooms(mib=[1.0], live=[{0: 1.0, 1: 1.0}], segment_ends={0: [0, 1]},
    ...                      by_segment={(0, 1): [0]}, room_forward=[5.0, 4.0], room_backward=[9.0, 9.0],
    ...                      recomputed={(0, 0): 0.0, (0, 1): 2.0}, segment_overhead=0.0)
    >>> ends, room, added_mib, inputs = rooms.rooms(0, frozenset())
    >>> ends, room.tolist(), added_mib.tolist(), inputs
    ([0, 1], [5.0, 4.0], [0.0, 1.0], [frozenset(), frozenset({0})])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SegmentRooms"]


@dataclass(frozen=True)
class _FromStage:
    """The segments from one stage ``j``: their last stages, the groups any of them takes as
    inputs, and matrices over (segment, stage ``j + k``) with ``+inf`` past a segment's end."""

    ends: list[int]
    #: each segment's input groups, as a set
    inputs: list[frozenset[int]]
    #: the groups any segment from ``j`` takes as inputs, and a row per segment marking its own
    groups: list[int]
    member: np.ndarray
    #: forward-live MiB of those groups over the window (group, k)
    group_live: np.ndarray
    group_mib: np.ndarray
    #: room_forward and room_backward less what the segment holds again, (segment, k)
    forward: np.ndarray
    backward: np.ndarray


class SegmentRooms:
    """Rooms of every segment from a stage, for a label block's held groups (see the module).

    ``mib[g]``: group ``g``'s MiB; ``live[g]``: its forward-live MiB by stage;
    ``segment_ends[j]``: the last stages of the candidate segments from ``j``;
    ``by_segment[(j, b)]``: the groups segment ``(j, b)`` takes as inputs; ``room_forward``,
    ``room_backward`` and ``recomputed``: the chain DP's terms of its memory checks."""

    def __init__(self, *, mib: Sequence[float], live: Sequence[Mapping[int, float]],
                 segment_ends: Mapping[int, Sequence[int]], by_segment: Mapping[tuple[int, int], Sequence[int]],
                 room_forward: Sequence[float], room_backward: Sequence[float],
                 recomputed: Mapping[tuple[int, int], float], segment_overhead: float) -> None:
        self._mib = np.asarray(mib, dtype=float)
        self._live_from: list[int] = []
        self._live: list[np.ndarray] = []
        for by_stage in live:
            first = min(by_stage, default=0)
            values = np.zeros(max(by_stage, default=-1) + 1 - first)
            for i, value in by_stage.items():
                values[i - first] = value
            self._live_from.append(first)
            self._live.append(values)
        self._segment_ends = segment_ends
        self._by_segment = by_segment
        self._room_forward = np.asarray(room_forward, dtype=float)
        self._room_backward = np.asarray(room_backward, dtype=float)
        self._recomputed = recomputed
        self._overhead = segment_overhead
        self._tables: dict[int, _FromStage] = {}

    def _live_window(self, g: int, j: int, width: int) -> np.ndarray:
        """Group ``g``'s forward-live MiB at stages ``j .. j + width - 1``."""
        out = np.zeros(width)
        self._add_live(out, g, j)
        return out

    def _add_live(self, out: np.ndarray, g: int, j: int) -> None:
        values, first = self._live[g], self._live_from[g]
        low, high = max(j, first), min(j + len(out), first + len(values))
        if low < high:
            out[low - j:high - j] += values[low - first:high - first]

    def _table(self, j: int) -> _FromStage:
        table = self._tables.get(j)
        if table is not None:
            return table
        ends = sorted(self._segment_ends.get(j, ()))
        width = ends[-1] - j + 1
        inputs = [frozenset(self._by_segment.get((j, b), ())) for b in ends]
        groups = sorted(set().union(*inputs))
        column = {g: c for c, g in enumerate(groups)}
        member = np.zeros((len(ends), len(groups)))
        forward = np.full((len(ends), width), np.inf)
        backward = np.full((len(ends), width), np.inf)
        for r, b in enumerate(ends):
            for g in inputs[r]:
                member[r, column[g]] = 1.0
            span = b - j + 1
            forward[r, :span] = self._room_forward[j:b + 1]
            backward[r, :span] = self._room_backward[j:b + 1] - np.array(
                [self._recomputed[(j, i)] for i in range(j, b + 1)])
        group_live = np.array([self._live_window(g, j, width) for g in groups]).reshape(len(groups), width)
        table = _FromStage(ends, inputs, groups, member, group_live, self._mib[groups], forward, backward)
        self._tables[j] = table
        return table

    def rooms(self, j: int, held: frozenset[int]
              ) -> tuple[list[int], np.ndarray, np.ndarray, list[frozenset[int]]]:
        """For the segments ``(j, b)`` from stage ``j``, entered holding ``held``: their ``b``
        (ascending), the most stored MiB a label may have to take each, the MiB its inputs add
        to the label (the segment's overhead included), and its input groups."""
        table = self._table(j)
        width = table.forward.shape[1]
        crossing = np.zeros(width)
        for g in held:
            self._add_live(crossing, g, j)
        taken = table.member
        if held and table.groups:
            taken = table.member * np.array([g not in held for g in table.groups], dtype=float)
        added_live = taken @ table.group_live
        added_mib = taken @ table.group_mib + self._overhead
        room = np.minimum(table.forward + crossing + added_live, table.backward).min(axis=1) - added_mib
        return table.ends, room, added_mib, table.inputs
