"""The figures of ``benchmarks/plan_stability.py``, on hand-made chains with chosen node times."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from graphs import MIB, chain
from planner.core.plan import Plan, Segment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_stability import Row, cost_gaps, plan_key, row_cells, summary, timing_spread  # noqa: E402


def _plan(*segments: tuple[str, ...], budget_bytes: int = 64 * MIB) -> Plan:
    return Plan(budget_bytes, 0, 0, tuple(Segment(names, 1.0, 10) for names in segments), 4.0, 12.0, 40, "test", 0.0)


def test_plans_are_the_same_by_their_segments_and_kept_nodes() -> None:
    assert plan_key(_plan(("n1", "n2"), ("n3",))) == plan_key(_plan(("n3",), ("n1", "n2")))
    assert plan_key(_plan(("n1", "n2"))) != plan_key(_plan(("n1",), ("n2",)))
    assert plan_key(None) == ("infeasible",)


def test_a_flip_is_priced_on_the_flipped_runs_own_profile() -> None:
    graphs = [chain([1, 1, 1, 1], [1.0, 2.0, 1.0, 1.0]), chain([1, 1, 1, 1], [1.0, 2.0, 1.0, 1.0]),
              chain([1, 1, 1, 1], [1.0, 1.0, 1.1, 1.0])]
    common, flipped = _plan(("n2",)), _plan(("n3",))
    row = Row("chain", "budget", 64 * MIB, [common, common, flipped], resolved_same=True)
    # on the third profile n2 takes 1.0 ms and n3 1.1 ms: the run chose the dearer plan
    assert cost_gaps(row, graphs) == [pytest.approx(1.0 / 1.1 - 1)]
    text = summary({"chain": ([row], graphs)})
    assert text.startswith("Plans flipped in 1 of 1 model-budget rows: 1 of 3 runs chose another plan")
    assert "0 of the 1 flipped runs chose a plan recomputing other FLOPs" in text
    assert text.endswith("gave its plan again in 1 of 1 rows.")


def test_most_common_plan_that_does_not_fit_a_flipped_run_is_named() -> None:
    graphs = [chain([1, 1, 1, 1]), chain([1, 1, 1, 1])]
    row = Row("chain", "budget", 5 * MIB, [_plan(budget_bytes=5 * MIB), _plan(("n1", "n2"), budget_bytes=5 * MIB)])
    row.plans.append(row.plans[0])
    assert cost_gaps(row, [*graphs, graphs[0]]) is None  # nothing recomputed peaks above 5 MiB


def test_timing_spread_is_zero_for_equal_profiles_and_grows_with_a_moved_node() -> None:
    same = timing_spread([chain([1, 1, 1], [1.0, 2.0, 3.0])] * 3)
    assert same["median"] == same["p90"] == same["step"] == 0.0 and same["nodes"] == 3
    moved = timing_spread([chain([1, 1, 1], [1.0, 2.0, 3.0]), chain([1, 1, 1], [1.0, 2.0, 6.0])])
    assert moved["median"] == 0.0 and moved["p90"] == pytest.approx(1 / 3)


def test_plans_from_the_profile_cache_are_counted_per_row() -> None:
    graphs = [dataclasses.replace(chain([1, 1, 1, 1], [1.0, 2.0, 1.0, 1.0]), step_ms=10.0)] * 2
    steady = Row("chain", "budget", 64 * MIB, [_plan(("n2",))] * 2, resolved_same=True,
                 cached_plans=[_plan(("n2",))] * 3, cached_profiled=1)
    moved = Row("chain", "other", 64 * MIB, [_plan(("n2",))] * 2, resolved_same=True,
                cached_plans=[_plan(("n2",)), _plan(("n3",)), _plan(("n2",))], cached_profiled=3)
    assert row_cells(steady, graphs)[-1] == "1 (1 of 3 calls profiled)"
    assert row_cells(moved, graphs)[-1] == "2 (3 of 3 calls profiled)"
    assert row_cells(Row("chain", "b", 64 * MIB, [_plan()]), graphs[:1])[-1] == "- (no cache on this path)"
    text = summary({"chain": ([steady, moved], graphs)})
    assert text.endswith("1 of 2 rows on the captured-graph path gave one plan in every call (4 of 6 calls "
                         "profiled, the others read the first profile).")
