"""A mixture-of-experts grouped matmul captured as the eager model runs it (profiling.eager_grouped_mm)."""

from __future__ import annotations

import copy

import pytest
import torch

moe = pytest.importorskip("transformers.integrations.moe")

from profiling.eager_grouped_mm import match_eager_grouped_mm  # noqa: E402
from profiling.trace import trace_module  # noqa: E402


class _Experts(torch.nn.Module):
    def __init__(self, experts: int = 4, width: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(experts, width, 2 * width) / width ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, 2 * width, width) / width ** 0.5)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return moe._grouped_mm(torch.relu(moe._grouped_mm(x, self.up, offs)), self.down, offs)


def _step(module, x, offs):
    module.zero_grad(set_to_none=True)
    loss = module(x, offs).square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def test_the_captured_graph_calls_the_grouped_matmul_the_eager_model_calls_and_trains_bit_for_bit():
    torch.manual_seed(0)
    model = _Experts()
    x, offs = torch.randn(24, 16), torch.tensor([5, 11, 11, 24], dtype=torch.int32)
    gm = trace_module(model, (x, offs))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._grouped_mm.default in targets
    assert not any("grouped_mm_fallback" in str(t) for t in targets)
    reference, captured = _step(model, x, offs), _step(gm, x, offs)
    assert torch.equal(reference[0], captured[0])
    assert all(torch.equal(a, b) for a, b in zip(reference[1], captured[1]))


def test_fallbacks_that_do_not_line_up_with_the_eager_calls_are_left_as_traced():
    torch.manual_seed(0)
    model = _Experts()
    x, offs = torch.randn(24, 16), torch.tensor([5, 11, 11, 24], dtype=torch.int32)
    gm = torch.export.export(model, (x, offs), strict=False).module()
    one_expert_layer = copy.deepcopy(model)
    one_expert_layer.forward = lambda x, offs: moe._grouped_mm(x, model.up, offs)  # one eager call, two traced
    assert match_eager_grouped_mm(gm, one_expert_layer, (x, offs)) == 0
    assert sum("grouped_mm_fallback" in str(n.target) for n in gm.graph.nodes) == 2
