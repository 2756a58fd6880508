"""The gradient of a view that selects part of its input (``select``, ``slice``): autograd fills a
zero buffer of the whole input's size, which the replay must count as a buffer of its own, not
as a view of the output's gradient. A recurrence over positions (``h = a[:, i] * h + b[:, i]``)
holds one such buffer per sliced input through the loop's backward."""

from __future__ import annotations

import copy

import torch

from planner import simulate
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.plan import Plan
from planner.solvers.hand_policies import hand_placed_plans
from profiling import StepInputs, measure_step_peak_bytes, profile_graph, trace_module
from rewrite.segments import apply_plan


def _one_select(op: str) -> CostGraph:
    """x (1000 bytes, requires grad) -> a view of part of it (100 bytes) -> relu -> out."""
    nodes = (
        CostNode("x", "placeholder", kind="input", output_storages=(1,), output_bytes=1000, requires_grad=True),
        CostNode("part", op, input_names=("x",), output_storages=(1,), output_bytes=100, requires_grad=True,
                 is_alias=True),
        CostNode("relu", "aten.relu.default", input_names=("part",), output_storages=(2,), saved_storages=(2,),
                 output_bytes=100, requires_grad=True),
    )
    return CostGraph(nodes, (Storage(1, 1000, persistent=True), Storage(2, 100)), output_names=("relu",))


def test_a_selects_gradient_is_a_buffer_of_its_inputs_size():
    # x 1000, relu's output 100 saved, its gradient 100, then relu's input gradient 100 and x's 1000
    assert simulate(_one_select("aten.select.int")).peak_bytes == 1000 + 100 + 100 + 1000
    # a view of the whole input passes the output gradient on as a view of it
    assert simulate(_one_select("aten.view.default")).peak_bytes == 1000 + 100 + 100 + 100


class _Scan(torch.nn.Module):
    """A gated recurrence over positions, written as a loop (a reference scan)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, width)
        self.value = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.sigmoid(self.gate(x)), self.value(x)
        h = torch.zeros_like(x[:, 0])
        states = []
        for i in range(x.shape[1]):
            h = a[:, i] * h + b[:, i]
            states.append(h)
        return x + self.out(torch.stack(states, dim=1))


def test_a_checkpointed_scan_is_predicted_within_two_percent():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Scan(64) for _ in range(3)), torch.nn.Linear(64, 8)).train()
    x = torch.randn(16, 24, 64)
    gm = trace_module(model, (x,))
    graph = profile_graph(gm, (x,), timing_repeats=1)
    every_layer = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
    predicted = simulate(graph, every_layer.segments).peak_bytes
    plan = Plan(budget_bytes=predicted, predicted_peak_bytes=predicted, unoptimized_peak_bytes=0,
                segments=every_layer.segments, forward_ms=0.0, step_ms=0.0, forward_flops=0,
                solver=every_layer.name, solve_s=0.0)
    measured = measure_step_peak_bytes(apply_plan(copy.deepcopy(gm), plan), StepInputs.from_example((x,)))
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
