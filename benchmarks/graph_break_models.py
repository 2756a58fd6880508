"""Models ``torch.export`` cannot capture, each for another cause of graph breaks.

Each layer is written inline in ``forward`` over module lists, as research code often is, and
``checkpoint_layers = True`` runs each layer's body under ``torch.utils.checkpoint`` (the
every-layer plan a person writes by hand, the baseline of ``benchmarks/graph_breaks.py``).

- :class:`ItemBranchNet`: a data-dependent branch per layer (``if y.mean().item() > 0``), the
  layer over three ``nn.ModuleList`` s, a custom ``autograd.Function`` and dropout.
- :class:`NonzeroMoE`: mixture-of-experts routing by ``nonzero`` (data-dependent shapes).
- :class:`NumpyScaleNet`: a per-feature scale computed in NumPy.
- :class:`DataLoopNet`: a refinement loop whose trip count comes from the data.

Example:
    >>> import torch
    >>> model, (x,) = build("item_branch", width=16, tokens=32, layers=2)
    >>> model(x).shape
    torch.Size([32, 16])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["ItemBranchNet", "NonzeroMoE", "NumpyScaleNet", "DataLoopNet", "MODELS", "build"]


class _DoubledGradient(torch.autograd.Function):
    """Scales by 2 in the forward and the gradient by 2 in its own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _Layered(nn.Module):
    """Runs ``_layer(i, h)`` for each layer, under checkpoint when ``checkpoint_layers``."""

    checkpoint_layers = False
    layers = 0

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(self.layers):
            if self.checkpoint_layers:
                h = torch.utils.checkpoint.checkpoint(self._layer, i, h, use_reentrant=False)
            else:
                h = self._layer(i, h)
        return h


class _MlpLists(_Layered):
    """A layer written inline over three module lists: ``ln``, ``fc1`` (width to 4 x width) and
    ``fc2`` (back to width)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = layers
        self.ln = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.fc1 = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
        self.fc2 = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))


class ItemBranchNet(_MlpLists):
    """Per layer: ``fc1(ln(h))``, relu or tanh by the sign of its mean (``.item()``), a custom
    Function, ``fc2``, dropout, a residual."""

    def __init__(self, width: int, layers: int, p: float = 0.1) -> None:
        super().__init__(width, layers)
        self.drop = nn.Dropout(p)

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        y = self.fc1[i](self.ln[i](h))
        y = torch.relu(y) if y.mean().item() > 0 else torch.tanh(y)
        return h + self.drop(self.fc2[i](_DoubledGradient.apply(y)))


class NonzeroMoE(_Layered):
    """Per layer: a router picks one of ``experts`` per token; each expert runs on the tokens
    ``nonzero`` finds for it (shapes depend on the data); outputs scattered back with the gate."""

    def __init__(self, width: int, layers: int, experts: int = 2) -> None:
        super().__init__()
        self.layers = layers
        self.ln = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.router = nn.ModuleList(nn.Linear(width, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                          for _ in range(experts)) for _ in range(layers))

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        z = self.ln[i](h)
        probs = torch.softmax(self.router[i](z), dim=-1)
        gate, choice = probs.max(dim=-1)
        out = torch.zeros_like(z)
        for e, expert in enumerate(self.experts[i]):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(z[rows]) * gate[rows, None])
        return h + out


class NumpyScaleNet(_MlpLists):
    """Per layer: ``fc1(ln(h))`` scaled per feature by ``1 + tanh`` of its batch mean, computed in NumPy."""

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        y = self.fc1[i](self.ln[i](h))
        scale = torch.from_numpy(1.0 + np.tanh(y.detach().mean(0).numpy()))
        return h + self.fc2[i](F.gelu(y) * scale)


class DataLoopNet(_MlpLists):
    """Per layer: a residual MLP applied 1 to 3 times, the count read from the data."""

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        steps = 1 + int(h.detach().abs().mean().item() * 1000) % 3
        for _ in range(steps):
            h = h + self.fc2[i](torch.tanh(self.fc1[i](self.ln[i](h))))
        return h


#: name -> (class, what breaks the graph)
MODELS: dict[str, tuple[Callable[[int, int], nn.Module], str]] = {
    "item_branch": (ItemBranchNet, ".item() branch, custom autograd.Function, three ModuleLists"),
    "nonzero_moe": (NonzeroMoE, "nonzero routing (data-dependent shapes)"),
    "numpy_scale": (NumpyScaleNet, "NumPy call"),
    "data_loop": (DataLoopNet, "data-dependent loop count"),
}


def build(name: str, *, width: int = 64, tokens: int = 2048, layers: int = 4,
          seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model ``name`` of :data:`MODELS` in training mode and its example inputs."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    model = MODELS[name][0](width, layers).train()
    return model, (torch.randn(tokens, width),)
