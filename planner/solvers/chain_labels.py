"""The labels arriving at one (stage, held groups) of the chain DP, pruned as they come.

Each label of the chain DP (:mod:`planner.solvers.chain_dp`) is a partial plan's stored MiB and
cost; of the labels reaching one (stage, held groups) only those no other beats on both are
kept (:func:`pruned`). They arrive in chunks, one per label block and segment, each sorted by
stored MiB. On deep models nearly all of them are beaten (docs/tuning.md#merge_at_labels):
:class:`Inbox` keeps the front of what arrived so far and drops each new label that front
already beats before it is copied and sorted.

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

__all__ = ["Inbox", "pruned", "MERGE_AT_LABELS"]

#: Labels an inbox gathers before it first prunes them into a front that later chunks are
#: checked against: fewer costs a sort per few chunks, more lets more beaten labels through.
MERGE_AT_LABELS = 4096


def pruned(stored: np.ndarray, cost: np.ndarray, *rest: np.ndarray) -> tuple[np.ndarray, ...]:
    """The labels no other beats on both stored MiB and cost, by stored MiB (``rest``: arrays
    that go with them)."""
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
    return (stored[order], cost[order], *(a[order] for a in rest))


class Inbox:
    """The labels that reached one (stage, held groups): a pruned front and the chunks since.

    A chunk's label is dropped on arrival when a label of the front stores no more and costs
    no more (the front's labels arrived first, so :func:`pruned` over everything would drop it
    too). The chunks are pruned into the front once they hold :data:`MERGE_AT_LABELS` labels
    and as many as the front."""

    __slots__ = ("_front", "_bounds", "_chunks", "_pending")

    def __init__(self) -> None:
        self._front: tuple[np.ndarray, ...] | None = None
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]] = []
        self._pending = 0

    def add(self, stored: np.ndarray, cost: np.ndarray, parent: np.ndarray, segment: int,
            keeps: np.ndarray | None = None) -> None:
        """Labels reached by the segment coded ``segment`` (-1: none) from labels ``parent``,
        with the keep codes ``keeps`` (None: keeps nothing)."""
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
        self._chunks.append((stored, cost, parent, segment, keeps))
        self._pending += len(stored)
        front_size = 0 if self._front is None else len(self._front[0])
        if self._pending >= max(MERGE_AT_LABELS, front_size):
            self._front = self._merged()
            self._bounds = (np.concatenate(([-np.inf], self._front[0])), np.concatenate(([np.inf], self._front[1])))

    def _merged(self) -> tuple[np.ndarray, ...]:
        parts = list(zip(*((st, co, pa, np.full(len(st), seg, dtype=np.int64),
                            np.zeros(len(st), dtype=np.int64) if kc is None else kc)
                           for st, co, pa, seg, kc in self._chunks)))
        if self._front is not None:
            parts = [(old, *new) for old, new in zip(self._front, parts)]
        self._chunks, self._pending = [], 0
        return pruned(*(np.concatenate(p) for p in parts))

    def front(self, selective: bool) -> tuple[np.ndarray, ...]:
        """Every label no other beats: stored MiB, cost, parent, segment code, keep codes
        (zeros unless ``selective``), by stored MiB."""
        if self._chunks or self._front is None:
            self._front = self._merged()
        return self._front
