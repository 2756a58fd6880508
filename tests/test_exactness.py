"""The optimized module computes exactly what the user's module computes.

HuggingFace models from configs, with their default attention implementation, with and without
attention dropout: with nothing recomputed and at half the peak, the loss and every gradient are
``torch.equal`` to the eager model's. The graph passes that would change kernels are opt-in and
plans say when they ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models
from planner import optimize
from profiling import StepInputs, measure_step_peak_bytes
from profiling.attention_masks import attention_nodes, named_arguments
from planner.core.errors import TraceError
from profiling.trace import trace_module
from test_end_to_end import loss_and_grads

#: batch and sequence length per model: large enough that half the peak is feasible
SIZES = {"gpt2": (8, 128), "llama": (16, 128), "mistral": (16, 128), "bert": (8, 128)}


def _built(name: str, attention_dropout: float):
    batch, seq_len = SIZES[name]
    return getattr(models, name)(layers=2, batch=batch, seq_len=seq_len, width=128, vocab=1024, heads=4,
                                 attention_dropout=attention_dropout)


def _assert_same_training(opt, model, inputs, reference) -> None:
    loss, grads = loss_and_grads(opt, model, inputs, seed=3)
    ref_loss, ref_grads = reference
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    differing = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
    assert not differing, f"gradients not bit for bit: {differing[:5]}"


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no_dropout", "attention_dropout"])
@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("fraction", [None, pytest.param(0.5, marks=pytest.mark.slow)],
                         ids=["nothing_recomputed", "half_the_peak"])
def test_hf_models_train_bit_for_bit(name, dropout, fraction):
    model, example = _built(name, dropout)
    inputs = StepInputs.from_example(example)
    reference = loss_and_grads(model, model, inputs, seed=3)
    peak = measure_step_peak_bytes(model, inputs)
    budget_gb = 100.0 if fraction is None else fraction * peak / 2**30
    opt = optimize(model, example, budget_gb=budget_gb)
    assert bool(opt.plan.segments) == (fraction is not None)
    assert opt.plan.computation_changes == ()
    _assert_same_training(opt, model, inputs, reference)
    if fraction is not None:
        assert measure_step_peak_bytes(opt, inputs) <= opt.plan.budget_bytes


def test_grouped_query_attention_is_called_as_eager_calls_it():
    """Traced, HF repeats the key and value heads (``repeat_kv``); eager passes them unrepeated
    with ``enable_gqa=True``, another kernel: the graph makes the eager call."""
    model, example = _built("mistral", 0.0)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    gm = trace_module(model, example)
    calls = attention_nodes(gm)
    assert len(calls) == 2
    heads = model.config.num_key_value_heads
    for call in calls:
        named = named_arguments(call)
        assert named["enable_gqa"] is True and named["attn_mask"] is None and named["is_causal"] is True
        assert named["key"].meta["val"].shape[1] == heads and named["value"].meta["val"].shape[1] == heads
    repeats = [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default and n.meta["val"].dim() == 5]
    assert not repeats, "repeat_kv's expand is left in the graph"


class EagerMask(torch.nn.Module):
    """Attention that passes its causal mask as a tensor in eager too."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        i = torch.arange(q.shape[-2])
        return F.scaled_dot_product_attention(q, q, q, attn_mask=i[:, None] >= i[None, :], dropout_p=0.3)


def test_a_mask_the_eager_model_passes_is_kept_unless_asked():
    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    model = EagerMask().train()
    kept = trace_module(model, (q,))
    assert named_arguments(attention_nodes(kept)[0])["attn_mask"] is not None
    assert kept.meta["computation_changes"] == ()
    torch.manual_seed(1)
    expected = model(q)
    torch.manual_seed(1)
    assert torch.equal(kept(q), expected)

    simplified = trace_module(model, (q,), simplify_attention_masks=True)
    call = named_arguments(attention_nodes(simplified)[0])
    assert call["attn_mask"] is None and call["is_causal"] is True
    assert len(simplified.meta["computation_changes"]) == 1


def test_the_opt_in_mask_simplification_is_labelled_in_the_plan():
    model, example = models.gpt2(layers=1, batch=2, seq_len=32, width=64, vocab=256, heads=2)
    # this GPT-2 calls attention without a mask in eager: the default graph already matches it
    assert optimize(model, example, budget_gb=100.0).plan.computation_changes == ()
    opt = optimize(EagerMask().train(), (torch.randn(2, 3, 16, 8, requires_grad=True),), budget_gb=100.0,
                   simplify_attention_masks=True)
    assert opt.plan.computation_changes and "simplify-attention-masks" in opt.plan.computation_changes[0]
    assert "CHANGED" in opt.plan.summary()


class _ScaledGradient(torch.autograd.Function):
    """Identity forward returning a view of its input, doubled gradient: a backward that is not
    its forward's derivative, on an output no operator may return (it aliases the input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class _CustomFunctionBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + _ScaledGradient.apply(torch.tanh(self.linear(x)))


def test_a_custom_autograd_function_that_cannot_be_one_node_is_not_captured_its_backward_stays_the_users():
    """A Function whose output is a view of its input cannot be one operator node of the
    captured graph (profiling/custom_functions.py); capturing its forward ops would drop its
    own backward (here a doubled gradient): such a model is planned over the ops of its eager
    step instead, where the Function's own backward runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_CustomFunctionBlock() for _ in range(3)]).train()
    x = torch.randn(64, 32)
    with pytest.raises(TraceError, match="custom autograd.Function _ScaledGradient"):
        trace_module(model, (x,))
    opt = optimize(model, (x,), budget_gb=1.0, timing_repeats=1)
    assert opt.plan.capture == "graph-breaks"
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    opt(x).sum().backward()
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
