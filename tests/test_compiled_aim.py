"""Where an eager plan is aimed so that its compiled step lands in the room (torch-free)."""

from __future__ import annotations

import pytest

from planner.compiled_aim import SLOPE_RANGE, PeakPair, eager_target_bytes, within_bracket


def test_first_target_is_on_the_line_through_the_held_bytes_and_the_unoptimized_pair() -> None:
    # compile keeps 60 % of the activations above 100 held bytes: 1100 eager -> 700 compiled
    pairs = [PeakPair(1100, 700)]
    target = eager_target_bytes(pairs, compiled_target_bytes=400, fixed_bytes=100)
    assert target == 600  # 100 + (400 - 100) / 0.6
    assert 100 + 0.6 * (target - 100) == pytest.approx(400)


def test_later_targets_follow_the_last_two_measured_pairs() -> None:
    # the first plan saved less under compile than the unoptimized step did: the line is steeper
    pairs = [PeakPair(1100, 700), PeakPair(600, 450)]
    assert eager_target_bytes(pairs, compiled_target_bytes=400, fixed_bytes=100) == 500  # slope 0.5


def test_a_target_above_the_last_measurement_aims_higher() -> None:
    pairs = [PeakPair(1100, 700), PeakPair(600, 300)]  # slope 0.8: 100 bytes of room left
    assert eager_target_bytes(pairs, compiled_target_bytes=400, fixed_bytes=100) == 725


def test_a_flat_or_falling_line_falls_back_to_the_held_bytes() -> None:
    flat = [PeakPair(1100, 700), PeakPair(900, 500), PeakPair(800, 500)]
    rising = [PeakPair(1100, 700), PeakPair(900, 500), PeakPair(800, 520)]
    for pairs in (flat, rising):
        last = pairs[-1]
        slope = (last.compiled_measured_bytes - 100) / (last.eager_predicted_bytes - 100)
        expected = round(last.eager_predicted_bytes + (400 - last.compiled_measured_bytes) / slope)
        assert eager_target_bytes(pairs, compiled_target_bytes=400, fixed_bytes=100) == expected
        assert expected < last.eager_predicted_bytes


def test_no_usable_line_keeps_the_last_target() -> None:
    # the held bytes equal the last pair's eager peak: no line through them
    assert eager_target_bytes([PeakPair(500, 500)], compiled_target_bytes=400, fixed_bytes=500) == 500
    assert SLOPE_RANGE[0] < 1 < SLOPE_RANGE[1]


def test_no_pairs_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        eager_target_bytes([], compiled_target_bytes=400, fixed_bytes=100)


def test_a_target_outside_the_measured_bracket_is_its_midpoint() -> None:
    # the plan predicted at 1000 compiled over the room of 500, the one at 700 far under it
    pairs = [PeakPair(1100, 700), PeakPair(1000, 560), PeakPair(700, 380)]
    assert within_bracket(1050, pairs, room_bytes=500) == 850  # above the lowest overshoot
    assert within_bracket(650, pairs, room_bytes=500) == 850   # below the highest fit
    assert within_bracket(900, pairs, room_bytes=500) == 900   # inside: the line's target stands


def test_without_a_measurement_on_both_sides_the_target_stands() -> None:
    over_only = [PeakPair(1100, 700), PeakPair(1000, 560)]
    fit_only = [PeakPair(700, 380)]
    assert within_bracket(1200, over_only, room_bytes=500) == 1200
    assert within_bracket(300, fit_only, room_bytes=500) == 300
    # a fit above every overshoot (compiled peaks need not rise with the eager one): no bracket
    assert within_bracket(300, [PeakPair(900, 450), PeakPair(800, 520)], room_bytes=500) == 300


def _four_layers(matmuls: bool = False):
    """Four layers of two ops each (a relu and, with ``matmuls``, an addmm), 100 bytes an output."""
    from planner.core.costgraph import CostGraph, CostNode, Storage

    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    for i in range(1, 9):
        op = "aten.addmm.default" if matmuls and i % 2 else "aten.relu.default"
        nodes.append(CostNode(f"n{i}", op, input_names=(nodes[-1].name,), output_storages=(i,), saved_storages=(i,),
                              output_bytes=100, requires_grad=True, time_ms=1.0, flops=1000 if "addmm" in op else 0,
                              selective_save=matmuls, module=f"layers.{(i - 1) // 2}"))
    return CostGraph(tuple(nodes), tuple(Storage(i, 100, i == 0) for i in range(9)), ("n8",))


