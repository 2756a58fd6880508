"""``planner.enable`` plans a model in place: the same object, its own forward outside training,
the planned graph in training with bitwise-equal gradients, and ``disable`` undoes it."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import types

import pytest
import torch

from planner import InputError, disable, enable
from planner.integrations.inplace import checkpointed_module_of, is_enabled, plan_of
from profiling.measure import StepInputs, measure_step_peak_bytes

FAST = {"timing_repeats": 1, "max_stages": 12}


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    """Fast planning; profiles cached, so the tests that plan the same model again skip profiling."""
    return {**FAST, "cache_dir": str(tmp_path_factory.mktemp("profiles"))}


def tiny_gpt2(batch: int = 4, seq_len: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def step(model, batch, seed: int, *, zero: bool = True):
    """Loss and gradients (by name) of one training step from ``seed``."""
    if zero:
        model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if zero:
        model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1]), [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]


@pytest.fixture(scope="module")
def enabled(options):
    model, batch = tiny_gpt2()
    eager = copy.deepcopy(model)
    signature = inspect.signature(model.forward)
    keys = list(model.state_dict())
    assert enable(model, batch, budget_fraction=0.8, **options) is model
    return model, eager, batch, signature, keys


def test_enable_keeps_the_model_object_and_runs_the_plan_in_training(enabled):
    model, eager, batch, signature, keys = enabled
    from transformers import GPT2LMHeadModel

    assert type(model) is GPT2LMHeadModel and model.config.n_layer == 2
    assert inspect.signature(model.forward) == signature
    assert list(model.state_dict()) == keys
    plan = plan_of(model)
    assert plan is not None and plan.segments, "80 % of the peak needs recomputation"
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert measure_step_peak_bytes(model, StepInputs.from_example(batch)) <= plan.budget_bytes  # the planned step
    assert_same(step(model, batch, seed=1), step(eager, batch, seed=1))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied


def test_eval_and_no_grad_run_the_models_own_forward(enabled):
    model, eager, batch, _, _ = enabled
    graph = checkpointed_module_of(model).training_graph_for(**batch)
    calls = []
    handle = graph.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        model.eval()
        eager.eval()
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, eager(**batch).logits)
            assert torch.equal(model.generate(batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False),
                               eager.generate(batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False))
        model.train()
        with torch.no_grad():
            model(**batch)
        assert calls == []
        step(model, batch, seed=0)
        assert calls == [1]
    finally:
        handle.remove()
        model.train()
        eager.train()


def test_gradient_accumulation_and_a_new_batch_shape_are_replanned_without_recursion(enabled):
    model, eager, batch, _, _ = enabled
    half = {k: v[:2] for k, v in batch.items()}
    for micro in (model, eager):
        micro.zero_grad(set_to_none=True)
    ours = [step(model, b, seed=s, zero=False) for s, b in ((4, batch), (5, batch), (6, half))]
    theirs = [step(eager, b, seed=s, zero=False) for s, b in ((4, batch), (5, batch), (6, half))]
    for a, b in zip(ours, theirs):
        assert_same(a, b)
    notes = list(checkpointed_module_of(model).plans)
    assert any("grads held" in n for n in notes) and any("2x32" in n for n in notes), notes


def test_a_deep_copy_is_enabled_with_its_own_plan_and_a_pickled_one_is_not(enabled, options):
    model, eager, batch, _, _ = enabled
    twin = copy.deepcopy(model)
    assert is_enabled(twin) and checkpointed_module_of(twin).original is twin
    assert_same(step(twin, batch, seed=7), step(eager, batch, seed=7))
    with torch.no_grad():
        twin.transformer.wte.weight.add_(1.0)  # the copy's graph reads the copy's parameters
    assert not torch.equal(step(twin, batch, seed=7)[0], step(model, batch, seed=7)[0])
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert not is_enabled(back) and plan_of(back) is None
    assert_same(step(back, batch, seed=8), step(eager, batch, seed=8))
    assert enable(back, batch, budget_gb=plan_of(model).budget_bytes / 2**30, **options) is back


def test_first_batch_planning_leaves_rng_and_gradients_as_they_were(options):
    model, batch = tiny_gpt2()
    eager = copy.deepcopy(model)
    enable(model, budget_fraction=0.8, **options)
    assert is_enabled(model) and plan_of(model) is None
    assert_same(step(model, batch, seed=2), step(eager, batch, seed=2))
    assert plan_of(model) is not None
    torch.manual_seed(11)
    model(**batch).loss.backward()
    after_ours = torch.rand(4)
    torch.manual_seed(11)
    eager(**batch).loss.backward()
    assert torch.equal(after_ours, torch.rand(4))


def test_disable_restores_the_forward_the_model_had():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    seen = []

    def hooked(x):  # an instance forward a library installed before planning
        seen.append(x.shape[0])
        return type(model).forward(model, x)

    model.forward = hooked
    x = torch.randn(4, 8)
    enable(model, (x,), budget_gb=1.0, **FAST)
    model.eval()
    model(x)
    assert seen[-1] == 4
    model.train()
    assert disable(model) is model and model.forward is hooked and not is_enabled(model)
    plain = torch.nn.Linear(2, 2)
    enable(plain, (torch.randn(1, 2),), budget_gb=1.0, **FAST)
    disable(plain)
    assert "forward" not in plain.__dict__


def test_bad_inputs_get_one_line_errors():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(InputError, match="not both"):
        enable(model, (x,), budget_gb=1.0, budget_fraction=0.5)
    with pytest.raises(InputError, match="budget_gb .GiB. or budget_fraction"):
        enable(model, (x,))
    with pytest.raises(InputError, match=r"budget_fraction must be a number in \(0, 1\]"):
        enable(model, (x,), budget_fraction=1.5)
    with pytest.raises(InputError, match="unknown option 'timing_repeat'"):
        enable(model, (x,), budget_gb=1.0, timing_repeat=1)
    with pytest.raises(InputError, match="eval mode"):
        enable(torch.nn.Linear(4, 4).eval(), (x,), budget_gb=1.0)
    with pytest.raises(InputError, match="not enabled"):
        disable(model)
    enable(model, (x,), budget_gb=1.0, **FAST)
    with pytest.raises(InputError, match="already enabled: call planner.disable"):
        enable(model, (x,), budget_gb=1.0)
    model.bias.requires_grad_(False)
    with pytest.raises(InputError, match="parameters of Linear changed since planner.enable planned it") as info:
        model(x)
    assert "\n" not in str(info.value)
    disable(model)
    model.bias.requires_grad_(True)
    failed = torch.nn.Linear(4, 4)
    with pytest.raises(InputError):
        enable(failed, {"nope": x}, budget_gb=1.0, **FAST)
    assert not is_enabled(failed), "a failed plan leaves the model as it was"


def test_a_forward_wrapped_by_another_library_keeps_the_plan():
    """Accelerate's mixed precision wraps ``model.forward`` with ``functools.wraps`` and its
    ``unwrap_model(keep_fp32_wrapper=False)`` binds the unwrapped forward back with ``MethodType``."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    enable(model, (x,), budget_gb=1.0, **FAST)
    installed = model.forward
    expected = type(model).forward(model, x)
    model.forward = functools.wraps(installed)(lambda *args, **kwargs: installed(*args, **kwargs))
    assert is_enabled(model) and plan_of(model) is not None
    assert torch.equal(model(x), expected)
    with pytest.raises(InputError, match="wrapped by another library after planner.enable"):
        disable(model)
    model.forward = types.MethodType(installed, model)
    assert torch.equal(model(x), expected) and is_enabled(model)
    disable(model)
    assert "forward" not in model.__dict__


def test_a_model_that_cannot_be_captured_is_enabled_on_the_graph_break_path(caplog):
    from test_module_fallback import BATCH, WIDTH, ItemShift  # .item() in forward: torch.export refuses it

    torch.manual_seed(0)
    model, x = ItemShift().train(), torch.randn(BATCH, WIDTH)
    reference = copy.deepcopy(model)
    peak_bytes = measure_step_peak_bytes(model, StepInputs((x,), {}))
    with caplog.at_level("WARNING"):
        assert enable(model, (x,), budget_gb=0.6 * peak_bytes / 2**30, timing_repeats=1) is model
    assert plan_of(model).capture == "graph-breaks" and "ops of its eager step" in caplog.text
    assert measure_step_peak_bytes(model, StepInputs((x,), {})) <= 0.6 * peak_bytes
    losses, grads = [], []
    for module in (reference, model):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = module(x)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    disable(model)
    assert not is_enabled(model)
