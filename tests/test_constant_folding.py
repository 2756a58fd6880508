"""Index tensors a captured graph builds from constants alone are computed once at capture
(profiling.constant_folding): the step runs none of their ops and computes what the model does,
and nothing else is folded."""

from __future__ import annotations

import torch

from profiling import trace_module
from profiling.constant_folding import fold_constant_index_tensors


def _relative_index(size: int) -> torch.Tensor:
    """A relative-position index as BEiT builds it (and caches in eager): a meshgrid, then in-place
    writes into slices."""
    coords = torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    relative[:, :, 0] += size - 1
    relative[:, :, 1] += size - 1
    relative[:, :, 0] *= 2 * size - 1
    index = torch.zeros(size * size + 1, size * size + 1, dtype=relative.dtype)
    index[1:, 1:] = relative.sum(-1)
    index[0, 0:] = 1
    return index


class _RelativeBias(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.table = torch.nn.Parameter(torch.randn((2 * size - 1) ** 2, 1))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = _relative_index(self.size)
        bias = self.table[index.flatten()].view(index.shape)
        return torch.nn.functional.dropout(self.proj(x), 0.1) @ bias[: x.shape[-1], : x.shape[-1]]


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_an_index_built_from_constants_is_computed_once_and_trains_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RelativeBias(3), _RelativeBias(3)).train()
    x = torch.randn(4, 8, 8)
    gm = trace_module(model, (x,))
    assert not {"aten.arange.default", "aten.meshgrid.indexing", "aten.copy_.default"} & _ops(gm)
    assert "aten.dropout.default" in _ops(gm) or "aten.native_dropout.default" in _ops(gm)  # random: left
    torch.manual_seed(1)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(1)
    gm(x).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


class _ReadThenWritten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.arange(3)
        first = x[index]
        index.add_(1)  # written after a read: the read sees the value before the write
        return first + x[index]


class _FloatRandomAndInputIndices(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.arange(4, dtype=torch.float32) / 3  # a float the step builds: left to the step
        drawn = torch.randint(0, 4, (4,))  # random: a new draw each step
        positions = (x[:, 0] > 0).long().cumsum(0) % 4  # read from the input
        return x[positions] * scale + x[drawn]


def test_nothing_is_folded_that_is_written_after_a_read_a_float_random_or_read_from_the_input():
    x = torch.randn(4, 4)
    for module in (_ReadThenWritten(), _FloatRandomAndInputIndices()):
        gm = torch.export.export(module, (x,), strict=False).module()
        before = gm.graph.python_code("self").src
        assert fold_constant_index_tensors(gm) == 0
        assert gm.graph.python_code("self").src == before
        torch.manual_seed(0)
        expected = module(x)
        torch.manual_seed(0)
        assert torch.equal(gm(x), expected)


class _ExpandedMask(torch.nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(8, 8, dtype=torch.bool).tril().expand(scores.shape[0], 8, 8)
        return scores.masked_fill(mask, 0.0)


def test_a_folded_mask_is_stored_at_the_size_it_is_built_and_expanded_as_before():
    scores = torch.randn(4, 8, 8)
    gm = torch.export.export(_ExpandedMask(), (scores,), strict=False).module()
    assert fold_constant_index_tensors(gm) == 1
    folded = [getattr(gm, str(n.target)) for n in gm.graph.nodes
              if n.op == "get_attr" and str(n.target).startswith("_folded")]
    assert [tuple(t.shape) for t in folded] == [(8, 8)]
    assert "aten.expand.default" in _ops(gm) and "aten.tril.default" not in _ops(gm)
    assert torch.equal(gm(scores), _ExpandedMask()(scores))
