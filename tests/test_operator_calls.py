"""The rewritten graph calls ATen operators through their C++ entry points: no Python frame per
operator, the same kernels, and FX's own code under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._ops import OpOverload

from planner import optimize
from planner.core.plan import Plan, Segment
from rewrite.operator_calls import DIRECT_CALLS, call_operators_directly
from rewrite.segments import CheckpointedSegment, apply_plan, module_copy
from profiling import trace_module


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(16) for _ in range(3))).train()


def _step(module: torch.nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = module(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def _segment_plan(gm: torch.fx.GraphModule) -> Plan:
    """A plan recomputing the nodes of the second block (a segment with dropout inside)."""
    names = tuple(n.name for n in gm.graph.nodes if n.op == "call_function")
    third = len(names) // 3
    segment = Segment(names[third:2 * third], recompute_ms=0.0, recompute_flops=0)
    return Plan(budget_bytes=1, predicted_peak_bytes=0, unoptimized_peak_bytes=0, segments=(segment,),
                forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="test", solve_s=0.0)


def test_the_returned_module_runs_no_operator_through_its_python_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    x = torch.randn(8, 16)
    opt = optimize(model, (x,), budget_gb=1.0)
    assert opt.graph_module.meta[DIRECT_CALLS] >= sum(
        1 for n in opt.graph_module.graph.nodes if n.op == "call_function" and type(n.target) is OpOverload) > 10
    calls: list[str] = []
    python_call = OpOverload.__call__

    def counted(self: OpOverload, *args: object, **kwargs: object) -> object:
        calls.append(str(self))
        return python_call(self, *args, **kwargs)

    monkeypatch.setattr(OpOverload, "__call__", counted)
    _step(opt, x)
    assert calls == []


def test_bound_forward_computes_what_fx_code_computes_bit_for_bit() -> None:
    model = _model()
    x = torch.randn(8, 16)
    gm = trace_module(model, (x,))
    plain = apply_plan(module_copy(gm), _segment_plan(gm))
    for segment in vars(plain).values():  # the segment as FX writes it
        if isinstance(segment, CheckpointedSegment):
            segment.graph_module.recompile()
    bound = apply_plan(module_copy(gm), _segment_plan(gm))
    # the segment is a graph module of its own: its operators are bound too
    inner = [v.graph_module for v in vars(bound).values() if isinstance(v, CheckpointedSegment)]
    assert inner and call_operators_directly(bound) > 0
    assert all(getattr(type(m).forward, "_direct_calls", 0) > 0 for m in inner)
    loss_plain, grads_plain = _step(plain, x)
    loss_bound, grads_bound = _step(bound, x)
    assert torch.equal(loss_plain, loss_bound)
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_bound))


def test_recompile_and_copies_run_fx_forward() -> None:
    x = torch.randn(8, 16)
    gm = trace_module(_model(), (x,))
    call_operators_directly(gm)
    assert getattr(type(gm).forward, "_direct_calls", 0) > 0
    copied = copy.deepcopy(gm)
    assert getattr(type(copied).forward, "_direct_calls", None) is None
    torch.manual_seed(0)
    expected = gm(x)
    torch.manual_seed(0)
    assert torch.equal(copied(x), expected)
    gm.recompile()
    assert getattr(type(gm).forward, "_direct_calls", None) is None


def test_torch_compile_traces_fx_code_without_graph_breaks() -> None:
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    model = _model().eval()  # no dropout: compiled and eager outputs compare
    gm = trace_module(model, (x,))
    call_operators_directly(gm)
    explained = torch._dynamo.explain(gm)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(gm, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))
