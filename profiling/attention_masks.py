"""Attention masks that are constants of the traced shapes, and when they can be dropped.

Under ``torch.export`` HuggingFace models build their causal mask as a tensor (``arange``,
comparisons, ``expand``) and pass it to ``scaled_dot_product_attention``, where the eager
model, on the same inputs, may pass no mask and ``is_causal=True``: a traced graph is meant to
serve any input, so the library does not take the shortcut while tracing. The two calls are
different computations: another kernel (on CUDA, flash attention instead of the memory-efficient
or math kernel), other rounding, another dropout random stream, other saved tensors.

:func:`drop_constant_masks` evaluates each mask computed from no input and drops it where it lets
every query see every key (no mask) or is exactly the causal mask (``is_causal=True``), for the
calls its caller allows. :mod:`profiling.eager_attention` allows exactly the calls the eager model
makes without a mask (the default: the graph computes what the model computes);
:func:`simplify_constant_attention_masks` allows every call. That is opt-in
(``optimize(..., simplify_attention_masks=True)``, ``--simplify-attention-masks``): a faster
attention kernel that changes rounding and, with attention dropout, the random stream, and plans
built on it say so.

Masks that depend on an input (a padding ``attention_mask``), or hold any other pattern, are
left as they are.

Example:
    >>> import torch
    >>> class Causal(torch.nn.Module):
    ...     def forward(self, q):
    ...         n = q.shape[-2]
    ...         i = torch.arange(n)
    ...         mask = i[:, None] >= i[None, :]
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    >>> gm = torch.export.export(Causal(), (torch.randn(1, 2, 4, 8),), strict=False).module()
    >>> simplify_constant_attention_masks(gm)
    1
    >>> [n.kwargs.get("is_causal") for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    [True]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = ["attention_nodes", "named_arguments", "traced_shape", "drop_constant_masks", "share_constant_masks_over_batch",
           "drop_added_visible_masks", "simplify_constant_attention_masks"]

log = logging.getLogger(__name__)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _ancestors(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> list[torch.fx.Node] | None:
    """``node`` and everything it is computed from, in graph order; ``None`` when any of it
    reads an input or is random (the value is then not a constant)."""
    seen: dict[torch.fx.Node, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        if current.op != "call_function" and current.op != "get_attr":
            return None
        target = current.target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            return None
        if isinstance(target, torch._ops.HigherOrderOperator):
            return None
        seen[current] = None
        stack.extend(current.all_input_nodes)
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> Any:
    values: dict[torch.fx.Node, Any] = {}
    for n in nodes:
        if n.op == "get_attr":
            value: Any = gm
            for part in str(n.target).split("."):
                value = getattr(value, part)
            values[n] = value
            continue
        args = torch.fx.node.map_arg(n.args, values.__getitem__)
        kwargs = torch.fx.node.map_arg(n.kwargs, values.__getitem__)
        values[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    return values[nodes[-1]]


def _constant_value(gm: torch.fx.GraphModule, ancestry: list[torch.fx.Node]) -> torch.Tensor | None:
    """The real tensor ``ancestry`` (its last node) computes, or ``None`` where it cannot be
    evaluated outside the graph or is not a real tensor (meta, fake)."""
    try:
        value = _evaluate(gm, ancestry)
    except Exception as exc:  # an op that cannot run outside the graph: leave the mask
        log.debug("attention mask %s not evaluated: %s", ancestry[-1].name, exc)
        return None
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or \
            isinstance(value, torch._subclasses.FakeTensor):
        return None
    return value


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """Where the mask lets a query see a key, or ``None`` for a float mask that is not made of
    0 (attend) and -inf (masked) alone."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    attend = mask == 0
    if not bool((attend | torch.isneginf(mask)).all()):
        return None
    return attend


def traced_shape(node: Any) -> tuple[int, ...] | None:
    """The shape of the tensor a graph node held while traced (``None`` for anything else)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _causal_if_constant(gm: torch.fx.GraphModule, ancestry: list[torch.fx.Node], q_len: int,
                        kv_len: int) -> bool | None:
    """Evaluate the mask computed by ``ancestry`` (its last node): ``False`` when it lets every
    query see every key, ``True`` when it is exactly the causal mask, ``None`` otherwise."""
    value = _constant_value(gm, ancestry)
    if value is None:
        return None
    allowed = _allowed(value)
    if allowed is None:
        return None
    try:
        allowed = allowed.expand(*allowed.shape[:-2], q_len, kv_len)
    except RuntimeError:
        return None
    if bool(allowed.all()):
        return False
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device).tril()
    if q_len == kv_len and torch.equal(allowed, causal.expand_as(allowed)):
        return True
    return None


def attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``gm``'s ``aten.scaled_dot_product_attention`` calls, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]


def named_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments of an attention call by name (``query`` ... ``enable_gqa``)."""
    named = dict(zip(SDPA_ARGUMENTS, node.args))
    named.update(node.kwargs)
    return named


