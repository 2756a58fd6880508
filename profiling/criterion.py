"""The loss taken outside the captured graph, as one node of the profiled step.

The user's step is ``loss_fn(model(x)).backward()``: a criterion outside the model (or, with
no ``loss_fn`` and no ``loss`` in the output, the sum of the outputs) runs after the graph and
saves tensors of its own for the backward (cross-entropy keeps its log-softmax, the size of the
logits). :func:`run_criterion` runs it on the graph's outputs the way the profiling interpreter
runs a node (what autograd saves, FLOPs, time), and :func:`criterion_node` turns that record
into one :class:`planner.core.costgraph.CostNode` that reads the graph's outputs, runs once and
is never recomputed. The simulator then frees the outputs after it, unless the criterion saved
them or the loop holds them (``TrainingStep.output_held``).

Example:
    >>> import torch
    >>> from profiling.measure import TrainingStep
    >>> logits = torch.randn(4, 10, requires_grad=True) * 1.0
    >>> y = torch.tensor([1, 2, 3, 4])
    >>> record = run_criterion(logits, TrainingStep(lambda out: torch.nn.functional.cross_entropy(out, y)),
    ...                        timer=lambda fn: fn() or 0.0)
    >>> record.loss.shape, len(record.saved) > 0
    (torch.Size([]), True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from planner.core.costgraph import CostNode
from profiling.cost_nodes import StorageTable
from profiling.gradient_sharing import is_expanded_view
from profiling.interpreter import SaveRecorder, tensors_of, unpack_saved
from profiling.measure import TrainingStep

__all__ = ["CRITERION_NODE", "CriterionRecord", "run_criterion", "criterion_inputs", "criterion_node", "criterion_name",
           "expanded_gradient_inputs"]

#: Name of the criterion's node in the profile (suffixed where the graph already has the name).
CRITERION_NODE = "loss_fn"


@dataclasses.dataclass
class CriterionRecord:
    """What running the criterion once showed: its loss, what autograd saved, FLOPs, time."""

    loss: torch.Tensor
    saved: list[torch.Tensor]
    flops: int
    time_ms: float


def run_criterion(output: Any, step: TrainingStep, timer: Callable[[Callable[[], Any]], float],
                  on_start: Callable[[], None] | None = None,
                  on_finish: Callable[[], None] | None = None, detach: bool = True) -> CriterionRecord:
    """Take ``step``'s loss of ``output`` once, recording what autograd saves for the backward
    (every tensor its pack hook sees), its FLOPs and its time by ``timer``. ``on_start`` and
    ``on_finish`` bracket the call (a fake-allocation tracker's node window); ``detach``: as
    :class:`profiling.interpreter.SaveRecorder` takes it (False where a backward follows)."""
    saves = SaveRecorder(detach=detach)
    counter = FlopCounterMode(display=False)
    result: list[torch.Tensor] = []

    def take_loss() -> None:
        with torch.autograd.graph.saved_tensors_hooks(saves.pack, unpack_saved), counter:
            result.append(step.loss(output))

    if on_start is not None:
        on_start()
    time_ms = timer(take_loss)
    if on_finish is not None:
        on_finish()
    return CriterionRecord(result[0], saves.close(), int(counter.get_total_flops()), time_ms)


def criterion_inputs(loss: torch.Tensor, outputs: dict[str, Any]) -> tuple[str, ...]:
    """The output nodes (name -> value) whose tensors the loss's backward reaches: the walk
    from ``loss.grad_fn`` stops at the outputs' own autograd nodes, so it covers the
    criterion's ops alone."""
    owner: dict[Any, str] = {}
    for name, value in outputs.items():
        for t in tensors_of(value):
            if t.grad_fn is not None:
                owner.setdefault(t.grad_fn, name)
    reached: dict[str, None] = {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn in owner:
            reached[owner[fn]] = None
            continue
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return tuple(name for name in outputs if name in reached)


def expanded_gradient_inputs(loss: torch.Tensor, outputs: dict[str, Any], reads: Iterable[str],
                             only_read_by_the_loss: Iterable[str]) -> tuple[str, ...]:
    """The output nodes of ``reads`` (name -> value in ``outputs``) whose gradient from
    ``loss`` is an expanded view of the loss's own (a sum: no buffer of the output's size),
    among those nothing but the criterion reads (:mod:`profiling.gradient_sharing`); the
    criterion's backward is run once to see it.

    Example:
        >>> out = torch.randn(4, 8, requires_grad=True) * 1.0
        >>> expanded_gradient_inputs(out.sum(), {"out": out}, ["out"], ["out"])
        ('out',)
        >>> expanded_gradient_inputs(out.square().mean(), {"out": out}, ["out"], ["out"])
        ()
    """
    alone = set(only_read_by_the_loss)
    names = [name for name in reads if name in alone]
    tensors = [(name, t) for name in names for t in tensors_of(outputs[name]) if t.requires_grad]
    if not tensors or not loss.requires_grad:
        return ()
    grads = torch.autograd.grad(loss, [t for _, t in tensors], retain_graph=True, allow_unused=True)
    expanded: dict[str, bool] = {}
    for (name, _), grad in zip(tensors, grads):
        expanded[name] = expanded.get(name, True) and grad is not None and is_expanded_view(grad)
    return tuple(name for name in names if expanded.get(name))


def criterion_node(name: str, record: CriterionRecord, inputs: Iterable[str], table: StorageTable,
                   forward_peak_bytes: int = 0, backward_peak_bytes: int = 0,
                   expanded_inputs: tuple[str, ...] = ()) -> CostNode:
    """The criterion as a node: reads ``inputs`` (output nodes), makes the loss, saves what
    autograd saved (the outputs' own storages where it kept them), never recomputed; the
    gradients of ``expanded_inputs`` are views of the loss's (:func:`expanded_gradient_inputs`)."""
    inputs = tuple(inputs)
    loss_key = table.key(record.loss)
    saved_keys = [k for t in record.saved if (k := table.key(t)) is not None]
    return CostNode(
        name=name,
        op="loss_fn",
        kind="compute",
        input_names=inputs,
        output_storages=() if loss_key is None else (loss_key,),
        saved_storages=tuple(dict.fromkeys(saved_keys)),
        output_bytes=record.loss.numel() * record.loss.element_size(),
        requires_grad=record.loss.requires_grad,
        time_ms=record.time_ms,
        flops=record.flops,
        recomputable=False,
        forward_peak_bytes=forward_peak_bytes,
        backward_peak_bytes=backward_peak_bytes,
        grad_shared_inputs=tuple(n for n in expanded_inputs if n in inputs),
    )


def criterion_name(taken: Iterable[str]) -> str:
    """:data:`CRITERION_NODE`, suffixed until no graph node has the name."""
    names = set(taken)
    name, i = CRITERION_NODE, 1
    while name in names:
        name, i = f"{CRITERION_NODE}_{i}", i + 1
    return name
