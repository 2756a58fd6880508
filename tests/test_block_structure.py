"""Repeated blocks from the graph's structure alone (:mod:`planner.solvers.block_structure`): on
graphs whose module paths are removed, the stacks and the hand-placed plans built on them are
those the module paths give, on the H100 profiles and on generated layered graphs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from graphs import MIB
from h100_profiles import H100_PROFILES as H100
from planner.core.costgraph import CostGraph, CostNode, Storage, protect_reads_before_writes
from planner.core.simulate import simulate
from planner.solvers.block_structure import structural_blocks
from planner.solvers.hand_policies import hand_placed_plans, repeated_blocks
from profiling.cache import load_profile

OPS = ("aten.linear.default", "aten.gelu.default", "aten.add.Tensor", "aten.layer_norm.default", "aten.mul.Tensor")


def _without_paths(graph: CostGraph) -> CostGraph:
    return dataclasses.replace(graph, nodes=tuple(dataclasses.replace(n, module="") for n in graph.nodes))


def _stacked(block_ops: list[tuple[str, int]], layers: int, prefix: int, suffix: int) -> CostGraph:
    """``prefix`` odd ops, ``layers`` copies of ``block_ops`` (op, MiB) each adding a residual
    read by the next block's first op, then ``suffix`` odd ops; all saving their outputs."""
    storages = [Storage(0, MIB, persistent=True)]
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]

    def add(op: str, mib: int, inputs: tuple[str, ...]) -> str:
        key = len(storages)
        storages.append(Storage(key, mib * MIB))
        nodes.append(CostNode(f"n{key}", op, input_names=inputs, output_storages=(key,), saved_storages=(key,),
                              output_bytes=mib * MIB, requires_grad=True, time_ms=1.0))
        return nodes[-1].name

    last = "x"
    for i in range(prefix):
        last = add(f"aten.prefix_{i}.default", 3, (last,))
    for _ in range(layers):
        residual = last
        for op, mib in block_ops:
            last = add(op, mib, (last,))
        last = add("aten.add.Tensor", 1, (last, residual))
    for i in range(suffix):
        last = add(f"aten.suffix_{i}.default", 5, (last,))
    return CostGraph(tuple(nodes), tuple(storages), (last,))


@pytest.mark.parametrize("seed", range(12))
def test_generated_layers_are_found_with_their_boundaries(seed):
    rng = random.Random(seed)
    block = [(rng.choice(OPS), rng.randint(2, 6)) for _ in range(rng.randint(2, 9))]
    layers, prefix, suffix = rng.randint(3, 12), rng.randint(0, 4), rng.randint(0, 4)
    graph = _stacked(block, layers, prefix, suffix)
    (stack,) = structural_blocks(graph)
    assert len(stack) == layers
    # each block starts where only the residual stream (1 MiB) crosses: the layer's first op
    names = [n.name for n in graph.compute_nodes]
    assert [names.index(b[0]) for b in stack] == [prefix + i * (len(block) + 1) for i in range(layers)]


def test_a_chain_without_repeats_has_no_structural_blocks():
    graph = _stacked([], 0, 6, 6)
    assert structural_blocks(graph) == []


@pytest.mark.parametrize("name", ["gpt2_gpu", "llama_gpu", "bert_gpu", "mlp_gpu", "gpt2_24l_gpu"])
def test_h100_profiles_without_module_paths_get_the_same_hand_placed_plans(name):
    graph = protect_reads_before_writes(load_profile(H100 / f"{name}.json"))
    bare = _without_paths(graph)
    by_path = [len(stack) for stack in repeated_blocks(graph)]
    by_structure = [len(stack) for stack in repeated_blocks(bare)]
    assert by_structure == by_path
    with_paths = {p.name: p for p in hand_placed_plans(graph)}
    bare_plans = {p.name: p for p in hand_placed_plans(bare)}
    for policy in ("every layer", "every 2nd layer"):
        peak_bytes = simulate(graph, with_paths[policy].segments).peak_bytes
        assert simulate(graph, bare_plans[policy].segments).peak_bytes == peak_bytes
        assert bare_plans[policy].recompute_ms == pytest.approx(with_paths[policy].recompute_ms)


def test_t5_without_module_paths_finds_both_stacks_of_identical_layers():
    # T5's first layer of each stack also computes the relative position bias: only the five
    # identical layers after it repeat, so they make the stacks
    bare = _without_paths(protect_reads_before_writes(load_profile(H100 / "t5_gpu.json")))
    assert [len(stack) for stack in structural_blocks(bare)] == [5, 5]


def test_without_module_paths_the_solver_still_never_loses_to_every_layer():
    graph = protect_reads_before_writes(load_profile(H100 / "gpt2_gpu.json"))
    every_layer = {p.name: p for p in hand_placed_plans(graph)}["every layer"]
    budget_bytes = simulate(graph, every_layer.segments).peak_bytes
    from planner.solvers.solve import solve

    plan = solve(_without_paths(graph), budget_bytes)
    assert plan.predicted_peak_bytes <= budget_bytes
    assert plan.recompute_ms <= every_layer.recompute_ms
