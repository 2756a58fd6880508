"""Custom ``torch.autograd.Function`` calls in a captured graph: one node each, whose run applies
the Function itself (profiling/custom_functions.py), so its own backward, what it saves and its
random numbers are the eager step's, planned and recomputed like any op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from planner import optimize
from planner.core.errors import TraceError
from profiling import StepInputs, measure_step_peak_bytes
from profiling.measure import TrainingStep
from profiling.custom_functions import AUTOGRAD_FUNCTION, function_of
from profiling.trace import trace_module


class _TanhGeluScaled(torch.autograd.Function):
    """A tanh GELU that saves its input, with a backward that is not its forward's derivative
    (scaled by 3): autograd of the forward ops would give another gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        d = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return ctx.scale * d * grad, None


class _DropoutInside(torch.autograd.Function):
    """Dropout drawn inside the Function's forward, its mask saved for its own backward."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.2).to(x.dtype) / 0.8
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask


class _FunctionMLP(torch.nn.Module):
    def __init__(self, width: int = 32, hidden: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.ln = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, hidden) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(hidden, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for ln, up, down in zip(self.ln, self.up, self.down):
            x = x + down(_DropoutInside.apply(_TanhGeluScaled.apply(up(ln(x)), 3.0)))
        return x


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _step(module: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    loss = _mean_square(module(x))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_bitwise(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1]), [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]


def test_each_call_is_one_node_that_applies_the_function_and_its_own_backward():
    torch.manual_seed(0)
    model, x = _FunctionMLP().train(), torch.randn(64, 32)
    gm = trace_module(model, (x,))
    calls = [n for n in gm.graph.nodes if n.target is AUTOGRAD_FUNCTION]
    assert [function_of(n.args[0]) for n in calls] == [_TanhGeluScaled, _DropoutInside] * 4
    assert not any("tanh" in str(n.target) for n in gm.graph.nodes)  # the forward's ops are inside the node
    _assert_bitwise(_step(model, model, x), _step(gm, model, x))


def test_the_same_model_captured_again_gives_the_same_graph_code():
    """The profile cache's fingerprint reads the graph's code: the calls' keys must not change."""
    torch.manual_seed(0)
    model, x = _FunctionMLP().train(), torch.randn(64, 32)
    assert trace_module(model, (x,)).code == trace_module(model, (x,)).code


def test_plans_recompute_the_function_on_the_captured_graph_bit_for_bit_within_budget():
    torch.manual_seed(0)
    model, x = _FunctionMLP().train(), torch.randn(512, 32)
    inputs, step = StepInputs.from_example((x,)), TrainingStep(loss_fn=_mean_square)
    expected = _step(model, model, x)
    unoptimized = measure_step_peak_bytes(model, inputs, step)
    budget_bytes = int(0.6 * unoptimized)
    opt = optimize(model, (x,), budget_gb=budget_bytes / 2**30, loss_fn=_mean_square, timing_repeats=1,
                   cache_dir=None)
    plan = opt.plan
    assert plan.capture == "graph"
    recomputed = {name for segment in plan.segments for name in segment.node_names}
    assert any(name.startswith("autograd_function") for name in recomputed), recomputed
    measured = measure_step_peak_bytes(opt, inputs, step)
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured
    _assert_bitwise(expected, _step(opt, model, x))


class _ViewOfInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.t()

    @staticmethod
    def backward(ctx, grad):
        return grad.t()


class _CountToo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x, 3

    @staticmethod
    def backward(ctx, grad, _):
        return 2 * grad


@pytest.mark.parametrize("function", [_ViewOfInput, _CountToo])
def test_a_call_whose_outputs_are_no_operators_is_refused_by_name(function):
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            out = function.apply(self.linear(x))
            return F.relu(out[0] if isinstance(out, tuple) else out)

    with pytest.raises(TraceError, match=f"custom autograd.Function {function.__name__}, whose outputs are not new"):
        trace_module(Model().train(), (torch.randn(4, 8),))


@pytest.mark.slow
def test_the_captured_graph_compiles_to_what_the_compiled_model_computes():
    """Under torch.compile the node's Autograd kernel is traced through: the Function's forward
    and its own backward compile, as Dynamo compiles the Function in the user's model."""

    class Deterministic(_FunctionMLP):
        def forward(self, x):
            for ln, up, down in zip(self.ln, self.up, self.down):
                x = x + down(_TanhGeluScaled.apply(up(ln(x)), 3.0))
            return x

    torch.manual_seed(0)
    model, x = Deterministic(layers=2).train(), torch.randn(64, 32)
    compiled_capture = torch.compile(trace_module(model, (x,)))
    _assert_bitwise(_step(torch.compile(model), model, x), _step(compiled_capture, model, x))
