"""Constant attention masks in a traced graph: dropped or made ``is_causal`` only where that is
exactly the same attention, and training stays bit-for-bit the eager model's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import bert, gpt2
from profiling.attention_masks import simplify_constant_attention_masks
from profiling.measure import loss_of
from profiling.trace import trace_module


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]


def _mask_of(node: torch.fx.Node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _assert_trains_bit_for_bit(model: torch.nn.Module, gm: torch.fx.GraphModule, example: dict) -> None:
    """One training step of ``model`` and of its captured ``gm`` from one seed: the same loss and
    every gradient ``torch.equal``."""
    results = []
    for module in (model, gm):
        torch.manual_seed(7)
        loss = loss_of(module(**example))
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (eager_loss, eager_grads), (traced_loss, traced_grads) = results
    assert torch.equal(eager_loss, traced_loss)
    assert all(torch.equal(eager_grads[k], traced_grads[k]) for k in eager_grads)


class ConstantMask(torch.nn.Module):
    """Attention with a mask built from ``arange`` only: ``kind`` picks its pattern."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        i = torch.arange(q.shape[-2])
        if self.kind == "causal":
            mask = i[:, None] >= i[None, :]
        elif self.kind == "band":
            mask = (i[:, None] - i[None, :]).abs() <= 1
        elif self.kind == "float_causal":
            mask = torch.zeros(q.shape[-2], q.shape[-2]).masked_fill(i[:, None] < i[None, :], float("-inf"))
        elif self.kind == "float_min":
            mask = torch.zeros(q.shape[-2], q.shape[-2]).masked_fill(i[:, None] < i[None, :], torch.finfo(q.dtype).min)
        else:
            mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("kind, changed, causal", [
    ("causal", True, True), ("float_causal", True, True), ("all", True, False),
    ("band", False, None), ("float_min", False, None),
])
def test_only_exactly_causal_or_all_visible_constant_masks_change(kind, changed, causal):
    q = torch.randn(2, 3, 6, 8, requires_grad=True)
    model = ConstantMask(kind)
    gm = torch.export.export(model, (q,), strict=False).module()
    mask_name = _mask_of(_attention_calls(gm)[0]).name
    assert simplify_constant_attention_masks(gm) == int(changed)
    (call,) = _attention_calls(gm)
    if changed:
        assert _mask_of(call) is None and call.kwargs["is_causal"] is causal
        assert mask_name not in {n.name for n in gm.graph.nodes}, "the mask's computation is removed"
    else:
        assert _mask_of(call) is not None
    torch.testing.assert_close(gm(q), model(q), rtol=0, atol=1e-6)


@pytest.mark.parametrize("build, causal", [(gpt2, True), (bert, False)], ids=["gpt2", "bert"])
def test_hf_models_lose_their_constant_masks_and_train_bit_for_bit(build, causal):
    model, example = build(layers=2, batch=2, seq_len=32)
    gm = trace_module(model, example)
    calls = _attention_calls(gm)
    assert len(calls) == 2
    assert all(_mask_of(c) is None and c.kwargs["is_causal"] is causal for c in calls)
    _assert_trains_bit_for_bit(model, gm, example)


def test_a_padding_mask_from_the_inputs_is_kept():
    model, example = gpt2(layers=1, batch=2, seq_len=16)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 12:] = 0
    example = {**example, "attention_mask": attention_mask}
    gm = trace_module(model, example)
    (call,) = _attention_calls(gm)
    assert _mask_of(call) is not None
    torch.manual_seed(0)
    expected = model(**example).logits
    torch.manual_seed(0)
    torch.testing.assert_close(gm(**example).logits, expected, rtol=0, atol=0)


class AttentionThenHead(torch.nn.Module):
    """Two causal attention calls, then a head that counts how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 8)
        self.head_calls = 0

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        q = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        self.head_calls += 1
        return self.head(q)


def test_the_eager_forward_stops_at_the_graphs_last_attention_call():
    from profiling.eager_attention import eager_attention_calls

    model, q = AttentionThenHead(), torch.randn(1, 2, 4, 8)
    stopped = eager_attention_calls(model, (q,), stop_after=2)
    assert [c.is_causal for c in stopped] == [True, True] and model.head_calls == 0
    whole = eager_attention_calls(model, (q,))
    assert whole == stopped and model.head_calls == 1


def _mistral(batch: int = 3, seq_len: int = 32):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8, use_cache=False,
                           attn_implementation="sdpa", max_position_embeddings=seq_len)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).train()
    ids = torch.randint(0, 64, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_a_sliding_window_mask_is_held_once_over_the_batch_as_eager_holds_it_and_trains_bit_for_bit():
    model, example = _mistral()
    gm = trace_module(model, example)
    calls = _attention_calls(gm)
    assert len(calls) == 2
    for call in calls:  # one sample's mask, copied once, expanded over the batch of 3
        mask = _mask_of(call)
        assert mask.target is torch.ops.aten.expand.default
        assert mask.args[0].target is torch.ops.aten.clone.default
        assert tuple(mask.args[0].meta["val"].shape)[0] == 1 and tuple(mask.meta["val"].shape)[0] == 3
    _assert_trains_bit_for_bit(model, gm, example)


def test_a_mask_that_differs_between_samples_is_not_shared():
    from profiling.attention_masks import share_constant_masks_over_batch

    class PerSample(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            i = torch.arange(q.shape[-2])
            window = torch.arange(q.shape[0])[:, None, None, None] + 1  # sample b sees b + 1 keys back
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    gm = torch.export.export(PerSample(), (torch.randn(3, 2, 4, 8),), strict=False).module()
    assert share_constant_masks_over_batch(gm, lambda node: True) == set()


def test_a_bias_mask_is_passed_alone_as_eager_passes_it_and_trains_bit_for_bit():
    """BEiT adds its relative position bias to the attention mask; traced, HuggingFace builds an
    all-visible boolean mask where eager builds none, and the bias plus ``True`` moves every
    score by 1.0: the graph passes the bias alone, as eager does."""
    from transformers import BeitConfig, BeitForImageClassification

    config = BeitConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, use_relative_position_bias=True, attention_probs_dropout_prob=0.1,
                        num_labels=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = BeitForImageClassification(config).train()
    generator = torch.Generator().manual_seed(1)
    example = {"pixel_values": torch.randn(3, 3, 16, 16, generator=generator),
               "labels": torch.randint(0, 4, (3,), generator=generator)}
    gm = trace_module(model, example)
    for call in _attention_calls(gm):
        mask = _mask_of(call)
        assert mask.target is not torch.ops.aten.add.Tensor and tuple(mask.meta["val"].shape)[0] == 1
    _assert_trains_bit_for_bit(model, gm, example)
