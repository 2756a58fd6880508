"""optimize() on a CUDA GPU: budgets met at ``max_memory_allocated``, training unchanged.

These run only where a CUDA device is present (marked ``cuda``; skipped elsewhere, CI has no
GPU). docs/correctness.md says what they check; docs/benchmarks/quality_cuda.md records the GPU
quality run and its command.
"""

from __future__ import annotations

import pytest
import torch

from models import cnn, gpt2, mistral, residual_mlp
from planner import optimize
from profiling import StepInputs, measure_step_peak_bytes
from profiling.measure import loss_of
from test_end_to_end import loss_and_grads
from torch.utils._pytree import tree_map

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")


def on_device(model: torch.nn.Module, example):
    return model.to(DEVICE), tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t, example)


def test_measured_peak_ignores_other_tensors_on_the_device():
    model, example = on_device(*residual_mlp(batch=512))
    inputs = StepInputs.from_example(example)
    alone = measure_step_peak_bytes(model, inputs)
    unrelated = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    beside = measure_step_peak_bytes(model, inputs)
    del unrelated
    assert abs(beside - alone) <= 0.01 * alone, (alone, beside)


@pytest.fixture(scope="module", params=["residual_mlp", "gpt2"])
def subject(request):
    built = residual_mlp() if request.param == "residual_mlp" else gpt2()
    model, example = on_device(*built)
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs)
    return request.param, model, example, inputs, peak, loss_and_grads(model, model, inputs, seed=5)


@pytest.mark.parametrize("selective", [False, True], ids=["segments", "selective"])
def test_half_budget_is_met_and_training_is_unchanged(subject, selective):
    name, model, example, inputs, peak, (ref_loss, ref_grads) = subject
    opt = optimize(model, example, budget_gb=peak * 0.5 / 2**30, selective=selective)
    measured = measure_step_peak_bytes(opt, inputs)
    assert measured <= opt.plan.budget_bytes, f"{name}: measured {measured} over budget {opt.plan.budget_bytes}"
    assert abs(opt.plan.predicted_peak_bytes - measured) <= 0.10 * measured, (opt.plan.predicted_peak_bytes, measured)
    assert opt.plan.segments

    loss, grads = loss_and_grads(opt, model, inputs, seed=5)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], msg=key)

    smaller = tree_map(lambda t: t[: t.shape[0] // 2] if isinstance(t, torch.Tensor) else t, example)
    smaller_inputs = StepInputs.from_example(smaller)
    loss_of(opt(*smaller_inputs.args, **smaller_inputs.kwargs)).backward()
    model.zero_grad(set_to_none=True)


def test_batchnorm_statistics_update_once_per_step_on_cuda():
    model, example = on_device(*cnn())
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    opt = optimize(model, example, budget_gb=peak * 0.7 / 2**30)
    assert opt.plan.segments
    model.load_state_dict(reference)
    loss_of(model(*inputs.args)).backward()
    expected = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    model.load_state_dict(reference)
    model.zero_grad(set_to_none=True)
    loss_of(opt(*inputs.args)).backward()
    actual = {k: v for k, v in model.state_dict().items() if k in expected}
    assert expected
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=key)


@pytest.mark.parametrize("fraction", [None, 0.5], ids=["nothing_recomputed", "half_the_peak"])
def test_mistral_with_attention_dropout_trains_as_the_eager_model(fraction):
    """The graph calls attention as the eager model does (same kernel, same dropout stream): a
    constant causal mask is not swapped for another kernel unless asked for."""
    model, example = on_device(*mistral(layers=2, width=512, heads=8, batch=4, seq_len=512, attention_dropout=0.1))
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs)
    ref_loss, ref_grads = loss_and_grads(model, model, inputs, seed=5)
    opt = optimize(model, example, budget_gb=100.0 if fraction is None else fraction * peak / 2**30)
    assert bool(opt.plan.segments) == (fraction is not None) and opt.plan.computation_changes == ()
    if fraction is not None:
        assert measure_step_peak_bytes(opt, inputs) <= opt.plan.budget_bytes
    loss, grads = loss_and_grads(opt, model, inputs, seed=5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-8, msg=key)


def test_chunked_loss_lowers_the_floor_of_a_gpu_sized_gpt2(tmp_path):
    """``chunk_loss=True`` on a GPT-2 whose loss sets the peak (vocabulary 50,257, 8 x 1024
    tokens): the smallest feasible budget at most 0.35 of the measured unoptimized peak, the
    measured peak within the budget there, the loss and every gradient allclose (rtol 1e-5)
    to the unoptimized model's, and at the plain floor a step no slower than the plan without
    chunks (2 % for timing noise; median of interleaved CUDA-event timings)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import step_time_ratios
    from planner.core.errors import InfeasibleBudgetError

    model, example = on_device(*gpt2(batch=8, seq_len=1024, layers=2, width=768, heads=12, vocab=50257,
                                     attention_dropout=0.0))
    inputs = StepInputs.from_example(example)
    peak = measure_step_peak_bytes(model, inputs)
    ref_loss, ref_grads = loss_and_grads(model, model, inputs, seed=5)
    cache = str(tmp_path)

    def floor(chunk_loss: bool) -> int:
        with pytest.raises(InfeasibleBudgetError) as info:
            optimize(model, example, budget_gb=2**-20, chunk_loss=chunk_loss, cache_dir=cache)
        return info.value.min_feasible_bytes

    plain_floor, chunked_floor = floor(False), floor(True)
    assert chunked_floor <= 0.35 * peak, (chunked_floor, peak)
    opt = optimize(model, example, budget_gb=chunked_floor / 2**30, chunk_loss=True, cache_dir=cache)
    assert opt.plan.computation_changes
    assert measure_step_peak_bytes(opt, inputs) <= opt.plan.budget_bytes
    loss, grads = loss_and_grads(opt, model, inputs, seed=5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key in ref_grads:
        scale = float(ref_grads[key].abs().max())
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-6 * scale, msg=key)
    plain = optimize(model, example, budget_gb=plain_floor / 2**30, cache_dir=cache)
    chunked = optimize(model, example, budget_gb=plain_floor / 2**30, chunk_loss=True, cache_dir=cache)
    assert measure_step_peak_bytes(chunked, inputs) <= chunked.plan.budget_bytes
    _, plain_ratio, chunked_ratio = step_time_ratios([model, plain, chunked], inputs, repeats=7, device=DEVICE)
    assert chunked_ratio <= 1.02 * plain_ratio, (plain_ratio, chunked_ratio)
