"""In-place ops on activations: written out of place for profiling and recompute, restored where
nothing is recomputed.

The captured graph keeps a model's in-place writes (``relu_``, ``x += residual``). A write makes
the ops before it unsafe to recompute (they would read the new values), so
:func:`functionalize_inplace_activations` writes them out of place when nothing else sees the
mutation: the same values, bit for bit, at the cost of one more tensor while both are live and one
more pass over memory. Where the plan recomputes none of the ops around a write,
:func:`restore_inplace_activations` puts the model's own in-place op back: the rewritten graph
then runs the kernels the eager model runs (docs/tuning.md#inplace-restore).
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["functionalize_inplace_activations", "restore_inplace_activations", "fresh_output", "INPLACE_FORM"]

#: ``node.meta`` key of an op written out of place: the in-place ``OpOverload`` it replaced
INPLACE_FORM = "planner_inplace_form"


def fresh_output(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an aten op whose (single) output is new memory, not a view or input.

    Example:
        >>> g = torch.fx.Graph()
        >>> x = g.placeholder("x")
        >>> relu, view = torch.ops.aten.relu.default, torch.ops.aten.view.default
        >>> fresh_output(g.call_function(relu, (x,))), fresh_output(g.call_function(view, (x, [-1])))
        (True, False)
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None and not target._schema.is_mutable


def _makes_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` may return an alias of an input (unknown targets count as views)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return node.op != "output"
    return any(r.alias_info is not None for r in target._schema.returns)


def _view_chain(written: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``written`` and the nodes it is a view of, up to the fresh tensor they all view, where each
    has one reader (the next of the chain, ``written``'s being the in-place op): nobody else can
    see a write through ``written``. ``[written]`` for a fresh tensor; None otherwise."""
    chain = [written]
    current = written
    while not fresh_output(current):
        target = current.target
        if not (_makes_view(current) and isinstance(target, torch._ops.OpOverload)) or not current.args:
            return None
        base = current.args[0]
        if not isinstance(base, torch.fx.Node) or len(base.users) != 1:
            return None
        chain.append(base)
        current = base
    return chain


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.pointwise in target.tags


def functionalize_inplace_activations(gm: torch.fx.GraphModule) -> int:
    """Replace in-place ops on activations (``x += residual``, ``relu_``) by their out-of-place
    form when nothing else sees the mutation: ``x`` is fresh memory made by an earlier op, no
    view of it exists, and every later reader of ``x`` is pointed at the new value; or ``x`` is a
    view of fresh memory that nothing else reads (``attn[..., :k] *= mask``) and only pointwise
    ops read the result.

    An in-place write makes the ops before it unsafe to recompute (they would read the new
    values); the out-of-place form computes the same values, bit for bit, at the cost of one
    more tensor while both are live. Writes to parameters, buffers and inputs are kept.
    Returns how many ops were replaced; ``gm`` is changed in place and recompiled.

    Example:
        >>> class Residual(torch.nn.Module):
        ...     def forward(self, x):
        ...         y = torch.tanh(x)
        ...         y += x
        ...         return torch.relu(y)
        >>> gm = torch.export.export(Residual(), (torch.randn(2, 3),), strict=False).module()
        >>> functionalize_inplace_activations(gm)
        1
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-2:]
        [<OpOverload(op='aten.add', overload='Tensor')>, <OpOverload(op='aten.relu', overload='default')>]
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
            continue
        schema = target._schema
        name = target.__name__  # e.g. "add_.Tensor"
        packet, _, overload = name.partition(".")
        if not (schema.is_mutable and packet.endswith("_") and not packet.startswith("_")):
            continue
        written = node.args[0]
        if not isinstance(written, torch.fx.Node):
            continue
        if not fresh_output(written):
            # a view of a fresh tensor nobody else reads (``attn[:, :, k:] *= mask``): only pointwise
            # readers of the result, which compute the same values whatever its strides
            chain = _view_chain(written) if len(written.users) == 1 else None
            if chain is None or not node.users or not all(_pointwise(u) for u in node.users):
                continue
        functional_packet = getattr(torch.ops.aten, packet[:-1], None)
        functional = getattr(functional_packet, overload or "default", None) if functional_packet else None
        if functional is None or functional._schema.is_mutable:
            continue
        others = [u for u in written.users if u is not node]
        if any(_makes_view(u) for u in others):
            continue  # a view of the written tensor would see the write
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(functional, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        replacement.meta[INPLACE_FORM] = target
        node.replace_all_uses_with(replacement)
        for user in others:
            if order[user] > order[node]:
                user.replace_input_with(written, replacement)
        order[replacement] = order[node]
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def restore_inplace_activations(gm: torch.fx.GraphModule, in_segments: frozenset[str]) -> int:
    """Undo :func:`functionalize_inplace_activations` for every op whose written tensor has no
    other reader, where neither the op nor the tensor's producer is among ``in_segments`` (the
    nodes of recomputed segments): the model's own in-place op runs again, with no recompute
    that could read the written values. Returns how many were restored; ``gm`` is changed in
    place, not recompiled.

    Example:
        >>> class Residual(torch.nn.Module):
        ...     def forward(self, x):
        ...         y = torch.tanh(x) * 2
        ...         y += x
        ...         return torch.relu(y)
        >>> gm = torch.export.export(Residual(), (torch.randn(2, 3),), strict=False).module()
        >>> functionalize_inplace_activations(gm), restore_inplace_activations(gm, frozenset())
        (1, 1)
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-2:]
        [<OpOverload(op='aten.add_', overload='Tensor')>, <OpOverload(op='aten.relu', overload='default')>]
    """
    restored = 0
    for node in list(gm.graph.nodes):
        inplace = node.meta.get(INPLACE_FORM)
        if inplace is None or node.op != "call_function" or node.name in in_segments:
            continue
        written = node.args[0]
        chain = _view_chain(written) if isinstance(written, torch.fx.Node) and len(written.users) == 1 else None
        if chain is None or any(n.name in in_segments for n in chain):
            continue
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(inplace, node.args, node.kwargs)
        replacement.meta = {k: v for k, v in node.meta.items() if k != INPLACE_FORM}
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        replacement.name = node.name
        restored += 1
    return restored
