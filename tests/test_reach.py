"""The proven bound of :mod:`planner.bounds.reach` never exceeds the cheapest plan that fits (brute force
over every plan of segments and every choice of kept outputs inside them), is tight where the
cheap covering bound is loose, and proves infeasibility only where nothing fits (standard
library, PuLP and hypothesis only: no torch)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from graphs import MIB, brute_force, mlp_blocks, random_dag
from planner import InputError, simulate, solve
from planner.bounds.covering import recompute_lower_bound_ms
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.bounds.reach import recompute_bound
from planner.solvers.solve import MIP_GAP, available_solvers

needs_highs = pytest.mark.skipif("HiGHS" not in available_solvers(), reason="HiGHS is not installed")


def _with_policy_cost(g, seed):
    """Odd seeds charge the selective policy 0.05 ms per node, as a CPU profile does."""
    return dataclasses.replace(g, selective_overhead_ms_per_node=0.05) if seed % 2 else g


@needs_highs
@pytest.mark.parametrize("objective", ["time", "flops"])
def test_bound_never_exceeds_brute_force_and_is_attained_within_the_gap(objective):
    """On random 8-node DAGs at three budgets, against brute force over every plan of segments
    and every subset of each segment's keepable nodes: bound <= the cheapest fitting plan's
    cost; HiGHS proves the account's optimum within 1 %, so a plan it met that fits is brute
    force's optimum within the gap; infeasible only where no plan fits."""
    cases = tight = 0
    for seed in range(12):
        g = _with_policy_cost(random_dag(seed, 8), seed)
        unoptimized = simulate(g).peak_bytes
        for fraction in (0.6, 0.75, 0.9):
            budget = int(unoptimized * fraction)
            best, _ = brute_force(g, budget, objective, kept_outputs=True)
            found = recompute_bound(g, budget, objective=objective)
            if found.proven_infeasible:
                assert best is None, f"seed {seed}: proved {budget} bytes infeasible, brute force fits it"
                continue
            if best is None:
                continue  # the account is optimistic: it may accept a budget no plan meets
            cases += 1
            assert found.bound <= best * (1 + 1e-9) + 1e-9, (seed, fraction, found, best)
            if found.best_plan is not None:
                assert best - 1e-9 <= found.best_plan <= best * (1 + MIP_GAP) + 1e-6
                tight += found.bound >= best / (1 + MIP_GAP) - 1e-6
    assert cases >= 12, cases
    assert tight >= cases * 3 // 4, f"the bound meets brute force's optimum on {tight} of {cases} cases"


@needs_highs
def test_segments_only_bound_never_exceeds_brute_force_over_segments():
    """``kept_outputs=False`` bounds plans of whole segments: never above the cheapest one,
    and at least the bound over plans with kept outputs too (it has fewer plans to choose from)."""
    cases = 0
    for seed in range(8):
        g = random_dag(seed, 8)
        budget = int(simulate(g).peak_bytes * 0.9)
        best, _ = brute_force(g, budget)
        segments_only = recompute_bound(g, budget, kept_outputs=False)
        if best is None:
            continue
        cases += 1
        assert segments_only.bound <= best * (1 + 1e-9) + 1e-9
        with_kept = recompute_bound(g, budget)
        assert with_kept.bound <= segments_only.bound * (1 + MIP_GAP) + 1e-9
    assert cases >= 4


@needs_highs
def test_bound_is_tight_and_at_least_the_covering_bound():
    """The account's bound is within the MIP gap of brute force on residual MLP blocks, and at
    least the covering bound of planner.bounds.covering (which relaxes what a recompute holds in
    the backward, so it can only be lower)."""
    g = mlp_blocks(2)
    unoptimized = simulate(g).peak_bytes
    for fraction in (0.7, 0.8, 0.9):
        budget = int(unoptimized * fraction)
        best, _ = brute_force(g, budget)
        found = recompute_bound(g, budget)
        cheap = recompute_lower_bound_ms(g, budget)
        assert cheap <= found.bound + 1e-9 and found.bound <= best + 1e-9
        assert found.bound >= best / (1 + MIP_GAP) - 1e-9
        assert found.method.startswith("MILP")
        assert found.gap is not None and found.gap <= MIP_GAP + 1e-9


