"""The per-block start's first finer round: it runs on more stages than the other starts' rounds
may, keeps to its candidate limit, and never makes the solve's plan dearer."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest

from planner import simulate, solve
from planner.solvers.hand_policies import hand_placed_plans
from profiling.cache import load_profile

short_start = importlib.import_module("planner.solvers.starts.short_segments")
PROFILE = Path(__file__).parent / "data" / "gpt2_4layer_profile.json"


@pytest.fixture(scope="module")
def gpt2():
    return load_profile(PROFILE)


def _budget(graph, policy: str) -> int:
    plan = next(p for p in hand_placed_plans(graph) if p.name == policy)
    return simulate(graph, plan.segments).peak_bytes


def _round_after_per_block_start(messages: list[str]) -> list[str]:
    """The finer-stage messages between the first short-segment start (the per-block one) and
    the next start."""
    start = next(i for i, m in enumerate(messages) if m.startswith("short segments on"))
    found = []
    for message in messages[start + 1:]:
        if message.startswith("short segments on"):
            break
        if message.startswith(("finer stages:", "more than")):
            found.append(message)
    return found


def test_the_per_block_start_rounds_on_more_than_a_quarter_of_the_compute_nodes(gpt2, caplog):
    """The 4-layer GPT-2 (222 compute nodes): the per-block start's 65 stages doubled pass half
    the compute nodes, where the other starts' rounds stop; this round runs."""
    with caplog.at_level(logging.INFO, logger="planner.solvers.solve"):
        solve(gpt2, _budget(gpt2, "every layer"))
    logged = [r.getMessage() for r in caplog.records]
    start_stages = int(re.match(r"short segments on (\d+) stages", next(
        m for m in logged if m.startswith("short segments on"))).group(1))
    assert 4 * start_stages > len(gpt2.compute_nodes)  # where the other starts' rounds stop
    messages = _round_after_per_block_start(logged)
    assert messages and messages[0].startswith("finer stages:")
    assert int(re.match(r"finer stages: (\d+) stages", messages[0]).group(1)) > start_stages


def test_the_round_keeps_to_its_candidate_limit(gpt2, caplog, monkeypatch):
    monkeypatch.setattr(short_start, "PER_BLOCK_ROUND_MAX_CANDIDATES", 10)
    with caplog.at_level(logging.INFO, logger="planner.solvers.solve"):
        solve(gpt2, _budget(gpt2, "every layer"))
    messages = _round_after_per_block_start([r.getMessage() for r in caplog.records])
    assert messages[1:] == ["more than 10 candidate segments: no further round"]


@pytest.mark.parametrize("policy", ["every layer", "every 2nd layer"])
def test_the_round_never_makes_the_plan_dearer(gpt2, policy, monkeypatch):
    budget = _budget(gpt2, policy)
    with_round = solve(gpt2, budget)
    monkeypatch.setattr(short_start, "PER_BLOCK_ROUND_MAX_CANDIDATES", 0)
    without = solve(gpt2, budget)
    assert with_round.predicted_peak_bytes <= budget
    assert with_round.recompute_ms <= without.recompute_ms + 1e-9


def test_a_shape_projected_past_the_label_cap_is_not_solved(gpt2, caplog, monkeypatch):
    """With the DP's cap just above what the first solved start kept, the next, larger start
    projects past it and is skipped, logged with its projection; the plan still fits."""
    budget = _budget(gpt2, "every layer")
    with caplog.at_level(logging.DEBUG, logger="planner.solvers.solve"):
        solve(gpt2, budget)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("skipped: about" in m for m in messages)  # the default cap projects every start within it
    start = next(i for i, m in enumerate(messages) if m.startswith("short segments on"))
    first = next(m for m in messages[:start][::-1] if m.startswith("chain DP on"))
    stages, labels = (int(v) for v in re.match(r"chain DP on (\d+) stages, \d+ segments: (\d+) labels", first).groups())
    monkeypatch.setattr(short_start, "DEFAULT_MAX_LABELS", labels + 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="planner.solvers.solve"):
        plan = solve(gpt2, budget)
    skipped = [m for m in (r.getMessage() for r in caplog.records) if "skipped: about" in m]
    assert skipped, "a start of more stages than the solved one projects past a cap of its own labels"
    more = int(re.match(r"short segments on (\d+) stages", skipped[0]).group(1))
    assert more > stages
    assert f"about {short_start.projected_labels(stages, labels, more)} labels" in skipped[0]
    assert plan.predicted_peak_bytes <= budget
