"""The promises on a slice of the corpus (``benchmarks/corpus_models.py``): one family per group,
DeepSeek-V3 and BEiT, and the interleaved-lists, criterion-outside and BatchNorm patterns, planned
at every-layer's measured peak. Each plan fits its budget on measurement, trains bit for bit like the original
module and recomputes no more FLOPs than every-layer. A fast test builds every registered
family, so a transformers release that drops or renames a class is noticed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from corpus import compare_steps, step_result  # noqa: E402
from corpus_models import FAMILIES, GROUPS, SKIPPED  # noqa: E402

from planner import optimize  # noqa: E402
from profiling import StepInputs, TrainingStep, measure_step_flops, measure_step_peak_bytes  # noqa: E402

def _call(model: torch.nn.Module, inputs: StepInputs) -> object:
    return model(*inputs.args, **inputs.kwargs)


FAST = {"timing_repeats": 1, "max_stages": 12}
#: one family per group, the patterns whose shape the planner must see through, and the families
#: whose captured graphs needed a pass of their own (a tensor filled slice by slice, a bias mask)
SLICE = ["gpt_neox", "deepseek_v3", "bert", "bart", "vit", "beit", "interleaved", "criterion_outside", "bn_inplace_cnn"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus-profiles"))


def test_every_family_builds() -> None:
    assert not SKIPPED, f"families whose class the installed transformers lacks: {SKIPPED}"
    assert len(FAMILIES) >= 30 and {f.group for f in FAMILIES.values()} == set(GROUPS)
    for name, family in FAMILIES.items():
        model, example = family.build()
        assert model.training, name
        assert isinstance(example, (tuple, dict)) and StepInputs.from_example(example).tensors(), name
        assert any(p.requires_grad for p in model.parameters()), name


def test_the_slice_covers_every_group() -> None:
    assert {FAMILIES[name].group for name in SLICE} == set(GROUPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLICE)
def test_promises_at_every_layers_peak(name: str, cache_dir: str) -> None:
    family = FAMILIES[name]
    model, example = family.build()
    inputs = StepInputs.from_example(example)
    step = TrainingStep(loss_fn=family.loss_fn)
    every = family.every_layer(model)
    budget_bytes = measure_step_peak_bytes(every, inputs, step=step)
    base_flops = measure_step_flops(model, inputs, step=step)
    every_extra_flops = measure_step_flops(every, inputs, step=step) - base_flops

    opt = optimize(model, example, budget_gb=budget_bytes / 2**30, loss_fn=family.loss_fn, cache_dir=cache_dir,
                   **FAST)

    assert opt.plan is not None and opt.plan.segments
    assert measure_step_peak_bytes(opt, inputs, step=step) <= budget_bytes
    params = dict(model.named_parameters())
    same, what = compare_steps(step_result(family, model, params, inputs), step_result(family, opt, params, inputs))
    assert same, f"{name}: {what} differ"
    extra_flops = measure_step_flops(opt, inputs, step=step) - base_flops
    assert extra_flops <= every_extra_flops, (extra_flops, every_extra_flops)


@pytest.mark.parametrize("name", ["criterion_outside", "bn_inplace_cnn", "residual_mlp", "dict_outputs", "whisper"])
def test_a_repeated_batch_steps_with_the_familys_own_criterion(name: str) -> None:
    """``build(batch_scale)`` repeats every input along its batch dimension, and a criterion
    outside the model repeats its target to match: the loss equals the unrepeated batch's."""
    family = FAMILIES[name]
    model, example = family.build()
    _, repeated = family.build(3)
    flat, flat_repeated = StepInputs.from_example(example).tensors(), StepInputs.from_example(repeated).tensors()
    assert [t.shape[0] * 3 for t in flat if t.dim()] == [t.shape[0] for t in flat_repeated if t.dim()]
    model.eval()  # no dropout: the same rows give the same loss
    loss = family.loss(_call(model, StepInputs.from_example(example)))
    loss_repeated = family.loss(_call(model, StepInputs.from_example(repeated)))
    assert torch.allclose(loss, loss_repeated, rtol=1e-4, atol=1e-6), (loss, loss_repeated)
