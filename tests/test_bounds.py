"""The covering bound of :mod:`planner.bounds.covering` never exceeds the cost of a plan that fits, kept
outputs included (brute force over every plan of small random graphs, at budgets equal to the
plans' own peaks, where a bound that claims too much shows first), proves infeasible only what
no plan fits, and counts what the previous knapsack bound missed: the transients a rerun node
needs, and the storages a node's backward reads (standard library and PuLP only: no torch)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from graphs import MIB, every_plan, random_dag
from planner.bounds.covering import covering_bound, least_rerun_cost, recompute_lower_bound_ms
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.errors import InputError
from planner.core.simulate import simulate


@pytest.mark.parametrize("objective", ["time", "flops"])
def test_never_above_the_cheapest_plan_that_fits_and_infeasible_only_where_none_does(objective):
    column = 1 if objective == "time" else 2
    checked = positive = tight = infeasible = 0
    for seed in range(24):
        g = random_dag(seed, 5 + seed % 3)
        if seed % 2:
            g = dataclasses.replace(g, selective_overhead_ms_per_node=0.05)
        plans = every_plan(g)
        unoptimized = simulate(g).peak_bytes
        peaks = sorted({peak for peak, _, _ in plans if peak < unoptimized})
        min_peak = min(peak for peak, _, _ in plans)
        for budget in [*peaks, min_peak - 1]:
            bound = covering_bound(g, budget, objective=objective).value
            fitting = [plan[column] for plan in plans if plan[0] <= budget]
            if not fitting:
                infeasible += math.isinf(bound)
                continue
            best = min(fitting)
            assert bound <= best + 1e-6 * max(1.0, best), (seed, budget, bound, best)
            checked += 1
            positive += bound > 0
            tight += bound >= best - 1e-6 * max(1.0, best)
    assert checked > 60 and positive > checked // 2, (checked, positive)
    assert tight > checked // 4, f"the bound meets the optimum on only {tight} of {checked} budgets"
    assert infeasible > 5, "the bound proves some budgets below every plan's peak infeasible"


def _gelu_like() -> CostGraph:
    """x -> lin (slow, saves only its input) -> a -> b (large transients nothing saves) -> t
    (cheap, saves its own large output) -> s -> out (a large temporary at its forward, the
    peak). Freeing t's output at out's forward means rerunning t, and so remaking b: rerunning
    b and a (lin's small output held for them), or lin too, or holding b or a instead (as large
    as what t frees)."""
    sizes = {0: MIB, 1: MIB, 2: 8 * MIB, 3: 8 * MIB, 4: 8 * MIB, 5: MIB, 6: MIB}
    storages = [Storage(k, size, persistent=k == 0) for k, size in sizes.items()]
    spec = [("lin", "x", 1, (0,), 20.0, 0), ("a", "lin", 2, (), 2.0, 0), ("b", "a", 3, (), 2.0, 0),
            ("t", "b", 4, (4,), 1.0, 0), ("s", "t", 5, (), 0.5, 0), ("out", "s", 6, (), 0.5, 24 * MIB)]
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for name, parent, key, saved, ms, forward_peak in spec:
        nodes.append(CostNode(name, "op", input_names=(parent,), output_storages=(key,), saved_storages=saved,
                              output_bytes=sizes[key], requires_grad=True, time_ms=ms,
                              forward_peak_bytes=forward_peak))
    return CostGraph(tuple(nodes), tuple(storages), output_names=("out",))


def test_a_rerun_node_pays_for_the_transients_it_reads():
    """7 MiB to free at out's forward: only t's 8 MiB output can go, for t (1 ms) plus b and a
    (2 ms each) with lin's 1 MiB output held. The bound is that 5 ms, as brute force finds,
    where a bound that charged the maker alone would say 1 ms; 1 MiB more to free and lin must
    rerun too (25 ms)."""
    g = _gelu_like()
    assert simulate(g).peak_bytes == 34 * MIB
    plans = every_plan(g)
    assert least_rerun_cost(g, g.node("t")) == 1.0
    for budget_mib, expected_ms in ((27, 5.0), (26, 25.0)):
        best = min(ms for peak, ms, _ in plans if peak <= budget_mib * MIB)
        assert best == pytest.approx(expected_ms)
        assert recompute_lower_bound_ms(g, budget_mib * MIB) == pytest.approx(best)


def test_a_budget_the_backward_cannot_meet_is_infeasible():
    """At n2's backward it reads its own saved output, so only n1's can go: a budget that needs
    more freed there has no plan, and the bound says so (brute force agrees)."""
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for i, ms in enumerate([4.0, 1.0, 2.0], start=1):
        nodes.append(CostNode(f"n{i}", "op", input_names=(nodes[-1].name,), output_storages=(i,),
                              saved_storages=(i,), output_bytes=100, requires_grad=True, time_ms=ms))
    g = CostGraph(tuple(nodes), (Storage(0, 100, True), *(Storage(i, 100) for i in (1, 2, 3))), ("n3",))
    plans = every_plan(g)
    assert min(peak for peak, _, _ in plans) == 500
    assert recompute_lower_bound_ms(g, 500) == min(ms for peak, ms, _ in plans if peak <= 500) == 4.0
    assert math.isinf(recompute_lower_bound_ms(g, 450))


def test_cbc_gives_the_lp_relaxation_below_highs():
    g = random_dag(3, 7)
    budget = int(simulate(g).peak_bytes * 0.8)
    highs, cbc = covering_bound(g, budget), covering_bound(g, budget, solver="CBC")
    assert "LP relaxation" in cbc.method
    assert cbc.value <= highs.value + 1e-6


@pytest.mark.parametrize("kwargs, message", [
    ({"objective": "bytes"}, "objective must be one of"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive int"),
    ({"time_limit_s": 0}, "time_limit_s must be positive"),
])
def test_bad_arguments_say_what_to_pass(kwargs, message):
    args = {"budget_bytes": 10**6, **kwargs}
    with pytest.raises(InputError, match=message):
        covering_bound(random_dag(0, 4), args.pop("budget_bytes"), **args)


@pytest.mark.parametrize("objective", ["time", "flops"])
def test_segments_only_never_above_the_cheapest_plan_of_whole_segments(objective):
    """``kept_outputs=False`` holds every transient a recomputed node reads from outside its
    segment through the backward: never above the cheapest plan of whole segments (brute
    force), never below the bound over every plan, and strictly above it on some budgets."""
    column = 1 if objective == "time" else 2
    checked = tighter = 0
    for seed in range(24):
        g = random_dag(seed, 5 + seed % 3)
        plans = every_plan(g, kept_outputs=False)
        unoptimized = simulate(g).peak_bytes
        for budget in sorted({peak for peak, _, _ in plans if peak < unoptimized}):
            bound = covering_bound(g, budget, objective=objective, kept_outputs=False).value
            best = min(plan[column] for plan in plans if plan[0] <= budget)
            assert bound <= best + 1e-6 * max(1.0, best), (seed, budget, bound, best)
            general = covering_bound(g, budget, objective=objective).value
            assert bound >= general - 1e-6 * max(1.0, general), (seed, budget, bound, general)
            checked += 1
            tighter += bound > general + 1e-6 * max(1.0, general)
    assert checked > 40 and tighter > 0, (checked, tighter)


def _residual(lin_keepable: bool) -> CostGraph:
    """x -> lin (slow, saves only its input) -> o (nothing saves it) -> add (x + o, cheap,
    saves nothing) -> h (saved by norm) -> norm -> u (saved by head) -> head, whose backward
    has a 4 MiB temporary: the peak. Like a residual add after a transformer's output
    projection."""
    sizes = {0: MIB, 1: 4 * MIB, 2: 4 * MIB, 3: MIB, 4: MIB}
    spec = [("lin", ("x",), 1, (0,), 10.0, 0), ("add", ("lin", "x"), 2, (), 0.1, 0),
            ("norm", ("add",), 3, (2,), 0.1, 0), ("head", ("norm",), 4, (3,), 1.0, 4 * MIB)]
    return _graph_of(sizes, spec, "lin" if lin_keepable else None)


def _graph_of(sizes: dict[int, int], spec: list[tuple], keepable: str | None) -> CostGraph:
    """A graph from input ``x`` (storage 0) and ``(name, inputs, output storage, saved
    storages, ms, backward peak)`` per node, the last node its output; ``keepable`` may be kept
    by a selective policy."""
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for name, inputs, key, saved, ms, backward_peak in spec:
        nodes.append(CostNode(name, "op", input_names=inputs, output_storages=(key,), saved_storages=saved,
                              output_bytes=sizes[key], requires_grad=True, time_ms=ms,
                              backward_peak_bytes=backward_peak, selective_save=name == keepable))
    return CostGraph(tuple(nodes), tuple(Storage(k, size, k == 0) for k, size in sizes.items()), (spec[-1][0],))


def test_a_segment_holds_the_transients_it_reads_through_the_backward():
    """1 MiB to free at head's backward. Rerunning add alone frees h (4 MiB) for 0.1 ms, but
    its segment then holds lin's output o (4 MiB) as an input until its backward, so nothing
    is gained there: every plan that fits reruns lin too (10.1 ms, brute force). The bound
    finds those 10.1 ms. Where lin may be kept by a selective policy, keeping it would release
    o at its segment's recompute, which the covering bound cannot place: it falls back to the
    0.1 ms that ignores the hold, though no kept plan does better either."""
    budget = 11 * MIB
    for keepable in (False, True):
        g = _residual(keepable)
        assert simulate(g).peak_bytes == 12 * MIB
        best = min(ms for peak, ms, _ in every_plan(g) if peak <= budget)
        assert best == pytest.approx(10.1)
        assert covering_bound(g, budget, kept_outputs=False).value == pytest.approx(best)
        general = covering_bound(g, budget).value
        assert general == pytest.approx(0.1 if keepable else best)


@pytest.mark.parametrize("policy_ms, expected_ms", [(0.0, 0.1), (1.0, 4.1), (5.0, 10.1)])
def test_a_kept_maker_releases_its_transient_only_at_the_policys_price(policy_ms, expected_ms):
    """In the residual graph with lin keepable, keeping lin releases o in the backward only at
    the recompute of a segment that reaches head (the moment's recompute), so the selective
    policy runs on all four nodes: 0.1 ms for add plus 4 nodes at the policy's cost, or rerun
    lin (10.1 ms). Every plan that fits needs 10.1 ms (brute force, the policy priced)."""
    g = dataclasses.replace(_residual(True), selective_overhead_ms_per_node=policy_ms)
    best = min(ms for peak, ms, _ in every_plan(g) if peak <= 11 * MIB)
    assert best == pytest.approx(10.1)
    assert covering_bound(g, 11 * MIB).value == pytest.approx(expected_ms)


def _saved_by_a_slow_node(keepable: bool) -> CostGraph:
    """x -> a (cheap, 4 MiB output) -> s (slow; saves a's output and its own) -> head (saves
    s's output; an 8 MiB temporary in its backward: the peak). Like a projection read by an
    attention kernel that saves its inputs."""
    sizes = {0: MIB, 1: 4 * MIB, 2: MIB, 3: MIB}
    spec = [("a", ("x",), 1, (), 0.1, 0), ("s", ("a",), 2, (1, 2), 10.0, 0), ("head", ("s",), 3, (2,), 1.0, 8 * MIB)]
    return _graph_of(sizes, spec, "s" if keepable else None)


def test_a_node_outside_every_segment_holds_what_it_saved():
    """4 MiB to free at head's backward. Rerunning a alone would free its 4 MiB output for
    0.1 ms, but s saved it and, outside every segment, holds it until its own backward: every
    plan that fits reruns s too (10.1 ms, brute force), and both bounds find that. Where a
    selective policy may keep s, its saves go to the checkpoint: keeping s and rerunning a
    frees the output for 0.1 ms, and the bound over every plan allows it."""
    budget = 12 * MIB
    strict = _saved_by_a_slow_node(keepable=False)
    assert simulate(strict).peak_bytes > budget
    best = min(ms for peak, ms, _ in every_plan(strict) if peak <= budget)
    assert best == pytest.approx(10.1)
    assert covering_bound(strict, budget).value == pytest.approx(best)
    assert covering_bound(strict, budget, kept_outputs=False).value == pytest.approx(best)
    keepable = _saved_by_a_slow_node(keepable=True)
    assert covering_bound(keepable, budget).value == pytest.approx(0.1)
    assert covering_bound(keepable, budget, kept_outputs=False).value == pytest.approx(best)
