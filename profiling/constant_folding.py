"""Compute once, at capture, the index tensors a captured graph builds from constants alone.

Models cache tensors that depend on nothing but their configuration: BEiT's relative-position
index (an ``arange``, a ``meshgrid`` and a dozen in-place writes per layer) sits behind an
``lru_cache`` in eager. ``torch.export`` traces through the cache, so the captured step rebuilds
each such tensor every step: tens of small dispatched calls that eager does not run (about 5 % of
a 2-layer BEiT's step, docs/tuning.md#folded-constants). :func:`fold_constant_index_tensors`
runs those nodes once and replaces what the rest of the graph reads of them with constants on
the graph module, as export stores the tensors it lifts.

The same ops run on the same values, so the folded constants are the values each step would
build: nothing the step computes changes. What is folded is limited to what cannot change a
step's numbers or memory by more than a few bytes:

* a node is constant when it reads only literals, constants the graph module holds (not the
  model's parameters or buffers) and other constant nodes, and draws no random numbers;
* only integer and boolean tensors of at most :data:`FOLDED_CONSTANT_MAX_BYTES` are kept as
  constants (indices and masks; a float the step builds is left to the step), and only where
  every op that reads them saves them for backward (an ``index``, ``gather``, ``embedding`` or
  ``where``): eager holds such a tensor through the step's peak too, so holding it all step
  moves no peak;
* a group of constant nodes is folded only where all of it runs before anything else reads it,
  no other node writes into it, and its run leaves the module's own constants as they were;
* a view the rest of the graph reads (an ``expand`` of a mask) stays a view of the folded tensor,
  so a constant is stored at the size eager builds it.

Example:
    >>> import torch
    >>> class Indexed(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.table = torch.nn.Parameter(torch.randn(7, 2))
    ...     def forward(self, x):
    ...         index = torch.arange(3)[:, None] - torch.arange(3)[None, :] + 2  # built every call
    ...         return x + self.table[index.flatten()].sum()
    >>> gm = torch.export.export(Indexed(), (torch.randn(4),), strict=False).module()
    >>> x = torch.randn(4)
    >>> expected = gm(x)
    >>> fold_constant_index_tensors(gm)
    1
    >>> sum(n.target is torch.ops.aten.arange.start_step or n.target is torch.ops.aten.arange.default
    ...     for n in gm.graph.nodes), torch.equal(gm(x), expected)
    (0, True)
"""

from __future__ import annotations

import logging
import operator
import warnings
from typing import Any

import torch
import torch.fx

from profiling.slice_fills import filled_by_slices

__all__ = ["fold_constant_index_tensors", "FOLDED_CONSTANT_MAX_BYTES"]

log = logging.getLogger(__name__)

#: The largest tensor kept as a folded constant. A folded tensor is held all step, where eager
#: holds it from where the forward builds it to its reader's backward: a peak outside that span
#: (early in the forward, late in the backward) moves by at most this much.
FOLDED_CONSTANT_MAX_BYTES = 1 << 20

#: Ops that save an index or mask argument for their backward (where their output needs a
#: gradient), so eager holds it through the step's peak anyway: a folded tensor read only by these
#: adds nothing to a step's peak.
_SAVING_READERS = frozenset({
    torch.ops.aten.index.Tensor, torch.ops.aten.embedding.default, torch.ops.aten.gather.default,
    torch.ops.aten.index_select.default, torch.ops.aten.masked_fill.Scalar,
    torch.ops.aten.masked_fill.Tensor, torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther,
    torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.Scalar, torch.ops.aten.cross_entropy_loss.default,
    torch.ops.aten.nll_loss.default, torch.ops.aten.nll_loss_forward.default, torch.ops.aten.take_along_dim.default,
})

