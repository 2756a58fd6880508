"""A layer written as a loop body over several module lists is one block, as a person checkpoints
it (:mod:`planner.solvers.interleaved_blocks`): on hand-made graphs the merged blocks are exactly
the loop bodies, and on a real model the every-layer plan is the hand-written one, and the
planner finds a plan at the peak that hand-written checkpoint measures."""

from __future__ import annotations

import pytest

from graphs import MIB
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.simulate import simulate
from planner.solvers.hand_policies import (EVERY_KTH_LAYER_MAX_K, MAX_BLOCK_DECOMPOSITIONS, block_decompositions,
                                           hand_placed_plans, repeated_blocks)
from planner.solvers.solve import solve

#: One loop iteration: (node, op, MiB of its output, module path with ``{i}`` for the iteration).
BODY = (("ln", "aten.layer_norm.default", 1, "ln.{i}"), ("enc", "aten.linear.default", 4, "enc.{i}"),
        ("gelu", "aten.gelu.default", 4, ""), ("proj", "aten.linear.default", 1, "proj.{i}"),
        ("drop", "aten.dropout.default", 1, "drop"), ("add", "aten.add.Tensor", 1, ""))
#: The same body starting with an unnamed op before its first listed module: ``h = x * scale``.
SCALED_BODY = (("scale", "aten.mul.Tensor", 1, ""), *BODY)


class _Builder:
    """A chain of compute nodes, each saving its output, read by the next node."""

    def __init__(self) -> None:
        self.storages = [Storage(0, MIB, persistent=True)]
        self.nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]

    def add(self, name: str, op: str, mib: int, module: str, extra_inputs: tuple[str, ...] = ()) -> str:
        key = len(self.storages)
        self.storages.append(Storage(key, mib * MIB))
        self.nodes.append(CostNode(name, op, input_names=(self.nodes[-1].name, *extra_inputs), output_storages=(key,),
                                   saved_storages=(key,), output_bytes=mib * MIB, requires_grad=True,
                                   time_ms=1.0 + mib / 4, module=module, selective_save=op.endswith("linear.default")))
        return name

    def graph(self) -> CostGraph:
        return CostGraph(tuple(self.nodes), tuple(self.storages), (self.nodes[-1].name,))


def looped(layers: int, body=BODY, final_norm: bool = False) -> tuple[CostGraph, list[tuple[str, ...]]]:
    """An embedding, ``layers`` iterations of ``body`` (the add reads the iteration's input: the
    residual), an optional final norm as the norm list's last member, and a head; with the loop
    bodies' node names."""
    built = _Builder()
    residual = built.add("embed", "aten.embedding.default", 1, "embed")
    bodies = []
    for i in range(layers):
        names = []
        for name, op, mib, module in body:
            extra = (residual,) if name == "add" else ()
            names.append(built.add(f"{name}_{i}", op, mib, module.format(i=i), extra))
        residual = names[-1]
        bodies.append(tuple(names))
    if final_norm:
        built.add("ln_final", "aten.layer_norm.default", 1, f"ln.{layers}")
    built.add("head", "aten.linear.default", 2, "head")
    return built.graph(), bodies


def test_three_interleaved_lists_make_one_stack_of_loop_bodies():
    graph, bodies = looped(4)
    assert repeated_blocks(graph) == [bodies]
    every_layer = hand_placed_plans(graph)[0]
    assert every_layer.name == "every layer"
    assert [s.node_names for s in every_layer.segments] == bodies


def test_glue_before_the_first_listed_module_belongs_to_its_iteration():
    graph, bodies = looped(4, SCALED_BODY)
    assert repeated_blocks(graph) == [bodies]
    assert all(body[0].startswith("scale_") for body in bodies)


def test_a_final_norm_in_the_norm_list_leaves_the_loop_bodies_whole():
    # ``ln`` has one member more than ``enc`` and ``proj``: those two merge, and their loop
    # bodies begin where only the residual stream crosses, at the iteration's norm
    graph, bodies = looped(4, final_norm=True)
    assert repeated_blocks(graph) == [bodies]


