"""The chain DP solves the stage ILP's model to its optimum: the same objective as the ILP
(within the ILP's gap), the same feasibility, and a fallback to the ILP when it grows too large."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import MIB, chain, random_dag
from planner import minimum_peak_plan, simulate, solve
from planner.solvers.chain_dp import ChainSearchTooLarge, cheapest_plan, cheapest_segments
from planner.solvers.stage_model import build_stage_model
from planner.core.stages import build_stages

solve_module = importlib.import_module("planner.solvers.solve")
milp = importlib.import_module("planner.solvers.stage_ilp")
stage_plans_module = importlib.import_module("planner.solvers.stage_plans")


def objective(model, chosen, keeps=()):
    """The ILP's objective for ``chosen`` and the keep options ``keeps``: recompute time plus
    its per-segment tie-break, less the kept options' saved time."""
    total_ms = sum(model.time_ms) or 1.0
    return (sum(model.run_ms[s] + 1e-3 * total_ms for s in chosen)
            - sum(model.keep_options[j][o].saved_ms for j, o in keeps))


def ilp_optimum(model, budget_mib):
    """The ILP solved without a node limit (within :data:`planner.solvers.solve.MIP_GAP`), or None."""
    result = milp.solve_ilp(model, budget_mib, None, 60.0)
    return None if result is None else result.chosen


def assert_same_optimum(model, budget_mib):
    """The DP and the ILP agree on whether a plan fits, and the DP's objective is the least,
    the ILP's within its gap of it."""
    by_dp = cheapest_segments(model, budget_mib)
    by_ilp = ilp_optimum(model, budget_mib)
    assert (by_dp is None) == (by_ilp is None)
    if by_dp is not None:
        assert set(by_dp) <= set(model.segments)
        assert all(b < a2 for (_, b), (a2, _) in zip(by_dp, by_dp[1:])), "segments overlap"
        assert objective(model, by_dp) <= objective(model, by_ilp) + 1e-9
        assert objective(model, by_ilp) <= objective(model, by_dp) * (1 + solve_module.MIP_GAP) + 1e-9


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), nodes=st.integers(6, 30), stages=st.integers(2, 12),
       longest=st.integers(1, 12), fraction=st.floats(0.3, 1.0))
def test_same_optimum_as_the_ilp_on_random_graphs(seed, nodes, stages, longest, fraction):
    g = random_dag(seed, nodes)
    model = build_stage_model(g, build_stages(g, stages), max_segment_stages=longest)
    assert_same_optimum(model, simulate(g).peak_bytes * fraction / MIB)




@pytest.mark.parametrize("seed", range(20))
def test_pruning_keeps_each_label_cheaper_than_every_label_before_it(seed):
    """The DP's Pareto pruning against its definition, label by label: sorted by (stored MiB,
    cost, arrival), a label stays when it costs less than every label before it (by more than
    1e-12). Many equal stored MiB and costs, and costs a hair apart, as the DP's labels have."""
    import numpy as np

    from planner.solvers.chain_dp import _pruned

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 200))
    stored = rng.integers(0, 20, n) * 0.5 + (rng.random(n) < 0.2) * rng.random(n)
    cost = rng.integers(0, 10, n) + (rng.random(n) < 0.3) * rng.choice([0.0, 1e-13, 5e-13, 2e-12, 0.3], n)
    arrival = np.arange(n)
    expected, cheapest = [], float("inf")
    for i in sorted(range(n), key=lambda i: (stored[i], cost[i], i)):
        if cost[i] < cheapest - 1e-12:
            expected.append(i)
        cheapest = min(cheapest, cost[i])
    kept_stored, kept_cost, kept = _pruned(stored, cost, arrival)
    assert kept.tolist() == expected
    assert kept_stored.tolist() == stored[expected].tolist() and kept_cost.tolist() == cost[expected].tolist()

