"""The cache key of an op-stream profile (:func:`profiling.graph_breaks.profile_op_stream`).

A graph-break profile has no captured graph to fingerprint, and its storages are named by their
addresses, which differ from run to run. Its key is the recorded step itself, before anything
is timed or measured: each op with what it reads, returns and saves, storages numbered by first
use, parameters, buffers and inputs named by the storages they hold, and the op's module path,
with what :func:`profiling.cache.measurement_parts` says of the machine and the training step.
"""

from __future__ import annotations

from typing import Any

from planner.core.costgraph import CostGraph
from profiling.cache import digest, measurement_parts
from profiling.measure import TrainingStep

__all__ = ["op_stream_fingerprint"]

#: the fields of a node that say what the step computes and holds (not what it measured)
_STRUCTURE_FIELDS = ("op", "kind", "output_bytes", "requires_grad", "is_alias", "flops", "recomputable",
                     "is_random", "module", "after_last_save_fraction")


def op_stream_fingerprint(graph: CostGraph, tensors: list[Any], step: TrainingStep) -> str:
    """SHA-256 naming the profile of an op stream: what :func:`profiling.cache.measurement_parts`
    says of the machine and the step, and the stream's ops, storages and module paths with
    storages numbered by first use (their addresses differ from run to run).

    Example:
        >>> import torch
        >>> from profiling.graph_breaks import profile_op_stream
        >>> lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
        >>> a = profile_op_stream(lin, (x,), timing_repeats=1)
        >>> b = profile_op_stream(lin, (x,), timing_repeats=1)
        >>> op_stream_fingerprint(a, [x], TrainingStep()) == op_stream_fingerprint(b, [x], TrainingStep())
        True
        >>> op_stream_fingerprint(a, [x], TrainingStep(output_held=True)) == op_stream_fingerprint(a, [x], TrainingStep())
        False
    """
    persistent_kinds = ("param", "buffer", "input")
    by_name = {node.name: node for node in graph.nodes}
    number: dict[int, int] = {}
    names: dict[str, str] = {}

    def canonical(key: int) -> int:
        return number.setdefault(key, len(number))

    def label(name: str) -> str:
        # a parameter, buffer or input: named by its first use, since its node is named by its address
        node = by_name.get(name)
        if node is None or node.kind not in persistent_kinds:
            return name
        if name not in names:
            names[name] = f"{node.kind}{[canonical(k) for k in node.output_storages]}"
        return names[name]

    ops = []
    for node in graph.nodes:
        if node.kind in persistent_kinds:
            continue
        inputs = [label(n) for n in node.input_names]
        outputs = [canonical(k) for k in node.output_storages]
        saved = [canonical(k) for k in node.saved_storages]
        fields = ",".join(f"{f}={getattr(node, f)!r}" for f in _STRUCTURE_FIELDS)
        ops.append(f"{node.name}|{inputs}|{outputs}|{saved}|{fields}")
    unused = sorted((n.kind, n.output_bytes) for n in graph.nodes
                    if n.kind in persistent_kinds and n.name not in names)
    parts = [*measurement_parts(tensors, step=step), "graph-breaks", *ops, f"unused {unused}"]
    parts += sorted(f"storage {number[s.key]} {s.size_bytes} {s.persistent}" for s in graph.storages if s.key in number)
    parts.append(f"other storages {sorted((s.size_bytes, s.persistent) for s in graph.storages if s.key not in number)}")
    parts += [f"outputs {[label(n) for n in graph.output_names]}",
              f"ops {graph.metadata.get('op_names')} {graph.metadata.get('subgraphs')}"]
    return digest(parts)
