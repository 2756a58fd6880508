"""The module ``optimize`` returns shows the wrapped model's ``forward`` signature, as libraries
that pick arguments by name (the HuggingFace Trainer's column filter) read it."""

from __future__ import annotations

import copy
import inspect

import torch

from models import gpt2
from planner import optimize
from profiling import StepInputs, measure_step_peak_bytes
from profiling.measure import loss_of


def test_the_optimized_module_has_the_models_forward_signature_and_still_trains():
    model, example = gpt2(layers=2, batch=4, seq_len=64, width=64, vocab=512, heads=2)
    peak = measure_step_peak_bytes(model, StepInputs.from_example(example))
    opt = optimize(model, example, budget_gb=0.7 * peak / 2**30)
    assert opt.plan.segments
    expected = inspect.signature(model.forward)
    assert inspect.signature(opt.forward) == expected
    assert {"input_ids", "labels", "attention_mask"} <= set(inspect.signature(opt.forward).parameters)
    twin = copy.deepcopy(opt)
    assert inspect.signature(twin.forward) == expected
    loss_of(opt(**example)).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_plain_module_keeps_its_positional_signature():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    opt = optimize(model, (torch.randn(4, 8),), budget_gb=1.0)
    assert list(inspect.signature(opt.forward).parameters) == ["input"]
    assert opt(torch.randn(4, 8)).shape == (4, 8)
