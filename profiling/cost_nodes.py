"""Turn the interpreter's per-node records into the ``CostNode`` objects of a ``CostGraph``.

:class:`StorageTable` gives every distinct storage seen during the profiling run a small
integer key (``Storage.key``); :func:`cost_nodes` then says, for every FX node, which storages
its outputs live in and which autograd saved, its kind, its bytes and times, and whether it
can be recomputed or kept by a selective checkpoint policy.

Example:
    >>> import torch
    >>> table = StorageTable()
    >>> x = torch.ones(4)
    >>> table.key(x, persistent=True), table.key(x[1:]), table.storages[0].size_bytes
    (0, 0, 16)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from planner.core.costgraph import CostNode, Storage
from profiling.custom_functions import AUTOGRAD_FUNCTION
from profiling.gradient_sharing import grad_shared_inputs
from profiling.interpreter import tensors_of

__all__ = ["StorageTable", "cost_nodes"]


class StorageTable:
    """Gives every distinct storage seen during the run a small integer key."""

    def __init__(self) -> None:
        self.key_of_ptr: dict[int, int] = {}
        self.storages: list[Storage] = []
        self.keep: list[torch.Tensor] = []  # no storage is freed, so no address is reused

    def key(self, t: torch.Tensor, persistent: bool = False) -> int | None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        ptr = storage._cdata  # the StorageImpl: shared by views, works for fake tensors too
        if ptr not in self.key_of_ptr:
            self.key_of_ptr[ptr] = len(self.storages)
            self.storages.append(Storage(len(self.storages), nbytes, persistent))
            self.keep.append(t)
        return self.key_of_ptr[ptr]


def _keepable(node: torch.fx.Node, is_alias: bool, record: dict[str, Any]) -> bool:
    """Whether a selective checkpoint policy can keep the node's outputs from the forward
    instead of recomputing them (:mod:`planner.solvers.keep`): a function call that writes nothing in
    place, aliases no input and draws no random numbers (skipping a random op in the recompute
    would shift the random stream of the ops after it)."""
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return False  # a wrapped subgraph (e.g. torch.no_grad regions), not one op
    if node.target is AUTOGRAD_FUNCTION:
        return False  # its ops dispatch one by one, below where a selective policy sees the node
    return (node.op == "call_function" and not is_alias and not record["mutating"]
            and not record["writes_in_place"] and not _is_random(node))


def _is_random(node: torch.fx.Node) -> bool:
    if node.target is AUTOGRAD_FUNCTION:
        return True  # a custom Function's Python may draw random numbers: replay the RNG state
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return True
    name = str(node.target)
    return any(word in name for word in ("dropout", "rand", "bernoulli", "normal", "multinomial"))


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return str(node.target) if node.op == "call_module" else ""


def cost_nodes(
    gm: torch.fx.GraphModule,
    records: dict[str, dict[str, Any]],
    table: StorageTable,
    forward_peaks: dict[str, int],
    backward_peaks: dict[str, int],
    backward_late_scratch: dict[str, int] | None = None,
) -> tuple[CostNode, ...]:
    """One ``CostNode`` per node of ``gm`` but its output, from the interpreter's ``records``
    (:class:`profiling.interpreter.ProfilingInterpreter`) and the measured or estimated peaks
    of each node's forward and backward (:mod:`profiling.temporaries`); ``backward_late_scratch``
    is the part of each backward peak reached after the node's backward function returned
    (:meth:`profiling.temporaries.FakeAllocationTracker.backward_late_scratch`; None: none known)."""
    late = backward_late_scratch or {}
    values = {name: rec["result"] for name, rec in records.items()}
    nodes: list[CostNode] = []
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        rec = records[n.name]
        outs = tensors_of(rec["result"])
        if n.op == "placeholder":
            kind = "input"
        elif n.op == "get_attr":
            kind = "param" if n.target in params else ("buffer" if n.target in buffers else "constant")
        else:
            kind = "compute"
        inputs = tuple(dict.fromkeys(a.name for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)))
        input_ptrs = {
            t.untyped_storage()._cdata
            for name in inputs
            for t in tensors_of(records[name]["result"])
        }
        out_keys = [k for t in outs if (k := table.key(t, persistent=kind != "compute")) is not None]
        saved_keys = [k for t in rec["saved"] if (k := table.key(t)) is not None]
        is_alias = kind == "compute" and bool(outs) and all(
            t.untyped_storage()._cdata in input_ptrs for t in outs
        )
        nodes.append(
            CostNode(
                name=n.name,
                op=str(n.target) if n.op != "placeholder" else "placeholder",
                kind=kind,
                input_names=inputs,
                output_storages=tuple(dict.fromkeys(out_keys)),
                saved_storages=tuple(dict.fromkeys(saved_keys)),
                output_bytes=sum(t.numel() * t.element_size() for t in outs if t.is_floating_point() or t.is_complex()),
                requires_grad=any(t.requires_grad for t in outs),
                is_alias=is_alias,
                time_ms=rec["time_ms"] if kind == "compute" else 0.0,
                flops=rec["flops"] if kind == "compute" else 0,
                # run-once buffer updates skip themselves on recompute (profiling.trace)
                recomputable=kind == "compute" and (not rec["mutating"] or rec["run_once"]),
                is_random=kind == "compute" and _is_random(n),
                module=_module_of(n),
                forward_peak_bytes=forward_peaks.get(n.name, 0) if kind == "compute" else 0,
                backward_peak_bytes=backward_peaks.get(n.name, 0) if kind == "compute" else 0,
                backward_late_scratch_bytes=min(late.get(n.name, 0), backward_peaks.get(n.name, 0))
                if kind == "compute" else 0,
                selective_save=kind == "compute" and _keepable(n, is_alias, rec),
                after_last_save_fraction=rec["after_last_save_fraction"] if kind == "compute" else None,
                after_last_save_time_fraction=rec.get("after_last_save_time_fraction") if kind == "compute" else None,
                viewed_storages=tuple(dict.fromkeys(
                    k for t in rec["input_views"] if (k := table.key(t)) is not None)) if kind == "compute" else (),
                grad_shared_inputs=grad_shared_inputs(n, values) if kind == "compute" else (),
            )
        )
    return tuple(nodes)
