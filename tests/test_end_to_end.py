"""optimize() on the example models at 70 %, 50 % and 35 % of their measured unoptimized peak.

Measured at the allocator (CPU profiler memory events). Slow: marked ``slow``; CI runs it.
Each model is profiled once (``cache_dir``, per test module and worker); the other budgets
plan from the cached profile, as a user's second budget does.
"""

from __future__ import annotations

import pytest
import torch

from models import gpt2, residual_mlp
from planner import optimize
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes
from profiling.measure import loss_of

pytestmark = pytest.mark.slow

FRACTIONS = (0.7, 0.5, 0.35)


def loss_and_grads(module, owner, inputs: StepInputs, seed: int):
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(module(*inputs.args, **inputs.kwargs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}
    owner.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module", params=["residual_mlp", "gpt2"])
def subject(request):
    model, example = residual_mlp() if request.param == "residual_mlp" else gpt2()
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs)
    if request.param == "gpt2":
        assert peak >= 300 * 10**6, "the GPT-2 case must peak at 300 MB or more unoptimized"
        assert model.config.n_layer >= 4 and not model.config.use_cache
        assert model.config.resid_pdrop > 0 and model.config.attn_pdrop > 0
    reference = loss_and_grads(model, model, inputs, seed=11)
    return request.param, model, example, inputs, peak, measure_step_flops(model, inputs), reference


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_budget_is_met_and_training_is_unchanged(subject, fraction, profiles):
    name, model, example, inputs, peak, base_flops, (ref_loss, ref_grads) = subject
    opt = optimize(model, example, budget_gb=peak * fraction / 2**30, cache_dir=profiles)
    plan = opt.plan
    measured = measure_step_peak_bytes(opt, inputs)
    assert measured <= plan.budget_bytes, f"{name}: measured {measured} over budget {plan.budget_bytes}"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured
    assert plan.segments, "below the unoptimized peak something must be recomputed"

    loss, grads = loss_and_grads(opt, model, inputs, seed=11)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        assert torch.equal(grads[key], ref_grads[key]), key

    # the plan prices each segment where checkpoint's recompute stops (planner.core.rerun): exact
    extra_flops = measure_step_flops(opt, inputs) - base_flops
    assert extra_flops == plan.recompute_flops
    assert f"{plan.recompute_flops:.3e}" in plan.summary()


def test_selective_plan_at_half_budget(subject, profiles):
    """Segments that keep their matmul outputs: within budget, same gradients, fewer FLOPs."""
    name, model, example, inputs, peak, base_flops, (ref_loss, ref_grads) = subject
    opt = optimize(model, example, budget_gb=peak * 0.5 / 2**30, selective=True, cache_dir=profiles)
    measured = measure_step_peak_bytes(opt, inputs)
    assert measured <= opt.plan.budget_bytes
    assert abs(opt.plan.predicted_peak_bytes - measured) <= 0.10 * measured
    loss, grads = loss_and_grads(opt, model, inputs, seed=11)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    extra_flops = measure_step_flops(opt, inputs) - base_flops
    assert extra_flops == opt.plan.recompute_flops
