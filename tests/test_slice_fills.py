"""A fresh tensor filled slice by slice (``buf = x.new_empty(...); buf[..., :d].copy_(a);
buf[..., d:].copy_(b)``, as DeepSeek-V3's attention builds its keys) is one recomputable node
(:mod:`profiling.slice_fills`): a layer holding it is checkpointed whole, at the peak of the
layer checkpointed by hand, and trains bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from planner import optimize
from planner.solvers.hand_policies import hand_placed_plans
from profiling import StepInputs, measure_step_peak_bytes
from profiling.slice_fills import filled_by_slices, group_slice_fills
from profiling.trace import trace_module

WIDTH, HALF = 32, 16


class FillLayer(torch.nn.Module):
    """Keys built in a fresh buffer from two projections, then attention-like mixing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, HALF)
        self.b = torch.nn.Linear(WIDTH, WIDTH - HALF)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = x.new_empty(*x.shape[:-1], WIDTH)
        keys[..., :HALF].copy_(self.a(x))
        keys[..., HALF:].copy_(torch.tanh(self.b(x)))
        return x + self.out(F.dropout(torch.softmax(keys, -1) * x, 0.1))


class FillModel(torch.nn.Module):
    def __init__(self, layers: int = 3, checkpointed: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(FillLayer() for _ in range(layers))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x


def _copies(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes)


def test_a_buffer_filled_by_slices_becomes_one_node_and_computes_the_same():
    torch.manual_seed(0)
    model, x = FillModel().train(), torch.randn(4, 8, WIDTH)
    gm = trace_module(model, (x,))
    assert _copies(gm) == 0
    assert sum(n.target is filled_by_slices for n in gm.graph.nodes) == 3
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    assert torch.equal(gm(x), expected)


def test_a_buffer_read_before_it_is_full_keeps_its_writes():
    class Early(torch.nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            out = a.new_zeros(2, 4)
            out[:, :2].copy_(a)
            seen = out.sum()  # reads the half-written buffer
            out[:, 2:].copy_(a * 2)
            return out * seen

    gm = torch.export.export(Early(), (torch.randn(2, 2),), strict=False).module()
    assert group_slice_fills(gm) == 0
    assert _copies(gm) == 2


@pytest.mark.slow
def test_a_layer_with_a_slice_fill_is_checkpointed_whole_at_the_hand_written_peak():
    torch.manual_seed(0)
    model = FillModel().train()
    hand = FillModel(checkpointed=True).train()
    hand.load_state_dict(model.state_dict())
    x = torch.randn(64, 64, WIDTH)
    inputs = StepInputs.from_example((x,))
    peak = measure_step_peak_bytes(hand, inputs)
    opt = optimize(model, (x,), budget_gb=peak / 2**30, timing_repeats=1)  # no InfeasibleBudgetError
    assert opt.plan.segments
    fills = [n for n in opt.cost_graph.compute_nodes if "filled_by_slices" in n.op]
    assert len(fills) == 3 and all(n.recomputable for n in fills)
    every_layer = hand_placed_plans(opt.cost_graph)[0]
    assert every_layer.name == "every layer" and len(every_layer.segments) == 3  # one run per layer
    assert opt.plan.measured_peak_bytes is not None and opt.plan.measured_peak_bytes <= opt.plan.budget_bytes

    torch.manual_seed(2)
    model(x).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    opt(x).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
