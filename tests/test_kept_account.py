"""The optimistic account with kept outputs (:mod:`planner.bounds.kept_account`) accepts every plan at
its own simulated peak, offers every node a selective policy may keep, and prices keeps as
:func:`planner.solvers.keep.segment_with_kept` does (standard library and PuLP only: no torch)."""

from __future__ import annotations

import dataclasses
import random

import pulp
import pytest

from graphs import random_dag
from planner import simulate
from planner.solvers.keep import keepable_in_segment, segment_with_kept
from planner.bounds.kept_account import KeptOutputsAccount
from planner.solvers.solve import available_solvers
from planner.core.stages import build_stages


def _random_plan(g, stages, rng):
    """Disjoint runs of recomputable stages, each keeping a random subset of its keepable nodes."""
    runs, t = [], 0
    while t < len(stages):
        if stages[t].recomputable and rng.random() < 0.5:
            b = t
            while b + 1 < len(stages) and stages[b + 1].recomputable and rng.random() < 0.7:
                b += 1
            runs.append((t, b))
            t = b + 1
        else:
            t += 1
    segments = []
    for a, b in runs:
        names = [n for st in stages[a : b + 1] for n in st.node_names]
        kept = {n for n in keepable_in_segment(g, names) if rng.random() < 0.6}
        segments.append(segment_with_kept(g, names, kept))
    return runs, segments


def _solver():
    return pulp.HiGHS(msg=False) if "HiGHS" in available_solvers() else pulp.PULP_CBC_CMD(msg=False)


def test_the_account_accepts_every_plan_at_its_own_simulated_peak():
    """With a plan's segments and keeps fixed and the budget at its simulated peak, every moment
    of the account still fits, at a cost no higher than the plan's: the account never predicts
    more than the simulator, so the bound cannot exclude a plan that fits."""
    with_keeps = 0
    for seed in range(120):
        rng = random.Random(seed)
        g = random_dag(seed, rng.randint(3, 10))
        if seed % 2:
            g = dataclasses.replace(g, selective_overhead_ms_per_node=0.05)
        stages = build_stages(g, max_stages=len(g.compute_nodes))
        runs, segments = _random_plan(g, stages, rng)
        kept = {n for seg in segments for n in seg.kept_nodes}
        with_keeps += bool(kept)
        account = KeptOutputsAccount(g, stages, simulate(g, segments).peak_bytes)
        for phase, name, live in account.moments:
            account.add_moment(phase, name, live)
        for run, v in account.y.items():
            account.prob += v == int(run in runs)
        for name, v in account.x.items():
            account.prob += v == int(name in kept)
        account.prob.setObjective(account.cost_expression(account.run_ms, account.kept_time_ms))
        account.prob.solve(_solver())
        assert account.prob.status == pulp.LpStatusOptimal, (seed, runs, sorted(kept))
        cost_ms = sum(seg.recompute_ms for seg in segments)
        assert pulp.value(account.prob.objective) <= cost_ms + 1e-6, (seed, runs, sorted(kept))
    assert with_keeps >= 30, f"only {with_keeps} plans kept anything"


@pytest.mark.parametrize("seed", range(6))
def test_every_node_a_segment_may_keep_is_a_candidate(seed):
    g = random_dag(seed, 10)
    stages = build_stages(g, max_stages=len(g.compute_nodes))
    account = KeptOutputsAccount(g, stages, 1)
    for a, b in account.runs:
        names = [n for st in stages[a : b + 1] for n in st.node_names]
        assert set(keepable_in_segment(g, names)) <= set(account.x)


@pytest.mark.skipif("HiGHS" not in available_solvers(), reason="HiGHS is not installed")
@pytest.mark.parametrize("seed, n, fraction", [(14, 6, 0.75), (34, 7, 0.9), (38, 7, 0.75)])
def test_where_keeping_beats_every_plan_of_whole_segments_the_bound_allows_it(seed, n, fraction):
    """Random DAGs where a plan with kept outputs costs less than any plan of whole segments
    (brute force): the segments-only bound lies above that plan, the bound with kept outputs
    does not, and meets it within the gap."""
    from graphs import brute_force

    from planner.bounds.reach import recompute_bound
    from planner.solvers.solve import MIP_GAP

    g = random_dag(seed, n)
    budget = int(simulate(g).peak_bytes * fraction)
    whole, _ = brute_force(g, budget)
    selective, _ = brute_force(g, budget, kept_outputs=True)
    assert selective < whole
    assert recompute_bound(g, budget, kept_outputs=False).bound > selective * (1 + MIP_GAP)
    found = recompute_bound(g, budget)
    assert selective / (1 + MIP_GAP) - 1e-9 <= found.bound <= selective + 1e-9
