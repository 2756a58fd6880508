"""What a checkpointed segment's recompute reruns (planner.core.rerun), without torch: the rule on
hand-made segments, and the solvers' O(1) run costs against it on random graphs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import MIB, random_dag
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.solvers.keep import segment_with_kept
from planner.core.rerun import ChainCosts, rerun_cost, rerun_node_names


def mlp_block() -> CostGraph:
    """x -> up (linear: saves x) -> relu (saves its output) -> down (linear: saves relu's output)
    -> add (saves nothing)."""
    storages = (Storage(0, MIB, persistent=True), Storage(1, MIB, persistent=True), *(Storage(k, MIB) for k in (2, 3, 4, 5)))
    nodes = (
        CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        CostNode("w", "get_attr", kind="param", output_storages=(1,), requires_grad=True),
        CostNode("up", "linear", input_names=("x", "w"), output_storages=(2,), saved_storages=(0, 1),
                 time_ms=4.0, flops=400),
        CostNode("relu", "relu", input_names=("up",), output_storages=(3,), saved_storages=(3,), time_ms=1.0),
        CostNode("down", "linear", input_names=("relu", "w"), output_storages=(4,), saved_storages=(3, 1),
                 time_ms=4.0, flops=400),
        CostNode("add", "add", input_names=("down", "x"), output_storages=(5,), time_ms=0.5),
    )
    return CostGraph(nodes, storages, output_names=("add",))


def test_recompute_stops_before_a_last_node_that_saves_only_its_inputs():
    g = mlp_block()
    segment = ("up", "relu", "down", "add")
    assert rerun_node_names(g, segment) == ("up", "relu")
    assert rerun_cost(g, segment) == (5.0, 400)
    assert rerun_node_names(g, ("up", "relu")) == ("up", "relu")  # relu saves what it made
    assert rerun_node_names(g, ("down", "add")) == ()  # down saves before its matmul; add saves nothing
    assert rerun_node_names(g, ("add",)) == ()


def with_fraction(g: CostGraph, name: str, fraction: float) -> CostGraph:
    nodes = tuple(dataclasses.replace(n, after_last_save_fraction=fraction) if n.name == name else n for n in g.nodes)
    return dataclasses.replace(g, nodes=nodes)


def test_a_measured_fraction_overrides_the_inferred_one():
    g = mlp_block()
    measured = with_fraction(g, "relu", 0.25)
    assert rerun_cost(measured, ("up", "relu")) == (4.75, 400)
    half_linear = with_fraction(g, "down", 0.5)
    assert rerun_node_names(half_linear, ("relu", "down")) == ("relu", "down")
    assert rerun_cost(half_linear, ("relu", "down")) == (3.0, 200)
    with pytest.raises(ValueError, match="after_last_save_fraction"):
        CostNode("bad", "op", after_last_save_fraction=1.5)


def test_a_timed_share_prices_time_and_the_flop_share_prices_flops():
    g = with_fraction(mlp_block(), "down", 0.5)
    timed = dataclasses.replace(g, nodes=tuple(
        dataclasses.replace(n, after_last_save_time_fraction=0.25) if n.name in ("down", "relu") else n
        for n in g.nodes))
    # down stops partway: 3/4 of its time and half its FLOPs rerun
    assert rerun_cost(timed, ("relu", "down")) == (1.0 + 3.0, 200)
    assert ChainCosts(timed, ("relu", "down")).time_ms(0, 1) == 4.0
    # relu saves its own output when done (share 0): a timed share cannot move that
    assert rerun_cost(timed, ("up", "relu")) == (5.0, 400)
    with pytest.raises(ValueError, match="after_last_save_time_fraction"):
        CostNode("bad", "op", after_last_save_time_fraction=-0.1)


def test_kept_nodes_and_skipped_nodes_are_not_recomputed():
    g = mlp_block()
    segment = segment_with_kept(g, ("up", "relu", "down", "add"), {"up"})
    assert segment.kept_nodes == ("up",)
    assert segment.skipped_nodes == ("down", "add")
    assert (segment.recompute_ms, segment.recompute_flops) == (1.0, 0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 14))
def test_chain_costs_match_the_rule_on_every_run(seed, n):
    g = dataclasses.replace(random_dag(seed, n), segment_overhead_ms=0.25 * (seed % 2),
                            range_overhead_ms_per_node=0.01 * (seed % 3))
    names = [node.name for node in g.compute_nodes]
    costs = ChainCosts(g, names)
    for first in range(len(names)):
        for last in range(first, len(names)):
            time_ms, flops = rerun_cost(g, names[first : last + 1])
            assert costs.time_ms(first, last) == pytest.approx(time_ms, abs=1e-9)
            assert costs.flops(first, last) == flops


@pytest.mark.parametrize("overhead, per_node", [({"segment_overhead_ms": 0.5}, False),
                                                ({"range_overhead_ms_per_node": 0.125}, True)])
def test_a_segment_that_recomputes_pays_its_overheads(overhead, per_node):
    """``segment_overhead_ms`` is added once to every segment whose backward recomputes (it
    saves something), whatever its length; ``range_overhead_ms_per_node`` (the graph-break path's
    recording and replay) once for each of its nodes, those after its last save included (the
    forward records them too). A segment that saves nothing recomputes nothing and pays neither."""
    g = dataclasses.replace(random_dag(3, 6), **overhead)
    plain = dataclasses.replace(g, **{name: 0.0 for name in overhead})
    amount = next(iter(overhead.values()))
    names = [node.name for node in g.compute_nodes]
    for last in range(len(names)):
        run = names[: last + 1]
        saves = any(g.node(name).saved_storages for name in run)
        expected = amount * (len(run) if per_node else 1) if saves else 0.0
        assert rerun_cost(g, run)[0] == pytest.approx(rerun_cost(plain, run)[0] + expected)
        assert rerun_cost(g, run)[1] == rerun_cost(plain, run)[1]
