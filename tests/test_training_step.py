"""The step the planner models is the user's: the output dropped once the loss is taken (or held,
``output_held=True``), a criterion outside the model profiled as part of the step, the plan
measured before it is returned, and a warning when a loop holds what the plan freed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from planner import optimize
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.simulate import simulate
from profiling import StepInputs, TrainingStep, measure_step_peak_bytes

MIB = 2**20
FAST = {"timing_repeats": 1, "max_stages": 12}


def _head_graph(output_held: bool) -> CostGraph:
    """x -> h (1 MiB, saved) -> logits (4 MiB, returned, read by nothing after) ; loss from h."""
    nodes = (
        CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        CostNode("h", "relu", input_names=("x",), output_storages=(1,), saved_storages=(1,), output_bytes=MIB,
                 requires_grad=True),
        CostNode("logits", "mm", input_names=("h",), output_storages=(2,), saved_storages=(1,), output_bytes=4 * MIB,
                 requires_grad=True),
        CostNode("loss", "sum", input_names=("h",), output_storages=(3,), output_bytes=4, requires_grad=True),
    )
    storages = (Storage(0, MIB, True), Storage(1, MIB), Storage(2, 4 * MIB), Storage(3, 4))
    return CostGraph(nodes, storages, output_names=("logits", "loss"), loss_names=("loss",), output_held=output_held)


def test_a_dropped_output_is_freed_when_the_forward_ends_even_if_no_later_node_reads_it():
    held, dropped = simulate(_head_graph(True)), simulate(_head_graph(False))
    # the forward is the same: the logits live until it ends (the loss is taken last)
    assert [m for m in held.timeline if m[0] == "forward"] == [m for m in dropped.timeline if m[0] == "forward"]
    assert dropped.timeline[2] == ("forward", "loss", 2 * MIB + 4 * MIB + 4)
    # every moment of the backward holds the logits only when the loop holds the output
    backward = [(a[2] - b[2]) for a, b in zip(held.timeline, dropped.timeline) if a[0] == "backward"]
    assert backward and all(gap == 4 * MIB for gap in backward)


class _Net(torch.nn.Module):
    def __init__(self, width: int = 128, vocab: int = 256, layers: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    y = torch.randint(0, 256, (256,))
    return _Net().train(), (x,), y


@pytest.mark.parametrize("held", [False, True])
def test_a_criterion_outside_the_model_is_profiled_and_the_plan_is_measured_within_budget(net, held, tmp_path):
    model, example, y = net
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    step = TrainingStep(loss_fn, output_held=held)
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs, step)
    opt = optimize(model, example, budget_gb=0.7 * peak / 2**30, loss_fn=loss_fn, output_held=held,
                   cache_dir=str(tmp_path), **FAST)
    graph = opt.cost_graph
    criterion = graph.nodes[-1]
    assert graph.loss_names == (criterion.name,) and not criterion.recomputable
    # cross-entropy keeps its log-softmax (the logits' size) for the backward
    logits_bytes = 256 * 256 * 4
    assert sum(graph.storage_by_key[k].size_bytes for k in criterion.saved_storages) >= logits_bytes
    assert graph.output_held is held
    # the unoptimized step predicted as measured, under the convention planned for
    assert abs(simulate(graph).peak_bytes - peak) <= 0.01 * peak
    measured = measure_step_peak_bytes(opt, inputs, step)
    assert opt.plan.segments and opt.plan.measured_peak_bytes is not None
    assert measured <= opt.plan.budget_bytes and opt.plan.measured_peak_bytes <= opt.plan.budget_bytes
    assert abs(opt.plan.predicted_peak_bytes - measured) <= 0.02 * measured


def test_holding_the_output_costs_its_bytes_in_the_plan(net):
    model, example, y = net
    inputs = StepInputs.from_example(example)
    freed = measure_step_peak_bytes(model, inputs, TrainingStep(lambda out: F.cross_entropy(out, y)))
    held = measure_step_peak_bytes(model, inputs, TrainingStep(lambda out: F.cross_entropy(out, y), output_held=True))
    assert held - freed >= 256 * 256 * 4 * 0.99  # the logits


def test_loss_fn_must_return_a_scalar(net):
    model, example, _ = net
    with pytest.raises(Exception, match="loss_fn must return a one-element tensor"):
        optimize(model, example, budget_gb=1.0, loss_fn=lambda out: out, **FAST)
    with pytest.raises(Exception, match="loss_fn must be a callable"):
        optimize(model, example, budget_gb=1.0, loss_fn="cross_entropy", **FAST)


def test_after_the_first_calls_every_sixteenth_call_is_watched():
    from rewrite.held_output import WATCH_EVERY_CALLS, WATCHED_FIRST_CALLS, HeldOutputCheck

    check, layer = HeldOutputCheck(), torch.nn.Linear(4, 4)
    held_on_warned_call = []
    for call in range(1, 2 * WATCH_EVERY_CALLS + 1):
        out = layer(torch.randn(3, 4))
        check.watch(out)
        if call > WATCHED_FIRST_CALLS:  # the loop starts holding its output after the first calls
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out.sum().backward()
            if caught:
                held_on_warned_call.append(call)
        else:
            out.sum().item()
            del out
    assert held_on_warned_call == [WATCH_EVERY_CALLS]  # unwatched calls in between; then it warns once


@pytest.mark.parametrize("way_in", ["export", "enable", "modules", "graph-breaks"])
def test_every_way_in_warns_once_when_the_loop_holds_the_output(net, way_in):
    import copy

    from planner import disable, enable

    model, example, y = net
    model = copy.deepcopy(model)
    fraction = 1.0 if way_in == "modules" else 0.8  # its whole-layer units: nothing smaller fits here
    budget_gb = fraction * measure_step_peak_bytes(model, StepInputs.from_example(example)) / 2**30
    if way_in == "enable":
        run = enable(model, example, budget_gb=budget_gb, **FAST)
    else:
        run = optimize(model, example, budget_gb=budget_gb, trace_method=way_in, **FAST)
        assert (run.plan.capture == "graph") == (way_in == "export") and not run.cost_graph.output_held
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.cross_entropy(run(*example), y).backward()  # output dropped: silent
    with pytest.warns(UserWarning, match="output_held=True"):
        out = run(*example)
        F.cross_entropy(out, y).backward()  # ``out`` still held
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run(*example)
        F.cross_entropy(out, y).backward()  # once only
    if way_in == "enable":
        disable(model)