@needs_highs
def test_the_planner_is_never_cheaper_than_the_bound():
    """On 3 residual MLP blocks the bound equals the planner's plan (both optimal)."""
    g = mlp_blocks(3)
    unoptimized = simulate(g).peak_bytes
    for fraction in (0.6, 0.7, 0.8, 0.9):
        budget = int(unoptimized * fraction)
        plan = solve(g, budget)
        found = recompute_bound(g, budget)
        assert plan.recompute_ms / (1 + MIP_GAP) - 1e-9 <= found.bound <= plan.recompute_ms + 1e-9
        flops = recompute_bound(g, budget, objective="flops")
        assert flops.bound <= plan.recompute_flops + 1e-9
        selective = solve(g, budget, selective=True)
        assert found.bound <= selective.recompute_ms + 1e-9


def test_lp_relaxation_with_cbc_is_a_weaker_bound_still_below_brute_force():
    for seed in range(4):
        g = random_dag(seed, 8)
        budget = int(simulate(g).peak_bytes * 0.75)
        best, _ = brute_force(g, budget)
        found = recompute_bound(g, budget, solver="CBC")
        if best is None:
            continue
        assert found.method.endswith("LP relaxation (CBC)")
        assert found.best_plan is None
        assert found.bound <= best + 1e-9


def test_budgets_that_fit_or_cannot_fit():
    g = mlp_blocks(2)
    unoptimized = simulate(g).peak_bytes
    roomy = recompute_bound(g, unoptimized)
    assert (roomy.bound, roomy.proven_infeasible) == (0.0, False)
    # less than the parameters and the input alone: nothing can fit
    tiny = recompute_bound(g, MIB)
    assert tiny.proven_infeasible and math.isinf(tiny.bound) and tiny.gap is None


@needs_highs
def test_infeasibility_is_proven_below_every_plans_peak():
    """Just below the smallest peak any plan reaches (brute force), the account proves that no
    plan fits on most graphs: its memory account is exact where only segments change it."""
    proven = cases = 0
    for seed in range(8):
        g = random_dag(seed, 7)
        _, min_peak = brute_force(g, 0, kept_outputs=True)
        cases += 1
        found = recompute_bound(g, min_peak - 1)
        proven += found.proven_infeasible
        if not found.proven_infeasible:
            assert found.best_plan is None, "no plan fits below the smallest peak"
    assert proven >= cases // 2, f"proved infeasible on {proven} of {cases}"


@pytest.mark.parametrize("kwargs, message", [
    ({"objective": "memory"}, "objective"),
    ({"time_limit_s": 0}, "time_limit_s"),
])
def test_bad_arguments_say_what_to_pass(kwargs, message):
    g = mlp_blocks(1)
    with pytest.raises(InputError, match=message):
        recompute_bound(g, 10 * MIB, **kwargs)
    with pytest.raises(InputError, match="budget_bytes"):
        recompute_bound(g, -1)


def test_a_graph_with_only_unrecomputable_nodes_is_infeasible_below_its_peak():
    nodes = (CostNode("x", "placeholder", kind="input", output_storages=(0,)),
             CostNode("a", "op", input_names=("x",), output_storages=(1,), saved_storages=(1,), output_bytes=MIB,
                      requires_grad=True, time_ms=1.0, recomputable=False))
    g = CostGraph(nodes, (Storage(0, MIB, True), Storage(1, MIB)), ("a",))
    found = recompute_bound(g, simulate(g).peak_bytes - 1)
    assert found.proven_infeasible


@needs_highs
def test_without_presolve_the_bound_is_the_same_on_a_small_graph():
    g = mlp_blocks(3)
    budget = int(simulate(g).peak_bytes * 0.7)
    with_presolve = recompute_bound(g, budget)
    without = recompute_bound(g, budget, presolve=False)
    assert without.method == with_presolve.method
    assert abs(without.bound - with_presolve.bound) <= MIP_GAP * with_presolve.bound + 1e-9
