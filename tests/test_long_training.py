"""200 optimizer steps of a small GPT-2 through the optimized module: the loss curve equals the
unoptimized model's bit for bit, and memory stays flat (nothing leaks from checkpoint hooks,
re-planning caches or saved tensors)."""

from __future__ import annotations

import copy

import pytest
import torch

from models import gpt2
from planner import optimize
from profiling.measure import allocation_events

STEPS = 200
WINDOW = 10


def train_steps(module: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: dict, first: int,
                count: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        torch.manual_seed(step)  # the same dropout masks in both runs
        loss = module(**inputs).loss
        loss.backward()
        optimizer.step()
        # gradients freed at the end of the step, so a profiled window starts and ends without
        # them (a profile cannot see the free of a block allocated before it started)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def profiled_window(module, optimizer, inputs, first: int) -> tuple[list[torch.Tensor], int, int]:
    """Losses of ``WINDOW`` steps, the net bytes they left allocated and their peak above the start."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        losses = train_steps(module, optimizer, inputs, first, WINDOW)
    running = peak = 0
    for _, delta in allocation_events(prof):
        running += delta
        peak = max(peak, running)
    return losses, running, peak


@pytest.mark.slow
def test_200_steps_match_the_unoptimized_loss_curve_with_flat_memory():
    model, inputs = gpt2(batch=4, seq_len=64, layers=2, width=64, vocab=512)
    reference = copy.deepcopy(model)
    unoptimized_peak = optimize(model, inputs, budget_gb=1.0).plan.unoptimized_peak_bytes
    opt = optimize(model, inputs, budget_gb=0.5 * unoptimized_peak / 2**30)
    assert opt.plan.segments

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)

    # steps 0-9 create the momentum buffers; 10-19 and the last ten are profiled
    losses = train_steps(opt, optimizer, inputs, 0, WINDOW)
    early, early_net, early_peak = profiled_window(opt, optimizer, inputs, WINDOW)
    losses += early
    losses += train_steps(opt, optimizer, inputs, 2 * WINDOW, STEPS - 3 * WINDOW)
    late, late_net, late_peak = profiled_window(opt, optimizer, inputs, STEPS - WINDOW)
    losses += late
    reference_losses = train_steps(reference, ref_optimizer, inputs, 0, STEPS)

    assert len(losses) == len(reference_losses) == STEPS
    for step, (ours, theirs) in enumerate(zip(losses, reference_losses)):
        assert torch.equal(ours, theirs), f"loss differs at step {step}: {ours.item()} vs {theirs.item()}"
    assert reference_losses[-1] < reference_losses[0], "the run should learn something"

    # ten steps leave nothing behind but the ten loss scalars we keep (4 bytes each)
    assert 0 <= early_net < 1024, early_net
    assert 0 <= late_net < 1024, late_net
    assert late_peak <= early_peak * 1.01, (early_peak, late_peak)
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(reference.named_parameters())[name]), name
