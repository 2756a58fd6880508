"""BatchNorm's running-statistics updates as nodes of their own, so a recomputed segment may hold them.

:func:`split_batch_norm_updates` turns each training-mode ``batch_norm`` that updates running
statistics into ``update_running_stats`` (the running-statistics update, the same kernel as
``batch_norm``'s) and a pure ``batch_norm`` without running statistics (same output and
gradients, bit for bit); ``num_batches_tracked += 1`` becomes ``increment_buffer``. The two
update ops skip themselves when a checkpoint recomputes them inside backward, so a whole
conv-BatchNorm-ReLU block can be recomputed while its buffers change exactly once per step.
:func:`merge_batch_norm_updates` undoes the split where no segment holds the BatchNorm.

Example:
    >>> bn = torch.nn.BatchNorm1d(4).train()
    >>> gm = torch.export.export(bn, (torch.randn(8, 4),), strict=False).module()
    >>> split_batch_norm_updates(gm), merge_batch_norm_updates(gm, frozenset())
    (1, 1)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["split_batch_norm_updates", "merge_batch_norm_updates", "update_running_stats", "increment_buffer",
           "RUN_ONCE_OPS"]


def _in_backward() -> bool:
    """True while autograd's engine runs, e.g. when a checkpoint recomputes its segment."""
    return torch._C._current_graph_task_id() != -1


@torch.fx.node.has_side_effect
def update_running_stats(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                         momentum: float) -> None:
    """Update BatchNorm running statistics from ``x`` in place, as training ``batch_norm`` does.

    Uses ``aten.batch_norm_update_stats``, the kernel ``batch_norm`` itself runs on CPU, so the
    buffers end bit for bit as after the original op. Nothing is returned or differentiated.
    Inside a backward pass (a checkpointed segment being recomputed) it does nothing, so the
    update happens once per step even when its segment is recomputed.

    Example:
        >>> rm, rv = torch.zeros(2), torch.ones(2)
        >>> update_running_stats(torch.ones(4, 2), rm, rv, 0.5)
        >>> rm.tolist()
        [0.5, 0.5]
    """
    if _in_backward():
        return
    with torch.no_grad():
        torch.ops.aten.batch_norm_update_stats.default(x.detach(), running_mean, running_var, momentum)


@torch.fx.node.has_side_effect
def increment_buffer(buffer: torch.Tensor, amount: Any) -> None:
    """``buffer += amount`` in place (BatchNorm's ``num_batches_tracked``), skipped when re-run by a
    checkpoint's recompute inside backward.

    Example:
        >>> count = torch.zeros((), dtype=torch.long)
        >>> increment_buffer(count, 1)
        >>> int(count)
        1
    """
    if _in_backward():
        return
    with torch.no_grad():
        buffer.add_(amount)


#: Ops that change buffers once per step and skip themselves when a checkpoint recomputes them:
#: safe inside a recomputed segment.
RUN_ONCE_OPS = (update_running_stats, increment_buffer)


def split_batch_norm_updates(gm: torch.fx.GraphModule) -> int:
    """Make training BatchNorm recomputable without updating its buffers twice.

    Each training ``aten.batch_norm`` with running statistics becomes an
    :func:`update_running_stats` node plus a pure ``batch_norm`` without running statistics
    (same output and gradients, bit for bit), and each unused in-place ``add_`` on a buffer
    (``num_batches_tracked += 1``) becomes :func:`increment_buffer`. Both skip themselves when
    a checkpoint recomputes them, so they may sit inside a recomputed segment.

    Returns how many ``batch_norm`` nodes were split; ``gm`` is changed in place and recompiled.

    Example:
        >>> bn = torch.nn.BatchNorm1d(4).train()
        >>> gm = torch.export.export(bn, (torch.randn(8, 4),), strict=False).module()
        >>> split_batch_norm_updates(gm)
        1
    """
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    count = 0
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if (node.target is torch.ops.aten.add_.Tensor and not node.users and len(node.args) == 2
                and not node.kwargs and isinstance(node.args[0], torch.fx.Node)
                and node.args[0].op == "get_attr" and node.args[0].target in buffers
                and isinstance(node.args[1], (int, float))):
            node.target = increment_buffer
            changed = True
            continue
        if node.target is not torch.ops.aten.batch_norm.default or node.kwargs or len(node.args) < 9:
            continue
        args = list(node.args)
        x, _, _, running_mean, running_var, training, momentum = args[:7]
        if not (training is True and isinstance(running_mean, torch.fx.Node)
                and isinstance(running_var, torch.fx.Node) and isinstance(momentum, float)):
            continue
        with gm.graph.inserting_before(node):
            update = gm.graph.call_function(update_running_stats, (x, running_mean, running_var, momentum))
        update.name = gm.graph._graph_namespace.create_name(f"{node.name}_update_stats", None)
        update.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        args[3] = args[4] = None
        node.args = tuple(args)
        count += 1
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return count


def merge_batch_norm_updates(gm: torch.fx.GraphModule, in_segments: frozenset[str]) -> int:
    """Undo :func:`split_batch_norm_updates` for every BatchNorm whose nodes ``in_segments``
    does not name: its ``batch_norm`` takes its running statistics back and updates them itself, one
    kernel over the activations instead of two. A split costs a pass over the BatchNorm's input
    that only a recomputed segment needs (docs/tuning.md#batch-norm-merge).

    Returns how many were merged; ``gm`` is changed in place, not recompiled.

    Example:
        >>> bn = torch.nn.BatchNorm1d(4).train()
        >>> gm = torch.export.export(bn, (torch.randn(8, 4),), strict=False).module()
        >>> split_batch_norm_updates(gm)
        1
        >>> merge_batch_norm_updates(gm, frozenset())
        1
        >>> sum(n.target is update_running_stats for n in gm.graph.nodes)
        0
    """
    merged = 0
    for update in list(gm.graph.nodes):
        if update.op != "call_function" or update.target is not update_running_stats or update.name in in_segments:
            continue
        x, running_mean, running_var, momentum = update.args
        norm = update.next
        if (norm.op != "call_function" or norm.target is not torch.ops.aten.batch_norm.default
                or norm.name in in_segments or norm.args[0] is not x or norm.args[3] is not None
                or norm.args[4] is not None or norm.args[6] != momentum):
            continue
        args = list(norm.args)
        args[3], args[4] = running_mean, running_var
        norm.args = tuple(args)
        gm.graph.erase_node(update)
        merged += 1
    return merged
