"""Compute a language model's output head and loss in row chunks, so that only one chunk's
logits exist at a time in the forward and the backward (opt-in: ``optimize(..., chunk_loss=True)``).

:func:`chunked_linear_cross_entropy` is the same function as ``F.cross_entropy(F.linear(hidden,
weight, bias), labels, ...)`` with a ``mean`` or ``sum`` reduction: each chunk of rows runs under a
non-reentrant ``torch.utils.checkpoint`` and returns the sum of its losses; the sums are added
and, for ``mean``, divided by the number of rows whose label is not ``ignore_index`` (nan when
every row is ignored, as ``F.cross_entropy``). Label smoothing and ``ignore_index`` keep their
meaning, since each chunk calls ``F.cross_entropy`` itself. The order in which the rows' losses
are summed differs, so the loss and the gradients agree with the unchunked ones to the last
bits (``allclose`` at rtol 1e-5 in float32), not bit for bit.

:func:`chunk_loss_chain` replaces a chain found by :func:`profiling.loss_chain.find_loss_chain`
with one call to it and records the change in ``gm.meta["computation_changes"]``.

Example:
    >>> import torch
    >>> h = torch.randn(6, 4, requires_grad=True)
    >>> w, y = torch.randn(10, 4), torch.tensor([1, 2, -100, 3, 4, 5])
    >>> loss = chunked_linear_cross_entropy(h, w, None, y, chunks=3)
    >>> bool(torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.T, y)))
    True
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from profiling.loss_chain import LossChain, find_loss_chain

__all__ = ["LOSS_CHUNKS", "chunked_linear_cross_entropy", "chunk_loss_chain", "chunk_loss", "CHUNKED_LOSS_CHANGE"]

log = logging.getLogger(__name__)

#: Row chunks the output head and loss are split into (see docs/tuning.md#loss_chunks).
LOSS_CHUNKS = 16

#: How plans and reports name the change (``Plan.computation_changes``).
CHUNKED_LOSS_CHANGE = ("output head and cross-entropy computed in {chunks} row chunks under checkpoint "
                       "(--chunk-loss): other summation order, loss and gradients allclose (rtol 1e-5 in float32)")


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    ignore_index: int, label_smoothing: float, dtype: torch.dtype,
                    want_logits: bool) -> tuple[torch.Tensor, ...]:
    logits = F.linear(hidden, weight, bias).to(dtype)
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum")
    return (loss, logits) if want_logits else (loss,)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 labels: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", chunks: int = LOSS_CHUNKS,
                                 logits_dtype: torch.dtype | None = None,
                                 return_logits: bool = False) -> Any:
    """``F.cross_entropy(F.linear(hidden, weight, bias).to(logits_dtype), labels, ...)`` over the
    rows of ``hidden`` (``[..., width]``, one row per label), in ``chunks`` row chunks each run
    under checkpoint, so that at most one chunk's logits exist at a time.

    With ``return_logits``, returns ``(loss, logits)``: the full logits (``[..., classes]``),
    filled chunk by chunk, and differentiable like the unchunked ones.

    Example:
        >>> h = torch.randn(2, 3, 4)
        >>> w, y = torch.randn(10, 4), torch.tensor([[1, 2, 3], [4, -100, 5]])
        >>> loss, logits = chunked_linear_cross_entropy(h, w, None, y, reduction="sum", chunks=2,
        ...                                             return_logits=True)
        >>> logits.shape, bool(torch.allclose(loss, torch.nn.functional.cross_entropy(
        ...     (h @ w.T).view(-1, 10), y.view(-1), reduction="sum")))
        (torch.Size([2, 3, 10]), True)
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    dtype = logits_dtype or torch.result_type(hidden, weight)
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    if rows.shape[0] != targets.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows of hidden states but {targets.shape[0]} labels")
    size = max(1, math.ceil(rows.shape[0] / max(1, chunks)))
    logits = None
    if return_logits:
        logits = rows.new_empty((*hidden.shape[:-1], weight.shape[0]), dtype=dtype)
        flat_logits = logits.view(-1, weight.shape[0])
    sums = []
    start = 0
    for part, part_labels in zip(rows.split(size), targets.split(size)):
        out = checkpoint(_chunk_loss_sum, part, weight, bias, part_labels, ignore_index, label_smoothing, dtype,
                         return_logits, use_reentrant=False, preserve_rng_state=False)
        sums.append(out[0])
        if return_logits:
            # written in place so that the chunk's own logits are freed before the next chunk runs
            flat_logits[start:start + part.shape[0]] = out[1]
        start += part.shape[0]
        del out
    loss = torch.stack(sums).sum()
    if reduction == "mean":
        loss = loss / (targets != ignore_index).sum().to(loss.dtype)
    return (loss, logits) if return_logits else loss


