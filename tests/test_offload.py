"""Offload to host memory: the replay with copies against hand-computed steps and against plain
replays that bound it, and the offload start against its base plan (standard library only)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from graphs import MIB, chain, random_dag
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.errors import InfeasibleBudgetError
from planner.core.offload import HOST_LINKS, OffloadSpec, offloadable_nodes, simulate_offload
from planner.core.plan import Plan, Segment
from planner.core.rerun import rerun_cost
from planner.core.simulate import simulate
from planner.solvers.offload import fit_with_offload, offload_plan

KB_PER_MS = 1e-3  # GB/s: 1,000 bytes a millisecond


def _relu_chain(names: str, size_bytes: int = 1000, step_ms: float = 0.0) -> CostGraph:
    """x -> a -> b ... each node 1 ms, saving its own output of ``size_bytes``; the last is returned."""
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(1,))]
    prev = "x"
    for k, name in enumerate(names, start=2):
        nodes.append(CostNode(name, "relu", input_names=(prev,), output_storages=(k,), saved_storages=(k,),
                              output_bytes=size_bytes, requires_grad=True, time_ms=1.0))
        prev = name
    storages = tuple(Storage(k, size_bytes, k == 1) for k in range(1, len(names) + 2))
    return CostGraph(tuple(nodes), storages, output_names=(prev,), step_ms=step_ms)


def test_a_fetch_that_cannot_land_in_time_is_waited_for_by_the_compute():
    # forward 2 ms, step 4 ms: each backward node takes 1 ms. a's copy out takes 1 ms (lands when
    # b is done, at 2 ms); its copy back 4 ms, issued when the backward starts (2 ms): back at
    # 6 ms, where a's backward would start at 3 ms
    g = _relu_chain("ab", step_ms=4.0)
    result = simulate_offload(g, (), ("a",), OffloadSpec(h2d_gbps=KB_PER_MS / 4, d2h_gbps=KB_PER_MS))
    assert result.exposed_ms == pytest.approx(3.0)
    assert result.triggers == ("b",)
    fast = simulate_offload(g, (), ("a",), OffloadSpec(h2d_gbps=KB_PER_MS, d2h_gbps=KB_PER_MS))
    assert fast.exposed_ms == 0.0


def test_the_peak_follows_the_copies_a_lagging_copy_out_keeps_the_storage_on_the_device():
    # x, a, b, c, forward 3 ms, backward twice that; at c's forward x, a, b and c are live without
    # offload (4,000 bytes)
    g = _relu_chain("abc", step_ms=9.0)

    def at_c(result) -> int:
        return next(live for phase, node, live in result.timeline if (phase, node) == ("forward", "c"))

    assert at_c(simulate(g)) == 4000
    # a's copy out takes 10 ms: it has not landed when the backward starts, so a never leaves
    # and the step is the one without offload
    slow = simulate_offload(g, (), ("a",), OffloadSpec(h2d_gbps=KB_PER_MS, d2h_gbps=KB_PER_MS / 10))
    assert (at_c(slow), slow.timeline, slow.exposed_ms) == (4000, simulate(g).timeline, 0.0)
    # 1 ms: a leaves when b is done (2 ms); it is fetched at b's backward (start 5 ms, back at
    # 6 ms, needed at 7 ms)
    fast = simulate_offload(g, (), ("a",), OffloadSpec(h2d_gbps=KB_PER_MS, d2h_gbps=KB_PER_MS))
    assert (at_c(fast), fast.exposed_ms, fast.triggers) == (3000, 0.0, ("b",))
    assert fast.host_peak_bytes == fast.offloaded_bytes == 1000
    # between: a 2 ms copy issued at 1 ms lands as c ends: a is live at c, gone in the backward
    between = simulate_offload(g, (), ("a",), OffloadSpec(h2d_gbps=KB_PER_MS, d2h_gbps=KB_PER_MS / 2))
    assert at_c(between) == 4000 and [live for *_, live in between.timeline][-3:] == \
        [live for *_, live in fast.timeline][-3:]


def test_fetches_are_issued_just_in_time_in_the_order_the_backward_needs_them():
    g = _relu_chain("abcd", step_ms=12.0)  # backward nodes start at 4, 6, 8, 10 ms (d, c, b, a)
    result = simulate_offload(g, (), ("a", "b"), OffloadSpec(h2d_gbps=KB_PER_MS, d2h_gbps=KB_PER_MS))
    # a is needed at 10 ms and takes 1 ms: issued at b (8 ms); b then must land by 8 ms and
    # start by 7 ms: issued at c (6 ms)
    assert result.offloaded == ("a", "b") and result.triggers == ("b", "c")
    assert (result.peak_bytes, simulate(g).peak_bytes, result.exposed_ms) == (6000, 7000, 0.0)


def test_only_held_outputs_are_offloadable_and_others_are_ignored():
    g = _relu_chain("abc")
    assert list(offloadable_nodes(g)) == ["a", "b"]  # c is returned: the caller holds it
    assert list(offloadable_nodes(g, [("b", "c")])) == ["a"]  # the segment's input; b is recomputed
    assert simulate_offload(g, (), ("c",), HOST_LINKS["h100"]).peak_bytes == simulate(g).peak_bytes
    with pytest.raises(ValueError, match="not a node"):
        simulate_offload(g, (), ("nope",), HOST_LINKS["h100"])


def _random_segments(g: CostGraph, rng: random.Random) -> list[list[str]]:
    compute = [n.name for n in g.compute_nodes]
    segments, i = [], 0
    while i < len(compute):
        if rng.random() < 0.3:
            length = rng.randint(1, 4)
            segments.append(compute[i:i + length])
            i += length + 1
        else:
            i += 1
    return segments


def _without_saves(g: CostGraph, storages: set[int]) -> CostGraph:
    """The graph with ``storages`` never saved: a step that drops them after their last forward
    reader and never needs them again, below any replay that must bring them back."""
    nodes = tuple(dataclasses.replace(n, saved_storages=tuple(k for k in n.saved_storages if k not in storages))
                  for n in g.nodes)
    return dataclasses.replace(g, nodes=nodes)


LINKS = [OffloadSpec(h2d_gbps=b * 1e-3, d2h_gbps=b * 2e-3) for b in (0.05, 1.0, 1e6)]


@pytest.mark.parametrize("seed", range(40))
def test_the_peak_with_copies_lies_between_never_bringing_them_back_and_never_offloading(seed):
    rng = random.Random(seed)
    g = dataclasses.replace(random_dag(seed, rng.randint(4, 14)), step_ms=0.0)
    movable = offloadable_nodes(g)
    chosen = [n for n in movable if rng.random() < 0.6]
    storages = {k for n in chosen for k in movable[n]}
    floor = simulate(_without_saves(g, storages)).peak_bytes
    plain = simulate(g).peak_bytes
    for link in LINKS:
        peak = simulate_offload(g, (), chosen, link).peak_bytes
        assert floor <= peak <= plain, (link, floor, peak, plain)


@pytest.mark.parametrize("seed", range(40))
def test_with_segments_offload_never_adds_memory_and_a_slower_link_never_lowers_the_peak(seed):
    rng = random.Random(seed)
    g = random_dag(seed, rng.randint(4, 14))
    segments = _random_segments(g, rng)
    movable = offloadable_nodes(g, segments)
    chosen = [n for n in movable if rng.random() < 0.6]
    plain = simulate(g, segments).peak_bytes
    peaks = [simulate_offload(g, segments, chosen, link).peak_bytes for link in LINKS]
    assert peaks[0] >= peaks[1] >= peaks[2] and peaks[0] <= plain, (peaks, plain)
    # the stopped replay agrees with the full one on whether a budget is met
    for budget in {plain, peaks[2], peaks[2] - 1}:
        stopped = simulate_offload(g, segments, chosen, LINKS[1], limit_bytes=budget).peak_bytes
        assert (stopped <= budget) == (peaks[1] <= budget)


def _plan(g: CostGraph, segments: list[list[str]], budget_bytes: int) -> Plan:
    segs = tuple(Segment(tuple(s), *rerun_cost(g, s)) for s in segments)
    return Plan(budget_bytes, simulate(g, segs).peak_bytes, simulate(g).peak_bytes, segs, g.forward_ms, g.step_ms,
                g.forward_flops, "test", 0.0)


def _offload_case(seed: int) -> tuple[CostGraph, Plan, int, OffloadSpec, Plan | None]:
    rng = random.Random(seed)
    g = dataclasses.replace(random_dag(seed, rng.randint(6, 16)), step_ms=0.0)
    segments = _random_segments(g, rng)
    base = _plan(g, segments, 0)
    budget = base.predicted_peak_bytes + rng.choice([0, MIB // 2])
    link = OffloadSpec(h2d_gbps=rng.choice([0.2, 2.0, 50.0]), d2h_gbps=rng.choice([0.2, 2.0, 50.0]),
                       pinned_host_bytes=rng.choice([2 * MIB, 2**30]))
    return g, base, budget, link, offload_plan(g, budget, dataclasses.replace(base, budget_bytes=budget), link)


@pytest.mark.parametrize("seed", range(30))
def test_the_offload_start_fits_its_budget_costs_less_and_replays_to_what_it_says(seed):
    g, base, budget, link, plan = _offload_case(seed)
    if plan is None:
        return
    assert plan.offloaded and plan.extra_time_ms < base.recompute_ms
    replay = simulate_offload(g, plan.segments, plan.offloaded, link,
                              triggers=dict(zip(plan.offloaded, plan.offload_triggers)))
    assert replay.peak_bytes == plan.predicted_peak_bytes <= budget
    assert replay.exposed_ms == pytest.approx(plan.exposed_transfer_ms)
    assert plan.extra_time_ms == pytest.approx(plan.recompute_ms + plan.exposed_transfer_ms)
    assert replay.host_peak_bytes <= link.pinned_host_bytes
    assert set(s.node_names for s in plan.segments) <= set(s.node_names for s in base.segments)


def test_the_offload_start_finds_cheaper_plans_on_some_random_graphs():
    assert sum(_offload_case(seed)[-1] is not None for seed in range(30)) >= 5


@pytest.mark.parametrize("seed", range(30))
def test_where_offloading_everything_fits_the_fit_finds_a_choice(seed):
    rng = random.Random(seed)
    g = random_dag(seed, rng.randint(4, 12))
    segments = [Segment(tuple(s), *rerun_cost(g, s)) for s in _random_segments(g, rng)]
    link = OffloadSpec(h2d_gbps=1.0, d2h_gbps=1.0)
    every = simulate_offload(g, segments, list(offloadable_nodes(g, segments)), link).peak_bytes
    choice = fit_with_offload(g, segments, every, link)
    assert choice is not None
    assert choice.result.peak_bytes == simulate_offload(g, segments, choice.offloaded, link).peak_bytes <= every


def test_recompute_becomes_offload_where_the_copies_hide_behind_the_compute():
    g = dataclasses.replace(chain([4.0] * 8, times_ms=[2.0] * 8), step_ms=48.0)
    pairs = [["n1", "n2"], ["n3", "n4"], ["n5", "n6"]]
    base = _plan(g, pairs, 0)
    budget = base.predicted_peak_bytes
    plan = offload_plan(g, budget, dataclasses.replace(base, budget_bytes=budget), HOST_LINKS["h100"])
    assert plan is not None and plan.predicted_peak_bytes <= budget
    assert plan.recompute_ms < base.recompute_ms and plan.exposed_transfer_ms == 0.0
    # a link too slow for any copy to hide: offloading is not chosen
    slow = OffloadSpec(h2d_gbps=1e-4, d2h_gbps=1e-4)
    assert offload_plan(g, budget, dataclasses.replace(base, budget_bytes=budget), slow) is None


def test_summary_shows_the_offloaded_bytes_and_the_extra_time_counts_exposed_copies():
    plan = Plan(2**30, 2**29, 2**30, (Segment(("a",), 1.0, 0),), 10.0, 30.0, 0, "chain DP + offload", 0.1,
                offloaded=("b", "c"), offload_triggers=("d", "d"), offloaded_bytes=3 * 2**28,
                exposed_transfer_ms=0.5)
    assert plan.extra_time_ms == 1.5 and plan.overhead_ratio == pytest.approx(0.05)
    text = plan.summary()
    assert "outputs of 2 nodes, 0.7500 GiB to pinned host memory" in text
    assert "1.50 ms per step" in text


H100_NAMES = ["gpt2_gpu", "llama_gpu", "bert_gpu", "mlp_gpu", "t5_gpu", "gpt2_24l_gpu"]


def _replays_to_what_it_says(graph: CostGraph, plan: Plan, link: OffloadSpec) -> None:
    replay = simulate_offload(graph, plan.segments, plan.offloaded, link,
                              triggers=dict(zip(plan.offloaded, plan.offload_triggers)))
    assert replay.peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes
    assert replay.exposed_ms == pytest.approx(plan.exposed_transfer_ms)
    assert (replay.offloaded, replay.offloaded_bytes) == (plan.offloaded, plan.offloaded_bytes)
    assert plan.extra_time_ms == pytest.approx(plan.recompute_ms + plan.exposed_transfer_ms)


@pytest.mark.parametrize("name", [n if n in ("bert_gpu", "mlp_gpu") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in H100_NAMES])
def test_on_the_h100_profiles_the_solve_with_offload_predicts_no_more_than_recompute_or_every_output_offloaded(name):
    from h100_profiles import H100_PROFILES

    from planner.core.costgraph import protect_reads_before_writes
    from planner.solvers.hand_policies import hand_placed_plans
    from planner.solvers.solve import solve
    from profiling.cache import load_profile

    graph = protect_reads_before_writes(load_profile(H100_PROFILES / f"{name}.json"))
    every = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
    budget = simulate(graph, every.segments).peak_bytes
    base = solve(graph, budget)
    assert base.offloaded == ()
    link = HOST_LINKS["h100"]
    plan = solve(graph, budget, offload=True)
    _replays_to_what_it_says(graph, plan, link)
    assert plan.offloaded and plan.extra_time_ms < base.extra_time_ms
    boundaries = simulate_offload(graph, every.segments, list(offloadable_nodes(graph, every.segments)), link)
    assert boundaries.peak_bytes <= budget  # the candidate fits here, so the solve predicts no more than it
    assert plan.extra_time_ms <= every.recompute_ms + boundaries.exposed_ms
    # the offload start around the plan of recompute alone is one of the solve's candidates
    around = offload_plan(graph, budget, base, link)
    assert around is not None and plan.extra_time_ms <= around.extra_time_ms


def _layers(count: int, step_ms: float) -> CostGraph:
    """``count`` layers of (linear, tanh) over 1 MiB outputs, each 1 ms, with module paths."""
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for i in range(1, 2 * count + 1):
        op = ("aten.linear.default", "aten.tanh.default")[(i - 1) % 2]
        nodes.append(CostNode(f"n{i}", op, input_names=(nodes[-1].name,), output_storages=(i,), saved_storages=(i,),
                              output_bytes=MIB, requires_grad=True, time_ms=1.0, flops=10**6 if "linear" in op else 0,
                              module=f"layers.{(i - 1) // 2}"))
    storages = tuple(Storage(i, MIB, i == 0) for i in range(2 * count + 1))
    return CostGraph(tuple(nodes), storages, (nodes[-1].name,), step_ms=step_ms)


@pytest.mark.parametrize("gbps", [1e-3, 0.05, 0.2, 1.0, 50.0])
def test_the_solve_with_offload_replays_to_what_it_says_and_never_predicts_more_than_its_candidates(gbps):
    from planner.solvers.hand_policies import hand_placed_plans
    from planner.solvers.solve import solve

    g = _layers(6, step_ms=36.0)
    link = OffloadSpec(h2d_gbps=gbps, d2h_gbps=gbps)
    every = next(p for p in hand_placed_plans(g) if p.name == "every layer")
    for budget in range(simulate(g, every.segments).peak_bytes - 2 * MIB, simulate(g).peak_bytes, MIB):
        try:
            base = solve(g, budget)
        except InfeasibleBudgetError:
            base = None
        plan = solve(g, budget, offload=True, host_bandwidth_gbps=gbps)
        _replays_to_what_it_says(g, plan, link)
        if base is not None:
            assert plan.extra_time_ms <= base.extra_time_ms
        boundaries = simulate_offload(g, every.segments, list(offloadable_nodes(g, every.segments)), link)
        if boundaries.peak_bytes <= budget:
            assert plan.extra_time_ms <= every.recompute_ms + boundaries.exposed_ms


def test_the_solve_with_offload_meets_budgets_recompute_cannot_and_names_the_smallest_it_reaches():
    from planner.solvers.solve import solve

    g = _relu_chain("abcd", step_ms=12.0)
    g = dataclasses.replace(g, nodes=tuple(dataclasses.replace(n, recomputable=False) for n in g.nodes))
    link = dict(host_bandwidth_gbps=KB_PER_MS)
    with pytest.raises(InfeasibleBudgetError):
        solve(g, 6000)
    plan = solve(g, 6000, offload=True, **link)
    assert plan.segments == () and plan.offloaded and plan.predicted_peak_bytes <= 6000
    _replays_to_what_it_says(g, plan, OffloadSpec(KB_PER_MS, KB_PER_MS))
    with pytest.raises(InfeasibleBudgetError) as refused:
        solve(g, 4000, offload=True, **link)
    floor = refused.value.min_feasible_bytes
    assert 4000 < floor < simulate(g).peak_bytes
    assert solve(g, floor, offload=True, **link).predicted_peak_bytes <= floor  # the budget named is met


@pytest.mark.parametrize("seed", range(20))
def test_without_offload_the_solve_is_the_plan_of_recompute_and_with_it_never_costs_more(seed):
    from planner.solvers.solve import solve

    rng = random.Random(seed)
    g = random_dag(seed, rng.randint(6, 14))
    unoptimized = simulate(g).peak_bytes
    budget = int(unoptimized * rng.uniform(0.6, 0.95))
    try:
        base = solve(g, budget, exact=False)
    except InfeasibleBudgetError:
        return
    assert base.offloaded == () and base.extra_time_ms == base.recompute_ms
    assert dataclasses.replace(solve(g, budget, exact=False, offload=False), solve_s=0.0) == \
        dataclasses.replace(base, solve_s=0.0)
    plan = solve(g, budget, exact=False, offload=True, host_link="gh200")
    _replays_to_what_it_says(g, plan, HOST_LINKS["gh200"])
    assert plan.extra_time_ms <= base.extra_time_ms


def test_sweep_and_report_show_what_a_plan_offloads_and_its_exposed_copies():
    import json

    from planner.core.options import PlanOptions
    from planner.report import build_report, render
    from planner.solvers.smallest_peak import minimum_peak_plan
    from planner.solvers.solve import solve
    from planner.sweep import sweep

    g = _layers(6, step_ms=36.0)
    options = PlanOptions(offload=True, host_bandwidth_gbps=1.0, safety_margin=0.0)
    budget = 11 * MIB
    plan = solve(g, budget, options.solve_options())
    assert plan.offloaded and plan.offloaded_bytes == 4 * MIB
    plans = sweep(g, options=options, points=4)
    # the sweep starts from the smallest peak offloading reaches, below the smallest of recompute alone
    assert plans[0].offloaded and plans[0].budget_bytes < minimum_peak_plan(g).predicted_peak_bytes
    extra = [p.extra_time_ms for p in plans]
    assert extra == sorted(extra, reverse=True)
    report = build_report(g, plan, sweep_plans=plans, offload=options)
    data = json.loads(render(report, "json"))["plan"]
    assert (data["offloaded_bytes"], data["exposed_transfer_ms"]) == (4 * MIB, 0.0)
    assert data["host_link"] == "1 GB/s each way"
    assert [o["node"] for o in data["offloaded"]] == list(plan.offloaded)
    assert data["extra_time_ms"] == plan.extra_time_ms
    text = render(report, "text")
    assert "offloaded                      outputs of 4 nodes, 4.0 MiB to pinned host memory over 1 GB/s" in text
    assert "copies not hidden (predicted)" in text
    assert text.split("Pareto front (sweep)\n")[1].splitlines()[0].split()[-1] == "offloaded"
    # the plan's timeline is replayed with its copies: its peak is the plan's
    assert max(live for *_, live in report.timelines["plan"].timeline) == plan.predicted_peak_bytes
    # a plan without copies shows no offload rows
    plain = build_report(g, solve(g, budget))
    assert "offloaded" not in render(plain, "text") and json.loads(render(plain, "json"))["plan"]["offloaded"] == []


def test_plan_for_budget_with_offload_keeps_the_plan_that_predicts_less_and_options_are_checked():
    from planner.core.errors import InputError
    from planner.core.options import PlanOptions
    from planner.pipeline import plan_for_budget

    g = dataclasses.replace(chain([4.0] * 8, times_ms=[2.0] * 8), step_ms=48.0)
    budget_gb = simulate(g, [["n1", "n2"], ["n3", "n4"], ["n5", "n6"]]).peak_bytes / 2**30
    plain = plan_for_budget(g, budget_gb, PlanOptions(safety_margin=0.0))
    offloaded = plan_for_budget(g, budget_gb, PlanOptions(safety_margin=0.0, offload=True))
    assert plain.offloaded == () and offloaded.offloaded
    assert offloaded.extra_time_ms < plain.extra_time_ms and offloaded.predicted_peak_bytes <= budget_gb * 2**30
    slow = plan_for_budget(g, budget_gb, PlanOptions(safety_margin=0.0, offload=True, host_bandwidth_gbps=1e-4))
    assert slow.offloaded == () and slow.segments == plain.segments
    for bad in (dict(host_link="pcie9"), dict(host_bandwidth_gbps=0), dict(pinned_host_gb=-1.0), dict(offload=1)):
        with pytest.raises(InputError):
            PlanOptions(**bad)


def test_a_spent_max_solve_s_skips_the_offload_step_where_recompute_fits_and_not_where_it_cannot():
    from planner.solvers.hand_policies import hand_placed_plans
    from planner.solvers.solve import solve

    g = _layers(6, step_ms=36.0)
    every = next(p for p in hand_placed_plans(g) if p.name == "every layer")
    budget = simulate(g, every.segments).peak_bytes
    assert solve(g, budget, offload=True, host_bandwidth_gbps=50.0).offloaded  # offload wins with time to try
    hurried = solve(g, budget, offload=True, host_bandwidth_gbps=50.0, max_solve_s=1e-9)
    assert hurried.offloaded == () and hurried.predicted_peak_bytes <= budget

    chain = _relu_chain("abcd", step_ms=12.0)
    chain = dataclasses.replace(chain, nodes=tuple(dataclasses.replace(n, recomputable=False) for n in chain.nodes))
    only_offload = solve(chain, 6000, offload=True, host_bandwidth_gbps=KB_PER_MS, max_solve_s=1e-9)
    assert only_offload.offloaded and only_offload.predicted_peak_bytes <= 6000