def test_hand_plans_to_compile_skip_those_above_a_plan_that_measured_over_the_room() -> None:
    from planner.compiled_aim import hand_plans_to_compile
    from planner.core.simulate import simulate

    graph = _four_layers()
    pairs = [PeakPair(simulate(graph).peak_bytes, 900)]
    first = hand_plans_to_compile(graph, pairs, room_bytes=800, budget_bytes=800, limit=10)
    assert [p.predicted_peak_bytes for p in first] == [1000, 900, 800]  # nearest the aim (975) first
    assert all(p.budget_bytes == 800 and p.solver.startswith("hand-placed: every") for p in first)
    pairs.append(PeakPair(900, 820))  # a plan predicted at 900 eager measured over the room
    assert [p.predicted_peak_bytes for p in hand_plans_to_compile(graph, pairs, 800, 800, limit=10)] == [800]
    assert hand_plans_to_compile(graph, pairs, 800, 800, limit=0) == []


def test_hand_plans_to_compile_keep_matmul_outputs_only_where_an_operator_policy_can() -> None:
    """Compiled, a segment keeps outputs by operator: the save-matmuls plans are candidates
    (the cheapest one expected to fit first), unless a kept matmul decomposes into an operator
    the segment also recomputes."""
    import dataclasses

    from planner.compiled_aim import hand_plans_to_compile
    from planner.core.simulate import simulate
    from planner.solvers.hand_policies import hand_placed_plans

    graph = _four_layers(matmuls=True)
    assert any(s.kept_nodes for hand in hand_placed_plans(graph) for s in hand.segments)
    pairs = [PeakPair(simulate(graph).peak_bytes, 900)]
    plans = hand_plans_to_compile(graph, pairs, 800, 800, limit=20)
    kept = [p for p in plans if any(s.kept_nodes for s in p.segments)]
    assert kept and all(graph.node(n).op == "aten.addmm.default" for p in kept for s in p.segments
                        for n in s.kept_nodes)
    assert len({p.segments for p in plans}) == len(plans)
    aim = 975  # the eager peak the pair expects to compile to the room
    fitting = [p for p in kept if p.predicted_peak_bytes <= aim]
    assert fitting and plans[0] is min(fitting, key=lambda p: p.recompute_ms)

    # a kept linear runs as mm compiled: with an mm recomputed beside it, no operator policy
    clash = dataclasses.replace(graph, nodes=tuple(
        dataclasses.replace(n, op="aten.linear.default") if n.op == "aten.addmm.default"
        else dataclasses.replace(n, op="aten.mm.default", selective_save=False) if n.op == "aten.relu.default"
        else n for n in graph.nodes))
    assert any(s.kept_nodes for hand in hand_placed_plans(clash) for s in hand.segments)
    assert all(not s.kept_nodes for p in hand_plans_to_compile(clash, pairs, 800, 800, limit=20) for s in p.segments)


def test_after_a_matmul_keeping_plan_measured_over_the_room_some_segments_are_recomputed_whole() -> None:
    """Compiled, keeping matmul outputs in every segment can miss a budget a whole-segment plan
    meets at more cost: the plans recomputing the first segments whole and keeping matmul
    outputs in the rest are candidates, aimed from the keeping plans' own measurements."""
    from planner.compiled_aim import hand_plans_to_compile
    from planner.core.simulate import simulate

    graph = _four_layers(matmuls=True)
    pairs = [PeakPair(simulate(graph).peak_bytes, 900)]
    plans = hand_plans_to_compile(graph, pairs, 800, 800, limit=50)
    partly = [p for p in plans if "matmul outputs kept in the last" in p.solver]
    assert partly
    for plan in partly:  # whole segments first, then segments that keep their matmul outputs
        kept = [bool(s.kept_nodes) for s in plan.segments]
        assert kept == sorted(kept) and kept[-1] and not kept[0]
        assert all(not s.kept_nodes or all(graph.node(n).op == "aten.addmm.default" for n in s.kept_nodes)
                   for s in plan.segments)
    first = plans[0]
    assert any(s.kept_nodes for s in first.segments)
    # that plan measured over the room: the next candidate keeps matmul outputs in fewer segments,
    # aimed by the line through that measurement, and predicts a lower eager peak
    pairs.append(PeakPair(first.predicted_peak_bytes, 860, kept_matmuls=True))
    following = hand_plans_to_compile(graph, pairs, 800, 800, limit=1)
    assert following and following[0].predicted_peak_bytes < first.predicted_peak_bytes
    assert any(s.kept_nodes for s in following[0].segments)
