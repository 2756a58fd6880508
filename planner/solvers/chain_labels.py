"""The labels arriving at one (stage, held groups) of the chain DP, pruned as they come.

Each label of the chain DP (:mod:`planner.solvers.chain_dp`) is a partial plan's stored MiB and
cost; of the labels reaching one (stage, held groups) only those no other beats on both are
kept (:func:`pruned`). They arrive in chunks, one per label block and segment, each sorted by
stored MiB. On deep models nearly all of them are beaten (docs/tuning.md#merge_at_labels):
:class:`Inbox` keeps the front of what arrived so far and drops each new label that front
already beats before it is copied and sorted. Most labels reach an inbox as a prefix of one
(stage, held groups)'s front shifted by a segment's MiB and cost: those arrive as a few numbers
each (:meth:`Inbox.defer`) and are built together, from the recent stages' labels kept in a
:class:`LabelWindow`, when the inbox's front is asked for, so the search pays numpy's call
overhead per inbox rather than per segment and label front.

Example:
    >>> inbox = Inbox()
    >>> inbox.add(np.array([1.0, 2.0]), np.array([5.0, 3.0]), np.array([0, 1]), 7)
    >>> inbox.add(np.array([1.5, 3.0]), np.array([6.0, 1.0]), np.array([2, 3]), 8)
    >>> stored, cost, parent, segment, keeps = inbox.front(selective=False)
    >>> stored.tolist(), cost.tolist(), parent.tolist(), segment.tolist()
    ([1.0, 2.0, 3.0], [5.0, 3.0, 1.0], [0, 1, 3], [7, 7, 8])
"""

from __future__ import annotations

import numpy as np

__all__ = ["Inbox", "LabelWindow", "pruned", "MERGE_AT_LABELS", "STORED_RESOLUTION_MIB"]

#: Labels an inbox gathers before it first prunes them into a front that later chunks are
#: checked against: fewer costs a sort per few chunks, more lets more beaten labels through.
MERGE_AT_LABELS = 4096


#: Labels whose stored MiB fall in one cell of this width count as storing the same: only the
#: cheapest is kept (docs/tuning.md#stored_resolution_mib).
STORED_RESOLUTION_MIB = 1 / 1024


def pruned(stored: np.ndarray, cost: np.ndarray, *rest: np.ndarray,
           resolution_mib: float = STORED_RESOLUTION_MIB) -> tuple[np.ndarray, ...]:
    """The labels no other beats on both stored MiB and cost, by stored MiB (``rest``: arrays
    that go with them); of labels in one ``resolution_mib`` cell of stored MiB, only the
    cheapest."""
    # Sorted by (stored, cost, position), each label kept if cheaper than all before it. The
    # labels arrive as a few runs already sorted by stored MiB, which a stable sort on that key
    # alone merges faster than a two-key sort (docs/tuning.md#pruned); of equal stored MiB only
    # the first cheapest can be kept, so it stands for its run.
    order = np.argsort(stored, kind="stable")
    if len(order) > 1:
        by_stored, by_cost = stored[order], cost[order]
        starts = np.flatnonzero(np.concatenate(([True], by_stored[1:] != by_stored[:-1])))
        if len(starts) < len(order):
            run_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(order))))
            at_min = np.flatnonzero(by_cost == np.minimum.reduceat(by_cost, starts)[run_of])
            order = order[at_min[np.concatenate(([True], run_of[at_min][1:] != run_of[at_min][:-1]))]]
            by_cost = cost[order]
        cheaper = np.ones(len(order), dtype=bool)
        cheaper[1:] = by_cost[1:] < np.minimum.accumulate(by_cost)[:-1] - 1e-12
        order = order[cheaper]
        if resolution_mib > 0 and len(order) > 1:
            # by stored MiB the costs fall: the cheapest of a cell is its last label
            cell = np.floor(stored[order] / resolution_mib)
            last = np.ones(len(order), dtype=bool)
            last[:-1] = cell[1:] != cell[:-1]
            order = order[last]
    return (stored[order], cost[order], *(a[order] for a in rest))


