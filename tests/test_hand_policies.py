"""Never lose to the plans a person writes by hand: checkpoint every k-th layer, with or without
the matmul outputs kept. On the H100 profiles in ``tests/data/h100`` and on hand-made
graphs, at each hand-placed plan's own simulated peak, the solver's plan fits and costs no more."""

from __future__ import annotations

import dataclasses

import pytest

from graphs import MIB
from h100_profiles import H100_PROFILES as H100
from planner.core.costgraph import CostGraph, CostNode, Storage, protect_reads_before_writes
from planner.solvers.hand_policies import hand_placed_plans, repeated_blocks
from planner.core.simulate import simulate
from planner.solvers.solve import solve
from profiling.cache import load_profile

PROFILES = ["gpt2_gpu", "llama_gpu", "bert_gpu", "t5_gpu", "mlp_gpu", "gpt2_24l_gpu"]


def layered(layers: int, ops_per_layer: int = 4, head_mib: float = 0.0) -> CostGraph:
    """A chain of ``layers`` blocks under ``layers.<i>``, each op saving its output; uneven sizes and
    times, so the cheapest plan is not a uniform one; an optional head outside the layers."""
    storages = [Storage(0, MIB, persistent=True)]
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for i in range(layers * ops_per_layer):
        size = (1 + (i * 7) % 5) * MIB
        key = len(storages)
        storages.append(Storage(key, size))
        nodes.append(CostNode(f"n{i}", "aten.linear.default" if i % 2 else "aten.gelu.default",
                              input_names=(nodes[-1].name,), output_storages=(key,), saved_storages=(key,),
                              output_bytes=size, requires_grad=True, time_ms=1.0 + (i * 3) % 4, flops=10,
                              module=f"layers.{i // ops_per_layer}.op", selective_save=True))
    if head_mib:
        key = len(storages)
        storages.append(Storage(key, int(head_mib * MIB)))
        nodes.append(CostNode("head", "aten.linear.default", input_names=(nodes[-1].name,), output_storages=(key,),
                              saved_storages=(key,), output_bytes=int(head_mib * MIB), requires_grad=True,
                              time_ms=2.0, module="head"))
    return CostGraph(tuple(nodes), tuple(storages), (nodes[-1].name,))


def test_repeated_blocks_come_from_module_paths():
    graph = layered(5, head_mib=3.0)
    (stack,) = repeated_blocks(graph)
    assert [len(block) for block in stack] == [4] * 5
    assert "head" not in {name for block in stack for name in block}
    names = [p.name for p in hand_placed_plans(graph)]
    assert names[:2] == ["every layer", "every layer, matmul outputs kept"]
    assert "every 4th layer" in names


def test_a_graph_without_module_lists_or_repeats_has_no_hand_placed_plans():
    graph = layered(3)  # op sizes repeat every 10 nodes: no layer of 4 shows in the structure
    graph = dataclasses.replace(graph, nodes=tuple(dataclasses.replace(n, module="") for n in graph.nodes))
    assert repeated_blocks(graph) == [] and hand_placed_plans(graph) == []


def _assert_never_loses(graph: CostGraph, **options) -> None:
    checked = 0
    for hand in hand_placed_plans(graph):
        budget = simulate(graph, hand.segments).peak_bytes
        if budget >= simulate(graph).peak_bytes:
            continue
        plan = solve(graph, budget, **options)
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_ms <= hand.recompute_ms + 1e-9, (hand.name, plan.recompute_ms, hand.recompute_ms)
        checked += 1
    assert checked


@pytest.mark.parametrize("layers", [3, 8, 24])
def test_the_solver_never_costs_more_than_a_hand_placed_plan_that_fits(layers):
    _assert_never_loses(layered(layers, head_mib=6.0))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("t5_gpu", "gpt2_24l_gpu") else n
                                  for n in PROFILES])
