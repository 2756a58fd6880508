"""A new tensor filled slice by slice, as one recomputable node.

Models build a tensor from parts by writing into a fresh buffer:

    key_states = k_nope.new_empty(*shape, nope_dim + rope_dim)
    key_states[..., :nope_dim].copy_(k_nope)
    key_states[..., nope_dim:].copy_(k_rot)

The captured graph keeps the writes: ``new_empty``, then ``slice`` and ``copy_`` per part. An
in-place write must run exactly once, so each ``copy_`` splits the recomputable runs of its
layer, and a plan cannot checkpoint the layer whole as a person does. Nothing outside the three
lines sees the buffer before it is full, so recomputing them together is safe:
:func:`group_slice_fills` turns each such group into one node calling :func:`filled_by_slices`,
which runs the same ops in the same order (the same kernels, the same autograd graph) on a buffer
of its own, and writes nothing it did not make.

Example:
    >>> class Parts(torch.nn.Module):
    ...     def forward(self, a, b):
    ...         out = a.new_empty(2, 5)
    ...         out[:, :3].copy_(a)
    ...         out[:, 3:].copy_(b)
    ...         return out.sin()
    >>> a, b = torch.randn(2, 3), torch.randn(2, 2)
    >>> gm = torch.export.export(Parts(), (a, b), strict=False).module()
    >>> group_slice_fills(gm)
    1
    >>> torch.equal(gm(a, b), Parts()(a, b))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from profiling.inplace_activations import fresh_output

__all__ = ["group_slice_fills", "filled_by_slices"]

_SLICE = torch.ops.aten.slice.Tensor
_COPY = torch.ops.aten.copy_.default


def filled_by_slices(create: Any, create_args: tuple[Any, ...], create_kwargs: dict[str, Any],
                     slices: tuple[tuple[Any, ...], ...], *sources: torch.Tensor) -> torch.Tensor:
    """``create(*create_args, **create_kwargs)``, then each ``aten.slice(out, *slices[i])``
    written with ``copy_`` from ``sources[i]``, in order; returns the filled tensor.

    Example:
        >>> out = filled_by_slices(torch.ops.aten.new_empty.default, (torch.zeros(1), [2, 3]), {},
        ...                        ((1, 0, 1), (1, 1, 3)), torch.ones(2, 1), torch.zeros(2, 2))
        >>> out.tolist()
        [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    out = create(*create_args, **create_kwargs)
    for slice_args, source in zip(slices, sources):
        _COPY(_SLICE(out, *slice_args), source)
    return out


def _fill_group(buffer: torch.fx.Node, order: dict[torch.fx.Node, int]
                ) -> tuple[list[tuple[torch.fx.Node, torch.fx.Node]], list[torch.fx.Node]] | None:
    """The (slice, copy_) pairs writing ``buffer`` and its readers after the last write, where
    every write is a ``copy_`` into a one-reader ``aten.slice`` of it whose result nobody reads,
    and no other reader runs before the last write. None otherwise."""
    writes: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    readers: list[torch.fx.Node] = []
    for user in buffer.users:
        if user.target is _SLICE and user.args[0] is buffer and len(user.users) == 1:
            (copy,) = user.users
            if (copy.target is _COPY and copy.args[0] is user and len(copy.args) == 2 and not copy.kwargs
                    and not copy.users and isinstance(copy.args[1], torch.fx.Node)):
                writes.append((user, copy))
                continue
        readers.append(user)
    if not writes:
        return None
    writes.sort(key=lambda pair: order[pair[1]])
    last = order[writes[-1][1]]
    if any(order[r] < last for r in readers):
        return None  # something reads the buffer before it is full
    return writes, readers


def group_slice_fills(gm: torch.fx.GraphModule) -> int:
    """Replace each fresh tensor written slice by slice with ``copy_`` (and read only after the
    last write) by one :func:`filled_by_slices` node at the last write: the same ops, in one node
    that writes no tensor it did not make, so it can be recomputed. Returns how many were
    grouped; ``gm`` is changed in place and recompiled.

    Example:
        >>> class Parts(torch.nn.Module):
        ...     def forward(self, a):
        ...         out = torch.empty(2, 4)
        ...         out[:, :2].copy_(a)
        ...         out[:, 2:].copy_(a * 2)
        ...         return out
        >>> gm = torch.export.export(Parts(), (torch.randn(2, 2),), strict=False).module()
        >>> group_slice_fills(gm), sum(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes)
        (1, 0)
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for buffer in list(gm.graph.nodes):
        if not fresh_output(buffer):
            continue
        group = _fill_group(buffer, order)
        if group is None:
            continue
        writes, readers = group
        last_copy = writes[-1][1]
        with gm.graph.inserting_after(last_copy):
            filled = gm.graph.call_function(
                filled_by_slices,
                (buffer.target, tuple(buffer.args), dict(buffer.kwargs), tuple(tuple(s.args[1:]) for s, _ in writes),
                 *(copy.args[1] for _, copy in writes)))
        filled.meta = dict(buffer.meta)
        for reader in readers:
            reader.replace_input_with(buffer, filled)
        for slice_node, copy in writes:
            gm.graph.erase_node(copy)
            gm.graph.erase_node(slice_node)
        gm.graph.erase_node(buffer)
        order[filled] = order[last_copy]
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