class LabelWindow:
    """The stored MiB and cost of the labels of the last stages, by label id: what deferred
    arrivals are built from. Labels are appended in id order, a stage's before the next
    stage's arrivals are built; a stage's labels are dropped once no segment from it ends later.

    Example:
        >>> window = LabelWindow(last_target=[2, 2])   # stage 0's labels arrive up to stage 2
        >>> window.append(0, 0, np.array([1.0, 2.0]), np.array([4.0, 3.0]))
        >>> window.append(1, 2, np.array([5.0]), np.array([0.5]))
        >>> [a.tolist() for a in window.gather(np.array([2, 1]), stage=2)]
        [[5.0, 2.0], [0.5, 3.0]]
    """

    __slots__ = ("_last_target", "_parts", "_base", "_stored", "_cost")

    def __init__(self, last_target: list[int]) -> None:
        #: per stage, the last stage its labels arrive at
        self._last_target = last_target
        self._parts: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self._base = 0
        self._stored: np.ndarray | None = None
        self._cost: np.ndarray | None = None

    def append(self, stage: int, first_id: int, stored: np.ndarray, cost: np.ndarray) -> None:
        """The labels ``first_id`` onwards, of a (``stage``, held groups)."""
        self._parts.append((stage, first_id, stored, cost))
        self._stored = self._cost = None

    def gather(self, ids: np.ndarray, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored MiB and cost of the labels ``ids``, for arrivals at ``stage``."""
        if self._stored is None:
            first = 0  # the parts no arrival at this stage or later reads
            while first < len(self._parts) and self._last_target[self._parts[first][0]] < stage:
                first += 1
            del self._parts[:first]
            self._base = self._parts[0][1] if self._parts else 0
            self._stored = np.concatenate([part[2] for part in self._parts]) if self._parts else np.zeros(0)
            self._cost = np.concatenate([part[3] for part in self._parts]) if self._parts else np.zeros(0)
        assert self._cost is not None
        assert not len(ids) or int(ids.min()) >= self._base, "a label the window dropped"
        return self._stored[ids - self._base], self._cost[ids - self._base]


class Inbox:
    """The labels that reached one (stage, held groups): a pruned front and the chunks since.

    A chunk's label is dropped on arrival when a label of the front stores no more and costs
    no more (the front's labels arrived first, so :func:`pruned` over everything would drop it
    too). The chunks are pruned into the front once they hold :data:`MERGE_AT_LABELS` labels
    and as many as the front."""

    __slots__ = ("_front", "_bounds", "_chunks", "_pending", "_window", "_deferred")

    def __init__(self, window: LabelWindow | None = None) -> None:
        self._front: tuple[np.ndarray, ...] | None = None
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, int | np.ndarray, np.ndarray | None]] = []
        self._pending = 0
        self._window = window
        #: deferred arrivals: first label id, count, added MiB, added cost, segment code
        self._deferred: tuple[list[int], list[int], list[float], list[float], list[int]] = ([], [], [], [], [])

    def defer(self, first_id: int, count: int, added_mib: float, added_ms: float, segment: int) -> None:
        """The labels ``first_id`` to ``first_id + count - 1`` of the window, each with
        ``added_mib`` more stored and ``added_ms`` more cost, reached by the segment coded
        ``segment`` (-1: none): :meth:`add` of them, built when the front is asked for."""
        for values, value in zip(self._deferred, (first_id, count, added_mib, added_ms, segment)):
            values.append(value)

    def _add_deferred(self, stage: int) -> None:
        first_ids, counts, added_mib, added_ms, segments = (np.array(values) for values in self._deferred)
        self._deferred = ([], [], [], [], [])
        assert self._window is not None, "deferred labels need the window they come from"
        total = int(counts.sum())
        ids = np.arange(total, dtype=np.int64) + np.repeat(first_ids - (np.cumsum(counts) - counts), counts)
        stored, cost = self._window.gather(ids, stage)
        stored = stored + np.repeat(added_mib, counts)
        cost = cost + np.repeat(added_ms, counts)
        segment = np.repeat(segments.astype(np.int64), counts)
        # in growing slices, so that most are checked against a front before they are sorted
        start, size = 0, MERGE_AT_LABELS
        while start < total:
            end = min(total, start + size)
            self.add(stored[start:end], cost[start:end], ids[start:end], segment[start:end])
            start, size = end, 2 * size

    def add(self, stored: np.ndarray, cost: np.ndarray, parent: np.ndarray, segment: int | np.ndarray,
            keeps: np.ndarray | None = None) -> None:
        """Labels reached by the segment coded ``segment`` (-1: none; or one code a label) from
        labels ``parent``, with the keep codes ``keeps`` (None: keeps nothing)."""
        if self._bounds is not None:
            bound_stored, bound_cost = self._bounds  # the front after a label that beats nothing
            beaten = bound_cost[np.searchsorted(bound_stored, stored, side="right") - 1] <= cost
            count = int(np.count_nonzero(beaten))
            if count == len(beaten):
                return
            if count:
                fresh = ~beaten
                stored, cost, parent = stored[fresh], cost[fresh], parent[fresh]
                keeps = None if keeps is None else keeps[fresh]
                if isinstance(segment, np.ndarray):
                    segment = segment[fresh]
        self._chunks.append((stored, cost, parent, segment, keeps))
        self._pending += len(stored)
        front_size = 0 if self._front is None else len(self._front[0])
        if self._pending >= max(MERGE_AT_LABELS, front_size):
            self._front = self._merged()
            self._bounds = (np.concatenate(([-np.inf], self._front[0])), np.concatenate(([np.inf], self._front[1])))

    def _merged(self) -> tuple[np.ndarray, ...]:
        chunks = self._chunks
        lengths = [len(chunk[0]) for chunk in chunks]
        # one array per field for all chunks: the per-chunk segment codes and keep codes are
        # spread with one repeat, not built chunk by chunk
        stored = [chunk[0] for chunk in chunks]
        cost = [chunk[1] for chunk in chunks]
        parent = [chunk[2] for chunk in chunks]
        if any(isinstance(chunk[3], np.ndarray) for chunk in chunks):
            segment = [chunk[3] if isinstance(chunk[3], np.ndarray) else np.full(n, chunk[3], dtype=np.int64)
                       for chunk, n in zip(chunks, lengths)]
        else:
            segment = [np.repeat(np.array([chunk[3] for chunk in chunks], dtype=np.int64), lengths)]
        if any(chunk[4] is not None for chunk in chunks):
            keeps = [np.zeros(n, dtype=np.int64) if chunk[4] is None else chunk[4] for chunk, n in zip(chunks, lengths)]
        else:
            keeps = [np.zeros(sum(lengths), dtype=np.int64)]
        parts = [stored, cost, parent, segment, keeps]
        if self._front is not None:
            parts = [[old, *new] for old, new in zip(self._front, parts)]
        self._chunks, self._pending = [], 0
        return pruned(*(np.concatenate(p) for p in parts))

    def front(self, selective: bool, stage: int = 0) -> tuple[np.ndarray, ...]:
        """Every label no other beats: stored MiB, cost, parent, segment code, keep codes
        (zeros unless ``selective``), by stored MiB. ``stage``: the inbox's, for its deferred
        labels."""
        if self._deferred[0]:
            self._add_deferred(stage)
        if self._chunks or self._front is None:
            self._front = self._merged()
        return self._front