@pytest.mark.parametrize("seed", range(8))
def test_the_stage_model_prices_every_candidate_segment_as_computed_directly(seed):
    """The model prices only its candidate segments (spans of at most ``max_segment_stages``
    recomputable stages): each at :func:`planner.core.rerun.rerun_cost` of its nodes, and what it
    holds again by each of its stages' backward at the bytes saved there by nodes of the
    segment, made inside it."""
    from planner.core.rerun import rerun_cost

    g = random_dag(seed, 10 + seed)
    stages = build_stages(g, 3 + seed % 5)
    longest = 1 + seed % 4
    model = build_stage_model(g, stages, max_segment_stages=longest, selective=seed % 2 == 1)
    expected = {(a, b) for a in range(len(stages)) for b in range(a, min(len(stages), a + longest))
                if all(stages[j].recomputable for j in range(a, b + 1))}
    assert set(model.segments) == expected
    stage_of = {name: j for j, stage in enumerate(stages) for name in stage.node_names}
    made_at: dict[int, int] = {}
    for node in g.nodes:
        if node.name in stage_of:
            for k in (*node.output_storages, *node.saved_storages):
                made_at.setdefault(k, stage_of[node.name])
    persistent = {st.key for st in g.storages if st.persistent}
    for a, b in model.segments:
        names = [name for j in range(a, b + 1) for name in stages[j].node_names]
        assert (model.run_ms[(a, b)], model.run_flops[(a, b)]) == pytest.approx(rerun_cost(g, names))
        for j in range(a, b + 1):
            again = {k for j2 in range(a, j + 1) for name in stages[j2].node_names
                     for k in g.node(name).saved_storages if k not in persistent and made_at[k] >= a}
            assert model.recomputed[(a, j)] == pytest.approx(sum(g.storage_by_key[k].size_bytes for k in again) / MIB)

@pytest.mark.parametrize("stage_count,longest", [(32, 32), (64, 8), (128, 4)])
@pytest.mark.parametrize("fraction", [0.45, 0.7, 0.9])
def test_same_optimum_as_the_ilp_on_a_gpt2_profile(stage_count, longest, fraction):
    """The stored 4-layer GPT-2 (222 compute nodes): residual and attention storages held
    across stages, so the held groups the DP tracks are not trivial."""
    from profiling.cache import load_profile

    g = load_profile(Path(__file__).parent / "data" / "gpt2_4layer_profile.json")
    model = build_stage_model(g, build_stages(g, stage_count), max_segment_stages=longest)
    assert_same_optimum(model, simulate(g).peak_bytes * fraction / MIB)


def test_too_many_labels_stops_the_search_and_the_solve_uses_the_ilp(monkeypatch, caplog):
    g = chain([4, 8, 2, 8, 4, 8, 2, 8], param_mib=1)
    model = build_stage_model(g, build_stages(g, 8), max_segment_stages=8)
    budget_mib = simulate(g).peak_bytes * 0.7 / MIB
    with pytest.raises(ChainSearchTooLarge, match="more than 2 labels"):
        cheapest_segments(model, budget_mib, max_labels=2)

    def too_large(model, budget_mib):
        raise ChainSearchTooLarge("more than 0 labels")

    monkeypatch.setattr(stage_plans_module, "cheapest_plan", too_large)
    budget = (minimum_peak_plan(g).predicted_peak_bytes + simulate(g).peak_bytes) // 2
    with caplog.at_level(logging.INFO, logger="planner.solvers.solve"):
        plan = solve(g, budget, exact=False, refine_s=0, finer_rounds=0)
    assert any("solving the ILP instead" in r.getMessage() for r in caplog.records)
    assert plan.solver.split(" ")[0] in solve_module.available_solvers()
    assert simulate(g, plan.segments).peak_bytes <= budget


def test_the_default_solve_uses_it_and_a_named_solver_does_not():
    g = chain([4, 8, 2, 8, 4, 8, 2, 8], param_mib=1)
    budget = (minimum_peak_plan(g).predicted_peak_bytes + simulate(g).peak_bytes) // 2
    default = solve(g, budget, exact=False, refine_s=0)
    named = solve(g, budget, exact=False, refine_s=0, solver="CBC")
    assert default.by_chain_dp and default.optimality_gap == 0.0
    assert not named.by_chain_dp and named.solver.startswith("CBC")
    assert default.recompute_ms <= named.recompute_ms * (1 + solve_module.MIP_GAP) + 1e-9
    assert simulate(g, default.segments).peak_bytes <= budget


def test_cheapest_segments_refuses_a_selective_model():
    from profiling.cache import load_profile

    g = load_profile(Path(__file__).parent / "data" / "gpt2_4layer_profile.json")
    model = build_stage_model(g, build_stages(g, 16), max_segment_stages=16, selective=True)
    assert any(model.keep_options)
    with pytest.raises(ValueError, match="cheapest_plan"):
        cheapest_segments(model, simulate(g).peak_bytes * 0.6 / MIB)


