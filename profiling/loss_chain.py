"""Find a language model's output head and loss in a captured graph: the row-wise chain
``linear`` (the output projection) -> reshapes and dtype casts -> ``cross_entropy_loss`` with a
``mean`` or ``sum`` reduction over the rows.

The chain is found from the ops, not from module names: a ``linear`` whose output reaches a
``cross_entropy_loss`` through ops that only flatten the leading (token) dimensions or cast the
dtype, with class-index targets, no class weights, and no other reader of the logits than the
graph's output. That is the shape :mod:`rewrite.chunked_loss` can split along its rows so that
only one chunk's logits exist at a time (:func:`rewrite.chunked_loss.chunk_loss_chain`).

Example:
    >>> import torch
    >>> class Head(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj = torch.nn.Linear(8, 50)
    ...     def forward(self, h, y):
    ...         return torch.nn.functional.cross_entropy(self.proj(h).view(-1, 50), y.view(-1))
    >>> gm = torch.export.export(Head(), (torch.randn(2, 3, 8), torch.randint(0, 50, (2, 3))),
    ...                          strict=False).module()
    >>> chain = find_loss_chain(gm)
    >>> chain.vocab, chain.rows, chain.reduction
    (50, 6, 'mean')
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

__all__ = ["LossChain", "find_loss_chain"]

aten = torch.ops.aten

#: Ops between the projection and the loss that keep every row whole: reshapes over the
#: leading dimensions and dtype casts.
_PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
                 aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.contiguous.default,
                 aten.flatten.using_ints, aten.clone.default}
#: ``reduction`` codes of ``aten.cross_entropy_loss`` (``torch.nn._reduction``).
_REDUCTIONS = {1: "mean", 2: "sum"}


@dataclasses.dataclass(frozen=True)
class LossChain:
    """The nodes of one output-head-and-loss chain and the loss's arguments."""

    projection: torch.fx.Node      # aten.linear(hidden, weight, bias)
    loss: torch.fx.Node            # aten.cross_entropy_loss
    chain: tuple[torch.fx.Node, ...]  # projection, pass-through ops, loss, in graph order
    logits_output: torch.fx.Node | None  # the chain node the graph returns as logits, if any
    ignore_index: int
    label_smoothing: float
    reduction: str
    vocab: int
    rows: int
    logits_dtype: torch.dtype

    @property
    def hidden(self) -> torch.fx.Node:
        """The projection's input (``[..., width]``)."""
        return self.projection.args[0]  # type: ignore[return-value]

    @property
    def weight(self) -> torch.fx.Node:
        return self.projection.args[1]  # type: ignore[return-value]

    @property
    def bias(self) -> torch.fx.Node | None:
        return self.projection.args[2] if len(self.projection.args) > 2 else None  # type: ignore[return-value]

    @property
    def target(self) -> torch.fx.Node:
        return self.loss.args[1]  # type: ignore[return-value]


def _val(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_assert(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten._assert_tensor_metadata.default


def _loss_arguments(loss: torch.fx.Node) -> tuple[int, float, int] | None:
    """(reduction code, ignore_index, label_smoothing) of a ``cross_entropy_loss`` without class weights."""
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
    values = dict(defaults, **dict(zip(names, loss.args)), **loss.kwargs)
    if values["weight"] is not None:
        return None
    reduction, ignore_index, smoothing = values["reduction"], values["ignore_index"], values["label_smoothing"]
    if not (isinstance(reduction, int) and isinstance(ignore_index, int) and isinstance(smoothing, (int, float))):
        return None
    return reduction, ignore_index, float(smoothing)


def _chain_to_projection(loss: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes from the loss's input back to a ``linear``, projection first; None when any
    op between them is not a row-keeping pass-through."""
    nodes: list[torch.fx.Node] = []
    current = loss.args[0]
    while isinstance(current, torch.fx.Node) and current.op == "call_function":
        nodes.append(current)
        if current.target is aten.linear.default:
            return nodes[::-1]
        if current.target not in _PASS_THROUGH:
            return None
        current = current.args[0]
    return None


def find_loss_chain(gm: torch.fx.GraphModule) -> LossChain | None:
    """The output-head-and-loss chain of ``gm`` that :mod:`rewrite.chunked_loss` can split into
    row chunks, or None when the graph has none (one chain: the first that qualifies).

    Qualifies: ``aten.cross_entropy_loss`` with class-index targets (one per row), no class
    weights and a ``mean`` or ``sum`` reduction, whose input is a ``linear`` of the hidden
    states through reshapes and casts that keep the last (class) dimension, where no op outside
    the chain reads the logits (the graph's output may return one of them).

    Example:
        >>> gm = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False).module()
        >>> find_loss_chain(gm) is None
        True
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for loss in gm.graph.nodes:
        if loss.op != "call_function" or loss.target is not aten.cross_entropy_loss.default:
            continue
        arguments = _loss_arguments(loss)
        before = _chain_to_projection(loss)
        if arguments is None or before is None or arguments[0] not in _REDUCTIONS:
            continue
        reduction, ignore_index, smoothing = arguments
        logits, target, projection = _val(loss.args[0]), _val(loss.args[1]), before[0]
        if logits is None or target is None or logits.dim() != 2 or target.dim() != 1 \
                or target.dtype not in (torch.int64, torch.int32) or target.shape[0] != logits.shape[0]:
            continue
        projected = _val(projection)
        vocab, rows = int(logits.shape[1]), int(logits.shape[0])
        if projected is None or int(projected.shape[-1]) != vocab or math.prod(projected.shape[:-1]) != rows \
                or any(_val(n) is None or int(_val(n).shape[-1]) != vocab for n in before):
            continue
        chain = (*before, loss)
        returned = [n for n in before if output in n.users]
        inside = set(chain)
        outside = [u for n in before for u in n.users if u not in inside and u is not output and not _is_assert(u)]
        if outside or len(returned) > 1 or (returned and _val(returned[0]).dtype != logits.dtype):
            continue
        return LossChain(projection=projection, loss=loss, chain=chain, logits_output=returned[0] if returned else None,
                         ignore_index=ignore_index, label_smoothing=smoothing, reduction=_REDUCTIONS[reduction],
                         vocab=vocab, rows=rows, logits_dtype=logits.dtype)
    return None
