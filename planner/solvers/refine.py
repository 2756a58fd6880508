"""Improve a plan with the simulator as judge: local moves over segment boundaries.

The ILP decides on whole stages with a linear memory account; the simulator is exact on the
profile. Two searches start from the ILP's segments and move segment boundaries between cut
points (stage boundaries of a finer reduction, :func:`planner.core.stages.build_stages`; every
node on small graphs):

- :func:`lower_peak` applies the move that lowers the simulated peak most (add, grow, merge,
  split, shrink or drop a segment) until none does: the smallest feasible budget it reaches is
  what :class:`planner.core.errors.InfeasibleBudgetError` reports.
- :func:`refine_segments` applies the move that saves the most recompute time while the peak
  stays within the budget (dropping, shrinking, cutting a run out of, or splitting a
  segment; a split saves nothing but often lowers the peak enough for the next saving move).

Both return the best plan seen, so the result is never worse than the input. Selective
segments are kept as they are.

The effort is counted in replays, not seconds, so a search gives the same plan on any machine:
``time_limit_s`` buys ``time_limit_s * NODE_REPLAYS_PER_S / len(graph.nodes)`` replays (about
``time_limit_s`` on a 2-core CPU), and a wall-clock guard at twice ``time_limit_s`` stops a
search on a much slower machine (logged; only then can the result differ between runs). This is
what lets the smallest feasible budget an :class:`~planner.core.errors.InfeasibleBudgetError` names
be planned when it is passed back.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=float(i)))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> everything = [Segment(tuple(f"n{i}" for i in range(1, 9)), 36.0, 0)]
    >>> better = refine_segments(g, everything, budget_bytes=12 * 2**20)
    >>> sum(s.recompute_ms for s in better) < 36.0
    True
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from itertools import accumulate

from planner.core.costgraph import CostGraph
from planner.core.plan import Segment
from planner.core.rerun import ChainCosts, skipped_node_names
from planner.core.simulate import simulate
from planner.core.stages import build_stages
from planner.core.units import MIB

__all__ = ["NODE_REPLAYS_PER_S", "lower_peak", "refine_segments", "replay_budget"]

log = logging.getLogger(__name__)

Run = tuple[int, int]  # first and last compute rank, inclusive
#: below this many compute nodes every node boundary is a cut point
ALL_CUTS_BELOW = 64
#: simulated nodes per second of search a ``time_limit_s`` stands for: an effort, not a clock, so
#: every machine makes the same replays (docs/tuning.md#node_replays_per_s)
NODE_REPLAYS_PER_S = 100_000
#: the wall-clock guard, as a multiple of ``time_limit_s``
GUARD_FACTOR = 2.0


def replay_budget(graph: CostGraph, time_limit_s: float) -> int:
    """The replays a search of ``graph`` may make for ``time_limit_s`` (at least one).

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 8, True),))
        >>> replay_budget(g, 1.0)
        100000
    """
    return max(1, int(time_limit_s * NODE_REPLAYS_PER_S / max(1, len(graph.nodes))))


class _Chain:
    """Compute nodes by rank: the recompute cost of any run, non-recomputable nodes, cut points."""

    def __init__(self, graph: CostGraph, cut_stages: int, blocked: frozenset[str] = frozenset()) -> None:
        computes = [n for n in graph.nodes if n.kind == "compute"]
        self.graph = graph
        self.names = [n.name for n in computes]
        self.rank = {name: r for r, name in enumerate(self.names)}
        self.costs = ChainCosts(graph, self.names)
        # nodes no run may include: not recomputable, or in a segment the search keeps as it is
        self.fixed_prefix = [0, *accumulate(0 if n.recomputable and n.name not in blocked else 1 for n in computes)]
        if len(computes) < ALL_CUTS_BELOW:
            cuts = set(range(len(computes) + 1))
        else:
            cuts = {self.rank[s.node_names[0]] for s in build_stages(graph, cut_stages)} | {len(computes)}
        # a cut c: a run may start at c, or end at c - 1
        self.cuts = sorted(cuts | {0})

    def time_ms(self, run: Run) -> float:
        return self.costs.time_ms(*run)

    def recomputable(self, run: Run) -> bool:
        return run[0] <= run[1] and self.fixed_prefix[run[1] + 1] == self.fixed_prefix[run[0]]

    def segment(self, run: Run) -> Segment:
        a, b = run
        names = tuple(self.names[a : b + 1])
        return Segment(names, self.time_ms(run), self.costs.flops(a, b), (), skipped_node_names(self.graph, names))

    def cuts_between(self, low: int, high: int) -> list[int]:
        """Cut points c with low < c <= high."""
        return [c for c in self.cuts if low < c <= high]


def _shrinking_moves(chain: _Chain, runs: list[Run]) -> Iterator[tuple[float, list[Run]]]:
    """(recompute time saved, new runs) for moves that recompute less or split a segment (a
    split saves what the first part's recompute now stops short of)."""
    for k, (a, b) in enumerate(runs):
        rest = runs[:k] + runs[k + 1 :]
        whole = chain.time_ms((a, b))
        yield whole, rest
        inner = chain.cuts_between(a, b)
        for c in inner:
            yield whole - chain.time_ms((c, b)), rest + [(c, b)]
            yield whole - chain.time_ms((a, c - 1)), rest + [(a, c - 1)]
            yield whole - chain.time_ms((a, c - 1)) - chain.time_ms((c, b)), rest + [(a, c - 1), (c, b)]
        for i, c in enumerate(inner):
            for d in inner[i + 1 :]:
                yield whole - chain.time_ms((a, c - 1)) - chain.time_ms((d, b)), rest + [(a, c - 1), (d, b)]


def _swapping_moves(chain: _Chain, runs: list[Run], max_span: int = 8) -> Iterator[tuple[float, list[Run]]]:
    """(time saved, new runs): one segment replaced by a cheaper one somewhere else."""
    for k, (a, b) in enumerate(runs):
        rest = runs[:k] + runs[k + 1 :]
        whole = chain.time_ms((a, b))
        for new in _free_runs(chain, rest, max_span):
            saved = whole - chain.time_ms(new)
            if saved > 1e-9 and new != (a, b):
                yield saved, rest + [new]


def _free_runs(chain: _Chain, runs: list[Run], max_span: int) -> Iterator[Run]:
    """Runs between two cut points, up to ``max_span`` cut intervals long, overlapping none of ``runs``."""
    taken = [False] * len(chain.names)
    for a, b in runs:
        for r in range(a, b + 1):
            taken[r] = True
    cuts = chain.cuts
    for i, c in enumerate(cuts):
        for d in cuts[i + 1 : i + 1 + max_span]:
            if any(taken[c:d]) or not chain.recomputable((c, d - 1)):
                break
            yield (c, d - 1)


def _growing_moves(chain: _Chain, runs: list[Run], max_span: int = 8) -> Iterator[list[Run]]:
    """New runs that recompute more: a new segment between two cut points (up to ``max_span``
    cut intervals long) where nothing is recomputed yet, a segment grown to any cut on either
    side up to its neighbours, two neighbours merged."""
    ordered = sorted(runs)
    cuts = chain.cuts
    for new in _free_runs(chain, ordered, max_span):
        yield ordered + [new]
    for k, (a, b) in enumerate(ordered):
        rest = ordered[:k] + ordered[k + 1 :]
        left_limit = ordered[k - 1][1] + 1 if k else 0
        right_limit = ordered[k + 1][0] if k + 1 < len(ordered) else len(chain.names)
        for c in reversed([c for c in cuts if left_limit <= c < a]):
            if not chain.recomputable((c, b)):
                break
            yield rest + [(c, b)]
        for c in [c for c in cuts if b + 1 < c <= right_limit]:
            if not chain.recomputable((a, c - 1)):
                break
            yield rest + [(a, c - 1)]
        if k + 1 < len(ordered) and chain.recomputable((a, ordered[k + 1][1])):
            yield ordered[:k] + ordered[k + 2 :] + [(a, ordered[k + 1][1])]


class _Search:
    """The runs being improved, the fixed selective segments, and the replay."""

    def __init__(self, graph: CostGraph, segments: Sequence[Segment], cut_stages: int, time_limit_s: float) -> None:
        self.graph = graph
        self.fixed = [s for s in segments if s.selective]
        self.chain = _Chain(graph, cut_stages, frozenset(n for s in self.fixed for n in s.node_names))
        rank = self.chain.rank
        self.runs = sorted((rank[s.node_names[0]], rank[s.node_names[-1]]) for s in segments if not s.selective)
        self.max_replays = replay_budget(graph, time_limit_s)
        self.deadline = time.perf_counter() + GUARD_FACTOR * time_limit_s
        self.replays = 0
        self.guard_hit = False

    def out_of_time(self) -> bool:
        if self.replays >= self.max_replays:
            return True
        if time.perf_counter() > self.deadline:
            if not self.guard_hit:
                log.info("search stopped by its wall-clock guard after %d of %d replays: on this machine "
                         "the plan may differ between runs", self.replays, self.max_replays)
            self.guard_hit = True
            return True
        return False

    def cost(self, runs: list[Run]) -> float:
        return sum(self.chain.time_ms(r) for r in runs)

    def replay(self, runs: list[Run]) -> tuple[int, int]:
        """(peak, timeline points within 0.5 % of it): the second tells a move that lowers one
        of several equal highs from one that changes nothing."""
        self.replays += 1
        result = simulate(self.graph, [*self.fixed, *(self.chain.segment(r) for r in runs)])
        near = sum(1 for _, _, live in result.timeline if live >= result.peak_bytes * 0.995)
        return result.peak_bytes, near

    def segments(self, runs: list[Run]) -> list[Segment]:
        rank = self.chain.rank
        chosen = [*self.fixed, *(self.chain.segment(r) for r in runs)]
        return sorted(chosen, key=lambda s: rank[s.node_names[0]])


def lower_peak(
    graph: CostGraph, segments: Sequence[Segment], *, time_limit_s: float = 5.0, cut_stages: int = 128
) -> list[Segment]:
    """Segments with a simulated peak at most that of ``segments``, lowered by local moves.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode, Storage
        >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
        >>> for i in range(1, 7):
        ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
        ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
        ...                           requires_grad=True, time_ms=1.0))
        >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(7)), ("n6",))
        >>> simulate(g, lower_peak(g, [])).peak_bytes < simulate(g).peak_bytes
        True
    """
    search = _Search(graph, segments, cut_stages, time_limit_s)
    runs = search.runs
    current = search.replay(runs)
    current_cost = search.cost(runs)
    while not search.out_of_time():
        best: tuple[tuple[int, int], float, list[Run]] | None = None
        candidates = [*_growing_moves(search.chain, runs), *(m for _, m in _shrinking_moves(search.chain, runs))]
        for candidate in candidates:
            if search.out_of_time():
                break
            outcome = search.replay(candidate)
            cost = search.cost(candidate)
            if (outcome, cost) < (current, current_cost) and (best is None or (outcome, cost) < (best[0], best[1])):
                best = (outcome, cost, candidate)
        if best is None:
            break
        current, current_cost, runs = best[0], best[1], sorted(best[2])
    log.info("lowered the peak to %.1f MiB with %d replays", current[0] / MIB, search.replays)
    return search.segments(runs)


def refine_segments(
    graph: CostGraph,
    segments: Sequence[Segment],
    budget_bytes: int,
    *,
    time_limit_s: float = 5.0,
    cut_stages: int = 128,
) -> list[Segment]:
    """Cheaper segments with a simulated peak still within ``budget_bytes`` (``segments`` when
    they do not fit it or nothing cheaper is found). Stops when no move helps or after
    ``time_limit_s``."""
    search = _Search(graph, segments, cut_stages, time_limit_s)
    runs = search.runs
    current = search.replay(runs)
    if current[0] > budget_bytes:
        return list(segments)
    cost = search.cost(runs)
    start_cost = cost
    best_runs, best_cost = runs, cost
    splits_in_a_row, max_splits = 0, len(runs) + 4
    while not search.out_of_time():
        moves = [*_shrinking_moves(search.chain, runs), *_swapping_moves(search.chain, runs)]
        applied = False
        for saved_ms, candidate in sorted((m for m in moves if m[0] > 1e-9), key=lambda m: -m[0]):
            if search.out_of_time():
                break
            outcome = search.replay(candidate)
            if outcome[0] <= budget_bytes:
                cost -= saved_ms
                runs, current, applied, splits_in_a_row = sorted(candidate), outcome, True, 0
                break
        if not applied and splits_in_a_row < max_splits:
            best_split: tuple[tuple[int, int], list[Run]] | None = None
            for _, candidate in (m for m in moves if m[0] <= 1e-9):
                if search.out_of_time():
                    break
                outcome = search.replay(candidate)
                if outcome < current and (best_split is None or outcome < best_split[0]):
                    best_split = (outcome, candidate)
            if best_split is not None:
                current, runs = best_split
                runs = sorted(runs)
                splits_in_a_row += 1
                applied = True
        if not applied:
            break
        if cost < best_cost - 1e-9:
            best_runs, best_cost = runs, cost
    log.info("refined with %d replays: recompute %.2f ms -> %.2f ms", search.replays, start_cost, best_cost)
    return search.segments(best_runs)
