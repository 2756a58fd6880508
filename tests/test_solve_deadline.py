"""``max_solve_s``: the phases after the first ILP's plan run only in what is left of it."""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

import pytest

from planner import InputError, simulate, solve
from planner.solvers.deadline import MIN_PHASE_S, SolveDeadline
from planner.pipeline import PlanOptions, plan_for_budget
from planner.core.options import SolveOptions
from planner.sweep import sweep

solve_module = importlib.import_module("planner.solvers.solve")
finer_start = importlib.import_module("planner.solvers.starts.finer_rounds")
short_start = importlib.import_module("planner.solvers.starts.short_segments")
exact_search = importlib.import_module("planner.solvers.starts.exact_search")

PROFILE = Path(__file__).parent / "data" / "gpt2_4layer_profile.json"


@pytest.fixture(scope="module")
def gpt2_graph():
    from profiling.cache import load_profile

    return load_profile(PROFILE)


def test_a_spent_bound_returns_the_first_plan(gpt2_graph, caplog):
    """With no time left every improving phase is skipped: the plan is the one the first ILP
    (stopped by its node limit, the same on every machine) gives with the phases turned off."""
    g = gpt2_graph
    budget = int(simulate(g).peak_bytes * 0.6)
    first_only = solve(g, budget, max_stages=4, exact=False, finer_rounds=0, short_segments=False, refine_s=0)
    with caplog.at_level(logging.INFO, logger="planner.solvers.deadline"):
        bounded = solve(g, budget, max_stages=4, max_solve_s=1e-3, polish=True)
    assert bounded.segments == first_only.segments
    assert bounded.hit_time_limit and not first_only.hit_time_limit
    assert simulate(g, bounded.segments).peak_bytes <= budget
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert any("the finer rounds" in m for m in skipped), skipped
    assert "(stopped at the time limit)" in bounded.summary()
    # the unbounded solve improves on it, so the phases the bound skipped were worth something
    unbounded = solve(g, budget, max_stages=4)
    assert unbounded.recompute_ms < bounded.recompute_ms and not unbounded.hit_time_limit


def test_each_phase_gets_at_most_what_is_left(gpt2_graph, monkeypatch):
    """Every finer round and short-segment start is started with at least ``MIN_PHASE_S`` left
    and given no more than what is left; and each sees a clock that has moved on (here: every
    phase takes 0.8 s more), so later ones are cut and then skipped: at most 4 of the 5 start
    (at 0, 0.8, 1.6 and 2.4 s of 3 s at the latest; a slower machine starts fewer)."""
    g = gpt2_graph
    budget = int(simulate(g).peak_bytes * 0.8)
    max_solve_s = 3.0
    calls: list[tuple[str, float, float]] = []
    started = [0.0]

    def recorded(name, real, limit_position):
        def wrapper(*args, **kwargs):
            limit_s = kwargs["time_limit_s"] if "time_limit_s" in kwargs else args[limit_position]
            left_s = started[0] + max_solve_s - time.perf_counter()
            calls.append((name, limit_s, left_s))
            time.sleep(0.8)
            return real(*args, **kwargs)
        return wrapper

    finer = recorded("finer", finer_start.on_finer_stages, None)
    monkeypatch.setattr(finer_start, "on_finer_stages", finer)
    monkeypatch.setattr(short_start, "on_finer_stages", finer)
    monkeypatch.setattr(short_start, "short_segments_plan", recorded("short", short_start.short_segments_plan, 6))
    started[0] = time.perf_counter()
    plan = solve(g, budget, max_stages=4, max_solve_s=max_solve_s)
    assert calls, "no phase ran"
    for name, limit_s, left_s in calls:
        assert left_s >= MIN_PHASE_S - 0.05, (name, left_s)
        assert limit_s <= left_s + 0.05, (name, limit_s, left_s)
    # the 0.8 s phases cannot all fit: some were skipped
    assert plan.hit_time_limit
    assert len(calls) < 5, calls  # unbounded, this graph runs three finer passes and two short starts
    assert simulate(g, plan.segments).peak_bytes <= budget