def simplify_constant_attention_masks(gm: torch.fx.GraphModule) -> int:
    """Replace constant all-visible attention masks by none, and constant causal masks by
    ``is_causal=True``, in ``gm``'s ``aten.scaled_dot_product_attention`` calls, whatever the
    eager model does (opt-in: another kernel, other rounding and dropout stream).

    Returns how many calls changed; ``gm`` is changed in place and recompiled, and nodes that
    only computed a dropped mask are removed. A mask shared by several calls (one per layer) is
    evaluated once.
    """
    return len(drop_constant_masks(gm, lambda node, causal: True))


def drop_constant_masks(gm: torch.fx.GraphModule,
                        allowed: Callable[[torch.fx.Node, bool], bool]) -> set[torch.fx.Node]:
    """Drop each constant causal (``is_causal=True`` instead) or all-visible (no mask) mask of
    an attention call for which ``allowed(node, causal)`` is true; returns the calls changed
    (``gm`` recompiled when any did, the nodes that only computed a dropped mask removed)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    decided: dict[tuple[torch.fx.Node, int, int], tuple[list[torch.fx.Node], bool] | None] = {}
    changed: set[torch.fx.Node] = set()
    candidates: set[torch.fx.Node] = set()
    for node in attention_nodes(gm):
        named = named_arguments(node)
        mask = named.get("attn_mask")
        query, key = traced_shape(named.get("query")), traced_shape(named.get("key"))
        if not isinstance(mask, torch.fx.Node) or named.get("is_causal") or query is None or key is None:
            continue
        memo_key = (mask, query[-2], key[-2])
        if memo_key not in decided:
            ancestry = _ancestors(mask, order)
            causal = None if ancestry is None else _causal_if_constant(gm, ancestry, query[-2], key[-2])
            decided[memo_key] = None if ancestry is None or causal is None else (ancestry, causal)
        decision = decided[memo_key]
        if decision is None or not allowed(node, decision[1]):
            continue
        ancestry, causal = decision
        named["attn_mask"] = None
        named["is_causal"] = causal
        node.args = (named.pop("query"), named.pop("key"), named.pop("value"))
        node.kwargs = named
        candidates.update(ancestry)
        changed.add(node)
    if changed:
        for n in reversed(list(gm.graph.nodes)):
            if n in candidates and not n.users:
                gm.graph.erase_node(n)
        gm.graph.lint()
        gm.recompile()
    return changed


def _batch_shared_view(gm: torch.fx.GraphModule, mask: torch.fx.Node,
                       order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """A node computing ``mask[:1].clone().expand(mask.shape)``, inserted after ``mask``, where
    ``mask`` is a constant whose batch entries (dimension 0) are all equal and which holds each
    of them in memory; ``None`` otherwise (nothing inserted)."""
    ancestry = _ancestors(mask, order)
    if ancestry is None:
        return None
    value = _constant_value(gm, ancestry)
    if value is None:
        return None
    if value.dim() < 1 or value.shape[0] < 2 or value.stride(0) == 0 or \
            not torch.equal(value, value[:1].expand_as(value)):
        return None
    shape = list(value.shape)
    graph = gm.graph
    with graph.inserting_after(mask):
        first = graph.call_function(torch.ops.aten.slice.Tensor, (mask, 0, 0, 1))
    with graph.inserting_after(first):
        owned = graph.call_function(torch.ops.aten.clone.default, (first,))
    with graph.inserting_after(owned):
        view = graph.call_function(torch.ops.aten.expand.default, (owned, shape))
    traced = mask.meta.get("val")
    if isinstance(traced, torch._subclasses.FakeTensor):
        with traced.fake_mode:
            first.meta["val"] = traced[:1]
            owned.meta["val"] = first.meta["val"].clone()
            view.meta["val"] = owned.meta["val"].expand(shape)
    return view


def share_constant_masks_over_batch(gm: torch.fx.GraphModule,
                                    allowed: Callable[[torch.fx.Node], bool]) -> set[torch.fx.Node]:
    """Pass each attention call that ``allowed(node)`` accepts a view of its mask's first batch
    entry expanded over the batch, where the mask is a constant repeating one entry over the batch
    (the same values, so the same computation: a mask of batch x 1 x queries x keys held once,
    not once per sample); returns the calls changed (``gm`` recompiled when any did).

    Under ``torch.export`` HuggingFace builds a sliding-window mask per sample (it cannot check
    for packed sequences while tracing), where the eager model passes one sample's mask
    expanded over the batch; the attention backward holds the mask, so the traced graph held
    ``batch`` times its bytes through the backward.

    Example:
        >>> class Windowed(torch.nn.Module):
        ...     def forward(self, q):
        ...         i = torch.arange(q.shape[-2])
        ...         mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 2)).expand(q.shape[0], 1, -1, -1)
        ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.clone())
        >>> gm = torch.export.export(Windowed(), (torch.randn(3, 2, 4, 8),), strict=False).module()
        >>> len(share_constant_masks_over_batch(gm, lambda node: True))
        1
        >>> q = torch.randn(3, 2, 4, 8)
        >>> torch.equal(gm(q), Windowed()(q))
        True
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    views: dict[torch.fx.Node, torch.fx.Node | None] = {}
    changed: set[torch.fx.Node] = set()
    for node in attention_nodes(gm):
        named = named_arguments(node)
        mask = named.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or not allowed(node):
            continue
        if mask not in views:
            views[mask] = _batch_shared_view(gm, mask, order)
        view = views[mask]
        if view is None:
            continue
        named["attn_mask"] = view
        node.args = (named.pop("query"), named.pop("key"), named.pop("value"))
        node.kwargs = named
        changed.add(node)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _added_to_a_visible_constant(gm: torch.fx.GraphModule, mask: torch.fx.Node,
                                 order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """``x`` where ``mask`` is ``x + c`` (either order) and ``c`` a constant computed from shapes
    alone (no input, parameter or buffer) that lets every query see every key (all True, or all
    0.0); ``None`` otherwise."""
    if mask.op != "call_function" or mask.target is not torch.ops.aten.add.Tensor or len(mask.args) != 2 or \
            mask.kwargs:
        return None
    for x, c in (mask.args, mask.args[::-1]):
        if not (isinstance(x, torch.fx.Node) and isinstance(c, torch.fx.Node)):
            continue
        ancestry = _ancestors(c, order)
        if ancestry is None or any(n.op == "get_attr" for n in ancestry):
            continue
        value = _constant_value(gm, ancestry)
        allowed = None if value is None else _allowed(value)
        if allowed is not None and bool(allowed.all()):
            return x
    return None


def drop_added_visible_masks(gm: torch.fx.GraphModule,
                             eager_mask_shape: Callable[[torch.fx.Node], tuple[int, ...] | None]) -> set[torch.fx.Node]:
    """Pass ``x`` where an attention call's mask is ``x + c``, ``c`` a constant all-visible mask
    and ``x`` of the shape the eager call's mask had (``eager_mask_shape(node)``) while the sum
    is larger (broadcast over ``c``'s batch): the eager model passed ``x`` alone. Returns the
    calls changed (``gm`` recompiled when any did).

    Under ``torch.export`` HuggingFace builds an all-visible mask where eager builds none, and a
    model that adds its own bias to the mask (BEiT's relative position bias) then adds that
    mask to the bias: ``True`` counts as 1.0, every score moves by 1 and rounds otherwise.

    Example:
        >>> class Biased(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bias = torch.nn.Parameter(torch.randn(1, 2, 4, 4))
        ...     def forward(self, q):
        ...         mask = self.bias
        ...         if torch.compiler.is_exporting():   # as HuggingFace does while traced
        ...             mask = mask + torch.ones(q.shape[0], 1, 4, 4, dtype=torch.bool)
        ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        >>> q = torch.randn(3, 2, 4, 8)
        >>> gm = torch.export.export(Biased(), (q,), strict=False).module()
        >>> len(drop_added_visible_masks(gm, lambda node: (1, 2, 4, 4)))
        1
        >>> torch.equal(gm(q), torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=gm.bias))
        True
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed: set[torch.fx.Node] = set()
    unread: list[torch.fx.Node] = []
    for node in attention_nodes(gm):
        named = named_arguments(node)
        mask = named.get("attn_mask")
        eager_shape = eager_mask_shape(node)
        if not isinstance(mask, torch.fx.Node) or not eager_shape or traced_shape(mask) == eager_shape:
            continue
        x = _added_to_a_visible_constant(gm, mask, order)
        if x is None or traced_shape(x) != eager_shape:
            continue
        named["attn_mask"] = x
        node.args = (named.pop("query"), named.pop("key"), named.pop("value"))
        node.kwargs = named
        changed.add(node)
        unread.append(mask)
    while unread:  # the sums, and the constants only they read
        n = unread.pop()
        if n.op == "call_function" and not n.users and not n.is_impure() and n.graph is gm.graph:
            unread.extend(n.all_input_nodes)
            gm.graph.erase_node(n)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