class _GraphOp:
    """:func:`chunked_linear_cross_entropy` as the graph calls it: named like an op in
    profiles and reports (``rewrite.chunked_loss.chunked_linear_cross_entropy``), where a plain
    function shows its memory address."""

    __name__ = "chunked_linear_cross_entropy"
    __qualname__ = "chunked_linear_cross_entropy"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return chunked_linear_cross_entropy(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.__module__}.{self.__name__}"


_GRAPH_OP = _GraphOp()


def chunk_loss_chain(gm: torch.fx.GraphModule, chain: LossChain, chunks: int = LOSS_CHUNKS) -> None:
    """Replace ``chain`` in ``gm`` by one :func:`chunked_linear_cross_entropy` call (in place,
    recompiled) and record the change in ``gm.meta["computation_changes"]``.

    Example:
        >>> class Head(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.proj = torch.nn.Linear(8, 50)
        ...     def forward(self, h, y):
        ...         return torch.nn.functional.cross_entropy(self.proj(h), y)
        >>> h, y = torch.randn(6, 8), torch.randint(0, 50, (6,))
        >>> gm = torch.export.export(Head(), (h, y), strict=False).module()
        >>> before = gm(h, y)
        >>> chunk_loss_chain(gm, find_loss_chain(gm), chunks=2)
        >>> [n.name for n in gm.graph.nodes if n.op == "call_function"]
        ['chunked_cross_entropy']
        >>> bool(torch.allclose(gm(h, y), before))
        True
    """
    graph = gm.graph
    kwargs = {"ignore_index": chain.ignore_index, "label_smoothing": chain.label_smoothing,
              "reduction": chain.reduction, "chunks": min(chunks, chain.rows), "logits_dtype": chain.logits_dtype,
              "return_logits": chain.logits_output is not None}
    with graph.inserting_before(chain.loss):
        fused = graph.call_function(_GRAPH_OP, (chain.hidden, chain.weight, chain.bias,
                                                                     chain.target), kwargs)
        fused.name = graph._graph_namespace.create_name("chunked_cross_entropy", None)
        loss = graph.call_function(operator.getitem, (fused, 0)) if chain.logits_output is not None else fused
    fused.meta = {k: v for k, v in chain.projection.meta.items() if k in ("nn_module_stack", "stack_trace")}
    if chain.logits_output is not None:
        loss.meta = dict(chain.loss.meta)
        with graph.inserting_after(loss):
            logits = graph.call_function(operator.getitem, (fused, 1))
        logits.meta = dict(chain.logits_output.meta)
        chain.logits_output.replace_all_uses_with(logits)
    else:
        fused.meta["val"] = chain.loss.meta.get("val")
    chain.loss.replace_all_uses_with(loss)
    for node in reversed(chain.chain):
        for user in [u for u in node.users if u.op == "call_function" and
                     u.target is torch.ops.aten._assert_tensor_metadata.default]:
            graph.erase_node(user)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    change = CHUNKED_LOSS_CHANGE.format(chunks=kwargs["chunks"])
    gm.meta["computation_changes"] = (*gm.meta.get("computation_changes", ()), change)
    log.info("chunked the output head and loss (%s, %d rows, %d classes) into %d row chunks",
             chain.projection.name, chain.rows, chain.vocab, kwargs["chunks"])


def chunk_loss(gm: torch.fx.GraphModule, chunks: int = LOSS_CHUNKS) -> bool:
    """Chunk the output head and loss of ``gm`` in place when it has such a chain
    (:func:`profiling.loss_chain.find_loss_chain`); returns whether it had one.

    Example:
        >>> gm = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False).module()
        >>> chunk_loss(gm)
        False
    """
    chain = find_loss_chain(gm)
    if chain is None:
        return False
    chunk_loss_chain(gm, chain, chunks)
    return True
