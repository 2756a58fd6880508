"""PEFT LoRA with the planner: a ``PeftModel`` planned in place within its budget (measured at the
allocator), gradients only on the adapters and bit for bit those of the eager PEFT model, the
PEFT wrapper and ``save_pretrained`` kept; LoRA injected after planning is refused."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from planner import InputError, disable, enable, optimize  # noqa: E402
from planner.integrations.inplace import plan_of  # noqa: E402
from planner.testing import assert_peak_memory  # noqa: E402
from profiling.measure import StepInputs, measure_step_peak_bytes  # noqa: E402

FAST = {"timing_repeats": 1, "max_stages": 12}
GIB = 2**30


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn", "c_fc"],
                             fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config).train()


def batch(rows: int = 4, seq_len: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (rows, seq_len), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def step(model, inputs, seed: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """One profile cache for the module: the LoRA model is profiled once."""
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def planned(profiles):
    model = lora(tiny_gpt2())
    eager = copy.deepcopy(model)
    inputs = batch()
    peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example(inputs))
    budget_gb = 0.6 * peak_bytes / GIB
    assert enable(model, inputs, budget_gb, cache_dir=profiles, **FAST) is model
    return model, eager, inputs, peak_bytes, budget_gb


def test_a_lora_model_planned_in_place_fits_its_budget_measured(planned):
    model, _, inputs, peak_bytes, budget_gb = planned
    assert type(model) is peft.PeftModelForCausalLM and plan_of(model).segments
    measured = measure_step_peak_bytes(model, StepInputs.from_example(inputs))
    assert measured <= budget_gb * GIB < peak_bytes, (measured, budget_gb * GIB, peak_bytes)
    # the model's own step, captured as it is (not the plan), is what exceeds the budget
    with pytest.raises(AssertionError, match="exceeds max_gb"):
        assert_peak_memory(model, inputs, max_gb=0.5 * peak_bytes / GIB)


def test_only_the_adapters_get_gradients_bit_for_bit_those_of_eager_peft(planned):
    model, eager, inputs, _, _ = planned
    loss, grads = step(model, inputs, seed=5)
    eager_loss, eager_grads = step(eager, inputs, seed=5)
    assert grads and all("lora_" in name for name in grads)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys() and all(torch.equal(grads[k], eager_grads[k]) for k in grads)


def test_optimize_of_a_peft_model_still_wraps_it_within_budget(planned, profiles):
    _, eager, inputs, _, budget_gb = planned
    model = lora(tiny_gpt2())
    opt = optimize(model, inputs, budget_gb, cache_dir=profiles, **FAST)
    assert opt.plan.segments
    assert measure_step_peak_bytes(opt, StepInputs.from_example(inputs)) <= budget_gb * GIB
    loss, grads = step(opt, inputs, seed=6)
    eager_loss, eager_grads = step(eager, inputs, seed=6)
    assert torch.equal(loss, eager_loss) and grads.keys() == eager_grads.keys()
    assert all(torch.equal(grads[k], eager_grads[k]) for k in grads)


def test_the_peft_wrapper_saves_and_loads_its_adapter(planned, tmp_path):
    model, _, inputs, _, _ = planned
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").exists()
    back = peft.PeftModel.from_pretrained(tiny_gpt2(), str(tmp_path))
    ours = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    theirs = {k: v for k, v in back.state_dict().items() if "lora_" in k}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lora_injected_after_enable_is_refused_with_what_to_do():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    enable(model, (x,), budget_gb=1.0, **FAST)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0", "2"]))
    with pytest.raises(InputError, match="apply PEFT and freezing first") as info:
        wrapped(x)
    assert "\n" not in str(info.value)
    disable(model)
    wrapped(x).sum().backward()
    trained = {n for n, p in wrapped.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained), "after disable the LoRA model trains on its own forward"
