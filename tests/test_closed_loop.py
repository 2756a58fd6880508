"""The closed loop (planner.closed_loop.measured_plan) with a stand-in for the measured step:
which plan it returns given what each plan measures, torch-free and in milliseconds."""

from __future__ import annotations

import pytest

from planner.closed_loop import measured_plan
from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import Plan, Segment

ROOM = 1_000_000


def _plan(name: str, predicted_bytes: int, recompute_ms: float) -> Plan:
    return Plan(budget_bytes=ROOM, predicted_peak_bytes=predicted_bytes, unoptimized_peak_bytes=2 * ROOM,
                segments=(Segment((f"{name}_a", f"{name}_b"), recompute_ms, int(recompute_ms * 1e6)),),
                forward_ms=10.0, step_ms=30.0, forward_flops=10**8, solver=name, solve_s=0.0)


class StandIn:
    """The device of the loop: each plan measures what ``measured`` says; a solve again returns
    ``resolved``, or refuses where there is none; the smallest-peak plan is ``smallest_plan``
    (``resolved`` where None)."""

    def __init__(self, measured: dict[str, int], resolved: Plan | None, smallest_plan: Plan | None = None) -> None:
        self.measured, self.resolved, self.smallest_plan = measured, resolved, smallest_plan
        self.calls: list[str] = []

    def measure(self, candidate: Plan):
        self.calls.append(candidate.solver)
        return f"module of {candidate.solver}", self.measured[candidate.solver]

    def resolve(self, held_bytes: int, extra_room_bytes: int) -> Plan:
        if self.resolved is None:
            raise InfeasibleBudgetError(ROOM, ROOM + held_bytes)
        return self.resolved

    def smallest(self) -> Plan:
        chosen = self.smallest_plan or self.resolved
        assert chosen is not None
        return chosen


def _loop(plan: Plan, measured: dict[str, int], alternatives=(), resolved: Plan | None = None,
          smallest: Plan | None = None):
    device = StandIn(measured, resolved, smallest)
    module, chosen = measured_plan(plan, ROOM, margin_bytes=ROOM // 100, device=device,
                                   unoptimized_measured_bytes=2 * ROOM, alternatives=alternatives)
    return module, chosen, device.calls


def test_a_cheaper_plan_refused_by_the_margin_replaces_the_plan_when_it_measures_within_the_room() -> None:
    searched = _plan("search", 985_000, 5.0)
    every_layer = _plan("every layer", 1_004_000, 4.0)   # predicted over the room, measured under it
    module, chosen, calls = _loop(searched, {"search": 984_000, "every layer": 999_000}, [every_layer])
    assert chosen.solver == "every layer" and module == "module of every layer"
    assert chosen.measured_peak_bytes == 999_000
    assert calls == ["search", "every layer"]


def test_alternatives_that_measure_over_the_room_leave_the_plan_and_are_tried_in_order() -> None:
    searched = _plan("search", 985_000, 5.0)
    over = _plan("over", 1_010_000, 3.0)
    fits = _plan("fits", 1_002_000, 4.0)
    _, chosen, calls = _loop(searched, {"search": 984_000, "over": 1_000_001, "fits": 1_000_000}, [over, fits])
    assert chosen.solver == "fits" and calls == ["search", "over", "fits"]
    _, chosen, calls = _loop(searched, {"search": 984_000, "over": 1_000_001}, [over])
    assert chosen.solver == "search" and chosen.measured_peak_bytes == 984_000


def test_alternatives_are_not_measured_once_the_plan_was_solved_again() -> None:
    searched = _plan("search", 985_000, 5.0)
    again = _plan("again", 900_000, 6.0)
    alternative = _plan("alternative", 1_001_000, 4.0)
    _, chosen, calls = _loop(searched, {"search": 1_050_000, "again": 950_000, "alternative": 990_000},
                             [alternative], resolved=again)
    # the alternatives were priced against the first plan's prediction, which measured wrong
    assert chosen.solver == "again" and "alternative" not in calls


def test_a_plan_that_never_measures_within_the_room_is_refused() -> None:
    searched = _plan("search", 985_000, 5.0)
    with pytest.raises(InfeasibleBudgetError):
        _loop(searched, {"search": 1_050_000}, resolved=searched)


def test_where_nothing_fits_with_the_overshoot_held_the_smallest_peak_plan_is_measured_and_taken() -> None:
    """Near the floor a cheaper plan can measure above the room while the plan of the smallest
    predicted peak fits: a budget the planner named as its floor then plans."""
    searched = _plan("search", 990_000, 5.0)
    floor = _plan("floor", 960_000, 9.0)
    module, chosen, calls = _loop(searched, {"search": 1_004_000, "floor": 997_000}, resolved=None, smallest=floor)
    assert chosen.solver == "floor" and chosen.measured_peak_bytes == 997_000 and module == "module of floor"
    assert calls == ["search", "floor"]
    with pytest.raises(InfeasibleBudgetError) as refused:  # the floor measures over too: refused, by the lower
        _loop(searched, {"search": 1_004_000, "floor": 1_002_000}, resolved=None, smallest=floor)
    assert refused.value.min_feasible_bytes == ROOM + 2_000