_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _is_random(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _deterministic(node: torch.fx.Node) -> bool:
    """An ATen op that draws no random numbers, a ``getitem``, or a tensor filled slice by slice."""
    if node.target is operator.getitem:
        return True
    if node.target is filled_by_slices:
        return not _is_random(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and not _is_random(node.target)


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf, None)


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an in-place op writes into (its mutable schema arguments)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    written = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                written.append(value)
    return written


def _constant_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values depend on no input, parameter, buffer or random draw."""
    model_tensors = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    constant: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, torch.Tensor) and id(value) not in model_tensors and not value.requires_grad:
                constant.add(node)
        elif node.op == "call_function" and _deterministic(node):
            if all(a in constant for a in node.all_input_nodes):
                constant.add(node)
    return constant


def _groups(constant: set[torch.fx.Node], position: dict[torch.fx.Node, int]) -> list[list[torch.fx.Node]]:
    """Constant nodes joined by the edges between them, each group in graph order."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {n: n for n in constant}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in constant:
        for arg in node.all_input_nodes:
            if arg in constant:
                parent[find(arg)] = find(node)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in constant:
        groups.setdefault(find(node), []).append(node)
    return [sorted(g, key=position.__getitem__) for g in groups.values()]


def _run(gm: torch.fx.GraphModule, group: list[torch.fx.Node]) -> dict[torch.fx.Node, Any] | None:
    """Each node's value after the group runs on copies of the module's constants; None where the
    run would have changed one of them (the step reads it changed: it cannot be folded)."""
    values: dict[torch.fx.Node, Any] = {}
    originals: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for node in group:
            if node.op == "get_attr":
                original = _attr(gm, str(node.target))
                values[node] = original.clone()
                originals.append((original, values[node]))
            else:
                args = torch.fx.node.map_arg(node.args, values.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
                values[node] = node.target(*args, **kwargs)
    if any(not torch.equal(original, copy) for original, copy in originals):
        return None
    return values


def _views_left_in_place(group: list[torch.fx.Node], constant: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``group`` less the views that only nodes outside it read: they stay in the graph, reading
    the tensor they view, which is folded instead. A folded view would be stored whole: an
    expanded mask at its expanded size, which eager never holds. Removes them from ``constant``."""
    kept = list(group)
    changed = True
    while changed:
        changed = False
        for node in list(kept):
            if (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view and node.users
                    and all(user not in constant for user in node.users)):
                kept.remove(node)
                constant.discard(node)
                changed = True
    return kept


def _read_only_by_saving_ops(node: torch.fx.Node, constant: set[torch.fx.Node]) -> bool:
    """Every node outside the constants that reads ``node`` (through views) saves it for backward."""
    readers = [user for user in node.users if user not in constant]
    while readers:
        reader = readers.pop()
        if isinstance(reader.target, torch._ops.OpOverload) and reader.target.is_view:
            readers.extend(reader.users)
        elif reader.target not in _SAVING_READERS:
            return False
    return True


def _foldable(group: list[torch.fx.Node], constant: set[torch.fx.Node], position: dict[torch.fx.Node, int]) -> bool:
    """The whole group runs before anything outside it reads it, and nothing outside writes into it."""
    outside_reads = [position[u] for n in group for u in n.users if u not in constant]
    if not outside_reads:
        return False
    if max(position[n] for n in group) > min(outside_reads):
        return False
    members = set(group)
    return not any(w in members for n in group for u in n.users if u not in constant for w in _written_args(u))


def fold_constant_index_tensors(gm: torch.fx.GraphModule) -> int:
    """Replace each group of constant nodes whose outside readers read only small integer or
    boolean tensors by those tensors, computed once (module docstring); returns how many tensors
    were folded. Groups that read or write anything else are left as they are."""
    constant = _constant_nodes(gm)
    if not constant:
        return 0
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    folded = 0
    for group in _groups(constant, position):
        group = _views_left_in_place(group, constant)
        if not _foldable(group, constant, position):
            continue
        read = [n for n in group if any(u not in constant for u in n.users)]
        if any(n.op == "get_attr" for n in read):
            continue  # read as it is already: nothing to fold
        traced = [n.meta.get("val") for n in read]
        if not all(isinstance(v, torch.Tensor) and v.dtype in _INTEGRAL
                   and v.numel() * v.element_size() <= FOLDED_CONSTANT_MAX_BYTES for v in traced):
            continue
        if not all(_read_only_by_saving_ops(n, constant) for n in read):
            continue
        values = _run(gm, group)
        if values is None:
            continue
        for node in read:
            name = f"_folded_{node.name}"
            setattr(gm, name, values[node].clone())
            with gm.graph.inserting_before(node), warnings.catch_warnings():
                # a plain tensor attribute, as export holds the constants it lifts: not a buffer
                # of the module (state_dict and buffers() stay the user's)
                warnings.simplefilter("ignore", UserWarning)
                attr = gm.graph.get_attr(name)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr, delete_user_cb=lambda user: user not in constant)
            folded += 1
        for node in reversed(group):
            if not node.users:
                gm.graph.erase_node(node)
    if folded:
        gm.graph.lint()
        gm.recompile()
    log.debug("captured graph: %d constant index tensors computed once", folded)
    return folded
