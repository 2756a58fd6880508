"""A compiled step whose graph computes its loss runs as two compiled graphs, split before the loss.

Compiled as one graph, an output the loss does not read (logits returned beside their loss) gets
a zero gradient of its size held through the backward; split before the loss, it gets the real
one. The split changes no value: the loss and every gradient are those of the one-graph step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiling import StepInputs, TrainingStep, measure_step_peak_bytes, run_step
from profiling.trace import trace_module
from rewrite.compiled import compile_step
from rewrite.loss_split import LossSplitStep, loss_tail

VOCAB, BATCH, WIDTH = 2048, 256, 32


class LanguageModelHead(nn.Module):
    """A small body and a wide head; returns the loss beside the logits, as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def example():
    torch.manual_seed(0)
    return LanguageModelHead().train(), (torch.randn(BATCH, WIDTH), torch.randint(0, VOCAB, (BATCH,)))


def test_the_loss_graph_holds_the_ops_only_the_loss_needs_and_the_split_step_returns_the_same():
    model, inputs = example()
    gm = trace_module(model, inputs)
    tail = loss_tail(gm)
    assert [str(n.target) for n in tail] == ["aten.cross_entropy_loss.default"]
    split = LossSplitStep(gm, tail)
    assert not any("cross_entropy" in str(n.target) for n in split.head.graph.nodes)
    torch.manual_seed(1)
    expected = gm(*inputs)
    torch.manual_seed(1)
    got = split(*inputs)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


@pytest.mark.parametrize("case", ["criterion outside", "loss alone", "no loss field"])
def test_no_split_where_the_graph_does_not_return_its_loss_beside_other_outputs(case):
    class LossAlone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, x, labels):
            return {"loss": nn.functional.cross_entropy(self.head(x), labels)}

    model, inputs = example()
    if case == "criterion outside":
        gm = trace_module(model, inputs)
        step = TrainingStep(loss_fn=lambda out: out["logits"].logsumexp(-1).mean())
    elif case == "loss alone":
        gm, step = trace_module(LossAlone(), inputs), TrainingStep()
    else:
        gm, step = trace_module(nn.Linear(WIDTH, 4), (inputs[0],)), TrainingStep()
    assert loss_tail(gm, step) == []


@pytest.mark.slow
def test_split_step_peaks_lower_by_the_logits_with_the_same_loss_and_gradients():
    model, inputs = example()
    step_inputs = StepInputs.from_example(inputs)
    one_graph = torch.compile(trace_module(model, inputs), backend="aot_eager")
    run_step(one_graph, step_inputs)  # compiled here, not inside the measurement
    one_graph_peak = measure_step_peak_bytes(one_graph, step_inputs)
    split_gm = trace_module(model, inputs)
    run = compile_step(split_gm, step_inputs, backend="aot_eager")
    assert run.split_before_loss and run.graph_breaks == 0 and isinstance(run.module, LossSplitStep)
    split_peak = measure_step_peak_bytes(run.module, step_inputs)
    logits_bytes = BATCH * VOCAB * 4
    assert one_graph_peak - split_peak >= 0.9 * logits_bytes

    def step(module):
        model.zero_grad(set_to_none=True)
        loss = module(*inputs)["loss"]
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    loss_one, grads_one = step(one_graph)
    loss_split, grads_split = step(run.module)
    assert torch.equal(loss_one, loss_split)
    assert all(torch.equal(a, b) for a, b in zip(grads_one, grads_split))