def test_without_a_bound_nothing_is_cut():
    deadline = SolveDeadline(time.perf_counter() - 1e6, None)
    assert deadline.allows("anything") and deadline.cut(7.0) == 7.0 and not deadline.reached()
    assert deadline.left_s_or_none() is None


def test_a_bound_cuts_limits_and_a_nested_solve_gets_what_is_left():
    deadline = SolveDeadline(time.perf_counter(), 5.0)
    assert 4.0 < deadline.cut(60.0) <= 5.0 and deadline.cut(1.0) == 1.0
    assert 4.0 < deadline.left_s_or_none() <= 5.0 and not deadline.reached()
    spent = SolveDeadline(time.perf_counter() - 10.0, 5.0)
    assert spent.left_s_or_none() == pytest.approx(1e-3) and spent.cut(3.0) == pytest.approx(1e-3)
    assert spent.reached()  # the time is spent, even before a phase asks


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_a_bad_bound_is_refused(bad, gpt2_graph):
    with pytest.raises(InputError, match="max_solve_s must be a positive number of seconds"):
        solve(gpt2_graph, int(simulate(gpt2_graph).peak_bytes * 0.6), max_solve_s=bad)


def test_the_bound_reaches_the_solve_from_plan_for_budget_and_sweep(gpt2_graph, monkeypatch):
    seen: list[float | None] = []
    real = solve_module.solve

    def spy(graph, budget_bytes, options=None, **kwargs):
        seen.append(options.max_solve_s)
        return real(graph, budget_bytes, options, **kwargs)

    monkeypatch.setattr("planner.budget_plan.solve", spy)
    monkeypatch.setattr("planner.sweep.solve", spy)
    peak_gb = simulate(gpt2_graph).peak_bytes / 2**30
    plan_for_budget(gpt2_graph, peak_gb * 0.7, PlanOptions(max_stages=4, max_solve_s=2.0))
    sweep(gpt2_graph, [int(peak_gb * 0.8 * 2**30)], max_stages=4, max_solve_s=3.0)
    assert seen == [2.0, 3.0]


@pytest.mark.parametrize("command", [["plan", "models.py:build"], ["report", "saved.pt2"],
                                     ["check", "saved.pt2", "--baseline", "b.json"]])
def test_every_cli_command_takes_the_bound(command):
    from planner.cli import _parser

    budget = [] if command[0] == "check" else ["--budget-gb", "1"]
    args = _parser().parse_args([*command, *budget, "--max-solve-s", "5"])
    assert args.max_solve_s == 5.0
    assert _parser().parse_args([*command, *budget]).max_solve_s is None


def test_the_default_exact_search_with_a_plan_in_hand_is_capped(monkeypatch):
    """On a small graph the exact search runs by default; once a plan is in hand it can only
    make it cheaper or prove it, so it gets :data:`EXACT_IMPROVE_S`, not ``exact_s``;
    ``exact=True`` still gets ``time_limit_s``."""
    from graphs import mlp_blocks

    g = mlp_blocks(4)
    limits: list[float] = []
    search = exact_search.search_cheapest

    def recording(*args, time_limit_s, **kwargs):
        limits.append(time_limit_s)
        return search(*args, time_limit_s=time_limit_s, **kwargs)

    monkeypatch.setattr(exact_search, "search_cheapest", recording)
    budget = int(simulate(g).peak_bytes * 0.7)
    plan = solve(g, budget)
    assert plan.segments and limits and max(limits) <= exact_search.EXACT_IMPROVE_S < SolveOptions().exact_s
    limits.clear()
    solve(g, budget, exact=True, time_limit_s=40.0)
    assert limits and max(limits) > exact_search.EXACT_IMPROVE_S