def test_lists_run_one_after_another_stay_two_stacks():
    built = _Builder()
    for part in ("encoder", "decoder"):
        for i in range(3):
            built.add(f"{part}_a{i}", "aten.linear.default", 2, f"{part}.{i}")
            built.add(f"{part}_b{i}", "aten.gelu.default", 2, f"{part}.{i}")
    stacks = repeated_blocks(built.graph())
    assert [[len(block) for block in stack] for stack in stacks] == [[2, 2, 2], [2, 2, 2]]


def test_every_decomposition_is_a_candidate_once_and_the_count_is_bounded():
    graph, _ = looped(6)
    labels = [label for label, _ in block_decompositions(graph)]
    assert labels[:2] == ["", " (module lists)"] and len(labels) <= MAX_BLOCK_DECOMPOSITIONS
    plans = hand_placed_plans(graph)
    names = [p.name for p in plans]
    assert "every layer (module lists)" in names and len(set(names)) == len(names)
    keys = [tuple((s.node_names, s.kept_nodes) for s in p.segments) for p in plans]
    assert len(set(keys)) == len(keys)
    assert len(plans) <= 2 * EVERY_KTH_LAYER_MAX_K * MAX_BLOCK_DECOMPOSITIONS


@pytest.mark.parametrize("body", [BODY, SCALED_BODY], ids=["body", "scaled body"])
def test_the_solver_never_costs_more_than_the_loop_body_plans(body):
    graph, _ = looped(6, body)
    checked = 0
    for hand in hand_placed_plans(graph):
        if not hand.name.startswith(("every layer", "every 2nd layer")) or "(" in hand.name:
            continue  # the loop-body plans a person writes: every layer, every 2nd
        budget = simulate(graph, hand.segments).peak_bytes
        if budget >= simulate(graph).peak_bytes:
            continue
        plan = solve(graph, budget, exact=False)  # the hand-placed candidates are what this checks
        assert plan.predicted_peak_bytes <= budget
        assert plan.recompute_ms <= hand.recompute_ms + 1e-9, (hand.name, plan.recompute_ms, hand.recompute_ms)
        checked += 1
    assert checked


def _loop_model(width: int, layers: int, checkpointed: bool):
    import torch
    from torch import nn

    class Loop(nn.Module):
        """``x = x + drop(proj[i](gelu(enc[i](ln[i](x)))))`` for each i; optionally each
        iteration under ``checkpoint``, as a person writes it."""

        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
            self.enc = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
            self.proj = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))
            self.drop = nn.Dropout(0.1)
            self.checkpointed = checkpointed

        def body(self, i: int, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.proj[i](nn.functional.gelu(self.enc[i](self.ln[i](x)))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(layers):
                if self.checkpointed:
                    x = torch.utils.checkpoint.checkpoint(self.body, i, x, use_reentrant=False)
                else:
                    x = self.body(i, x)
            return x

    return Loop()


@pytest.mark.slow
def test_a_loop_body_model_gets_the_hand_written_plan_and_a_plan_at_its_peak():
    import torch

    from planner import optimize
    from profiling import StepInputs, measure_step_peak_bytes

    torch.manual_seed(0)
    model = _loop_model(width=64, layers=4, checkpointed=False).train()
    example = (torch.randn(512, 64),)
    hand = _loop_model(width=64, layers=4, checkpointed=True).train()
    hand.load_state_dict(model.state_dict())
    peak = measure_step_peak_bytes(hand, StepInputs.from_example(example))
    # at the peak of the loop checkpointed by hand, a plan (no InfeasibleBudgetError)
    opt = optimize(model, example, budget_gb=peak / 2**30, timing_repeats=1)
    assert opt.plan.segments

    graph = opt.cost_graph
    ops = ("aten.layer_norm.default", "aten.linear.default", "aten.gelu.default", "aten.linear.default",
           "aten.dropout.default", "aten.add.Tensor")
    body_nodes = [n.name for n in graph.compute_nodes if n.op in ops]
    bodies = [tuple(body_nodes[i * len(ops):(i + 1) * len(ops)]) for i in range(4)]
    assert [tuple(graph.node(n).op for n in body) for body in bodies] == [ops] * 4
    every_layer = hand_placed_plans(graph)[0]
    assert every_layer.name == "every layer"
    assert [s.node_names for s in every_layer.segments] == bodies