def test_partial_keep_choices_count_against_the_label_cap():
    """Inside a segment the partial keep choices are arrays too: past ``max_labels`` of them the
    search stops like the labels', before they fill the memory."""
    from profiling.cache import load_profile

    g = load_profile(Path(__file__).parent / "data" / "gpt2_4layer_profile.json")
    model = build_stage_model(g, build_stages(g, 16), max_segment_stages=16, selective=True)
    budget_mib = simulate(g).peak_bytes * 0.6 / MIB
    with pytest.raises(ChainSearchTooLarge, match="partial keep choices in segment"):
        cheapest_plan(model, budget_mib, max_labels=2)
    assert cheapest_plan(model, budget_mib) is not None


def keep_rules_hold(model, plan):
    """Every keep option the plan uses lies in one of its segments, at most one per stage, and
    one that may not end a segment does not."""
    stages_kept = [j for j, _ in plan.keeps]
    assert len(stages_kept) == len(set(stages_kept)), "two options in one stage"
    for j, o in plan.keeps:
        covering = [(a, b) for a, b in plan.segments if a <= j <= b]
        assert covering, f"stage {j} keeps an option outside every segment"
        if not model.keep_options[j][o].ends_segment_allowed:
            assert covering[0][1] != j, f"stage {j} ends its segment with an option that may not"


def assert_same_selective_optimum(model, budget_mib):
    """As :func:`assert_same_optimum`, for a model with keep options: the DP's segments and
    keep options against the ILP's."""
    by_dp = cheapest_plan(model, budget_mib)
    by_ilp = milp.solve_ilp(model, budget_mib, None, 60.0)
    assert (by_dp is None) == (by_ilp is None)
    if by_dp is None:
        return
    keep_rules_hold(model, by_dp)
    ilp_keeps = [(j, o) for j, options in enumerate(model.keep_options) for o, option in enumerate(options)
                 if option.node_names == by_ilp.kept & set(model.stages[j].node_names)]
    dp_objective = objective(model, by_dp.segments, by_dp.keeps)
    ilp_objective = objective(model, by_ilp.chosen, ilp_keeps)
    assert dp_objective <= ilp_objective + 1e-9
    assert ilp_objective - dp_objective <= solve_module.MIP_GAP * abs(dp_objective) + 1e-9


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), nodes=st.integers(6, 30), stages=st.integers(2, 12),
       longest=st.integers(1, 12), fraction=st.floats(0.3, 1.0))
def test_with_keep_options_the_same_optimum_as_the_ilp_on_random_graphs(seed, nodes, stages, longest, fraction):
    """Budgets between the account's smallest feasible one and the unoptimized peak, where
    keeping competes with recomputing (at 30 to 100 % of the peak most random graphs fit no plan)."""
    g = random_dag(seed, nodes)
    model = build_stage_model(g, build_stages(g, stages), max_segment_stages=longest, selective=True)
    peak_mib = simulate(g).peak_bytes / MIB
    low, high = 0.0, 2 * peak_mib  # the account is conservative: some graphs need more than the peak
    for _ in range(30):  # the smallest budget the account accepts, by bisection
        middle = (low + high) / 2
        low, high = (low, middle) if cheapest_plan(model, middle) is not None else (middle, high)
    assert_same_selective_optimum(model, high + fraction * (max(peak_mib, 1.2 * high) - high))
    assert_same_selective_optimum(model, high - 1e-3)  # just below it: neither finds a plan


@pytest.mark.parametrize("stage_count,longest", [(16, 16), (64, 8)])
@pytest.mark.parametrize("fraction", [0.45, 0.7])
def test_with_keep_options_the_same_optimum_as_the_ilp_on_a_gpt2_profile(stage_count, longest, fraction):
    from profiling.cache import load_profile

    g = load_profile(Path(__file__).parent / "data" / "gpt2_4layer_profile.json")
    model = build_stage_model(g, build_stages(g, stage_count), max_segment_stages=longest, selective=True)
    assert any(model.keep_options)
    assert_same_selective_optimum(model, simulate(g).peak_bytes * fraction / MIB)