def test_on_the_h100_profiles_every_layer_and_its_matmul_policy_never_win(name):
    graph = protect_reads_before_writes(load_profile(H100 / f"{name}.json"))
    every_layer, *_ = hand_placed_plans(graph)
    assert every_layer.name == "every layer"
    budget = simulate(graph, every_layer.segments).peak_bytes
    plan = solve(graph, budget)
    assert plan.predicted_peak_bytes <= budget
    assert plan.recompute_ms <= every_layer.recompute_ms + 1e-9


def test_within_the_timing_noise_the_hand_placed_plan_with_fewer_flops_wins():
    from planner.core.plan import Plan, Segment
    from planner.core.rerun import rerun_cost
    from planner.solvers.hand_policies import HAND_PLAN_TIME_TOLERANCE, hand_placed_within_noise

    graph = layered(4)
    every = next(h for h in hand_placed_plans(graph) if h.name == "every layer")
    budget = simulate(graph, every.segments).peak_bytes  # every layer's own peak: the others do not fit
    flops = sum(s.recompute_flops for s in every.segments)

    def searched(ms_share: float, flops_extra: int) -> Plan:
        """A search's plan: every layer's segments, priced ``ms_share`` of the hand plan's time
        with ``flops_extra`` more FLOPs (what a plan cutting elsewhere costs)."""
        segments = tuple(dataclasses.replace(s, recompute_ms=s.recompute_ms * ms_share,
                                             recompute_flops=s.recompute_flops + flops_extra)
                         for s in every.segments)
        return Plan(budget, simulate(graph, segments).peak_bytes, budget, segments, graph.forward_ms, graph.step_ms,
                    graph.forward_flops, "search", 0.0)

    assert rerun_cost(graph, every.segments[0].node_names)[1] == every.segments[0].recompute_flops
    near = searched(1 / (1 + HAND_PLAN_TIME_TOLERANCE / 2), 5)
    close = hand_placed_within_noise(graph, near, budget)
    # a hand-placed plan (the fewest FLOPs of those that fit) within the noise of the search's time
    assert close.solver.startswith("hand-placed: ") and close.predicted_peak_bytes <= budget
    assert sum(s.recompute_flops for s in close.segments) <= flops < sum(s.recompute_flops for s in near.segments)
    assert close.recompute_ms <= near.recompute_ms * (1 + HAND_PLAN_TIME_TOLERANCE)
    far = searched(1 / (1 + 2 * HAND_PLAN_TIME_TOLERANCE), 5)
    assert hand_placed_within_noise(graph, far, budget) is far  # cheaper beyond the noise: kept
    fewer = searched(1.0, -1)
    assert hand_placed_within_noise(graph, fewer, budget) is fewer  # no more FLOPs than the hand plan: kept


def test_on_a_profile_timed_on_a_busy_machine_the_noise_is_the_measured_spread():
    """A profile whose node passes spread by 40 % cannot tell a plan 20 % cheaper from the hand
    plan: there the hand plan with fewer FLOPs wins; on a quiet profile the search's is kept."""
    from planner.core.plan import Plan
    from planner.solvers.hand_policies import HAND_PLAN_TIME_TOLERANCE, hand_placed_within_noise

    quiet = layered(4)
    busy = dataclasses.replace(quiet, metadata={**quiet.metadata, "timing_spread": 0.4})
    every = next(h for h in hand_placed_plans(quiet) if h.name == "every layer")
    budget = simulate(quiet, every.segments).peak_bytes
    share = 1 / (1 + 2 * HAND_PLAN_TIME_TOLERANCE)  # beyond the fixed tolerance, within the spread
    segments = tuple(dataclasses.replace(s, recompute_ms=s.recompute_ms * share, recompute_flops=s.recompute_flops + 5)
                     for s in every.segments)
    searched = Plan(budget, simulate(quiet, segments).peak_bytes, budget, segments, quiet.forward_ms, quiet.step_ms,
                    quiet.forward_flops, "search", 0.0)
    assert hand_placed_within_noise(quiet, searched, budget) is searched
    assert hand_placed_within_noise(busy, searched, budget).solver.startswith("hand-placed: ")
