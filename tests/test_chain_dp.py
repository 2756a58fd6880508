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
from planner.chain_dp import ChainSearchTooLarge, cheapest_segments
from planner.stage_model import build_stage_model
from planner.stages import build_stages

solve_module = importlib.import_module("planner.solve")


def objective(model, chosen):
    """The ILP's objective for ``chosen``: recompute time plus its per-segment tie-break."""
    total_ms = sum(model.time_ms) or 1.0
    return sum(model.run_ms[s] + 1e-3 * total_ms for s in chosen)


def ilp_optimum(model, budget_mib):
    """The ILP solved without a node limit (within :data:`planner.solve.MIP_GAP`), or None."""
    result = solve_module._solve_ilp(model, budget_mib, None, 60.0)
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

    monkeypatch.setattr(solve_module, "cheapest_segments", too_large)
    budget = (minimum_peak_plan(g).predicted_peak_bytes + simulate(g).peak_bytes) // 2
    with caplog.at_level(logging.INFO, logger="planner.solve"):
        plan = solve(g, budget, exact=False, refine_s=0, finer_rounds=0)
    assert any("solving the ILP instead" in r.getMessage() for r in caplog.records)
    assert plan.solver.split(" ")[0] in solve_module.available_solvers()
    assert simulate(g, plan.segments).peak_bytes <= budget


def test_the_default_solve_uses_it_and_a_named_solver_does_not():
    g = chain([4, 8, 2, 8, 4, 8, 2, 8], param_mib=1)
    budget = (minimum_peak_plan(g).predicted_peak_bytes + simulate(g).peak_bytes) // 2
    default = solve(g, budget, exact=False, refine_s=0)
    named = solve(g, budget, exact=False, refine_s=0, solver="CBC")
    assert default.solver.startswith(solve_module.CHAIN_DP) and default.optimality_gap == 0.0
    assert named.solver.startswith("CBC")
    assert default.recompute_ms <= named.recompute_ms * (1 + solve_module.MIP_GAP) + 1e-9
    assert simulate(g, default.segments).peak_bytes <= budget


def test_a_selective_model_is_refused():
    from profiling.cache import load_profile

    g = load_profile(Path(__file__).parent / "data" / "gpt2_4layer_profile.json")
    model = build_stage_model(g, build_stages(g, 16), max_segment_stages=16, selective=True)
    assert any(model.keep_options)
    with pytest.raises(ValueError, match="kept outputs"):
        cheapest_segments(model, simulate(g).peak_bytes * 0.6 / MIB)
