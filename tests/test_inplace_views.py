"""An in-place write through a view of a fresh tensor nobody else reads (Funnel's
``positional_attn *= cls_mask`` on a slice) is written out of place where only pointwise ops
read the result, so the ops before it stay recomputable; and put back in place where nothing
around it is recomputed (:mod:`profiling.inplace_activations`)."""

from __future__ import annotations

import torch

from profiling.inplace_activations import functionalize_inplace_activations, restore_inplace_activations


class MaskedSlice(torch.nn.Module):
    def __init__(self, reader: str = "add") -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12))
        self.reader = reader

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.w).reshape(4, 3, 12)[:, :, 2:]  # a view of a fresh tensor, its only reader
        scores *= mask
        return scores + 1.0 if self.reader == "add" else scores.sum(-1)


def _inplace_ops(gm: torch.fx.GraphModule) -> int:
    return sum(str(n.target) == "aten.mul_.Tensor" for n in gm.graph.nodes)


def _export(model: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, args, strict=False).module()


def test_a_write_through_a_view_read_pointwise_is_made_out_of_place_and_computes_the_same():
    model, x, mask = MaskedSlice(), torch.randn(12, 8, requires_grad=True), torch.rand(4, 3, 10)
    gm = _export(model, x, mask)
    assert functionalize_inplace_activations(gm) == 1 and _inplace_ops(gm) == 0
    expected = model(x, mask)
    expected.sum().backward()
    expected_grad, x.grad = x.grad.clone(), None
    out = gm(x, mask)
    out.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, expected_grad)
    assert restore_inplace_activations(gm, frozenset()) == 1 and _inplace_ops(gm) == 1


def test_a_write_through_a_view_read_by_a_reduction_stays_in_place():
    model, x, mask = MaskedSlice("sum"), torch.randn(12, 8), torch.rand(4, 3, 10)
    gm = _export(model, x, mask)
    assert functionalize_inplace_activations(gm) == 0 and _inplace_ops(gm) == 1
