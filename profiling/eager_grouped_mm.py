"""Make each grouped matmul of a captured graph the call the eager model makes.

HuggingFace's mixture-of-experts layers multiply each expert's tokens with ``torch._grouped_mm``
(``torch.nn.functional.grouped_mm``) eagerly, but while traced (``torch.compile``, and
``torch.export``, which a capture is) they call ``transformers::grouped_mm_fallback`` instead:
a custom op that loops over the experts with one ``mm`` each and whose backward is written in
Python. The captured graph then runs other kernels than the user's model, slower (a 2-layer
Qwen2-MoE steps about 13 % slower on CPU, docs/tuning.md#grouped-mm). :func:`match_eager_grouped_mm`
runs the eager forward once (no autograd, no side effects), records the shapes of its
``aten._grouped_mm`` calls, and where they line up one for one with the graph's fallback calls
rewrites each into the eager op. Anything else is left as it is.

Example:
    >>> import torch
    >>> from transformers.integrations.moe import _grouped_mm
    >>> class Experts(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.randn(2, 8, 8))
    ...     def forward(self, x, offs):
    ...         return _grouped_mm(x, self.weight, offs)
    >>> x, offs = torch.randn(6, 8), torch.tensor([2, 6], dtype=torch.int32)
    >>> gm = torch.export.export(Experts(), (x, offs), strict=False).module()
    >>> match_eager_grouped_mm(gm, Experts(), (x, offs))
    1
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from profiling.attention_masks import traced_shape
from profiling.eager_attention import run_eager_forward

__all__ = ["match_eager_grouped_mm"]

log = logging.getLogger(__name__)

_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _fallback_op() -> Any:
    """HuggingFace's traced grouped matmul, where transformers registered it."""
    namespace = getattr(torch.ops, "transformers", None)
    packet = getattr(namespace, "grouped_mm_fallback", None) if namespace is not None else None
    return getattr(packet, "default", None) if packet is not None else None


class _GroupedMMRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _GROUPED_MM:
            named = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args))
            named.update(kwargs)
            plain = named.get("bias") is None and named.get("out_dtype") is None
            # a call with a bias or an output dtype is not the fallback's: it never matches
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)) if plain else ((), ()))
        return func(*args, **kwargs)


def match_eager_grouped_mm(gm: torch.fx.GraphModule, model: torch.nn.Module, example_inputs: Any) -> int:
    """Rewrite ``gm``'s ``transformers::grouped_mm_fallback`` calls into the ``aten._grouped_mm``
    calls the eager ``model`` makes, where both line up one for one (same count, same input and
    weight shapes, in order). Returns how many were rewritten; ``gm`` is recompiled if any."""
    fallback = _fallback_op()
    if fallback is None:
        return 0
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fallback]
    if not calls:
        return 0
    recorder = _GroupedMMRecorder()
    eager = recorder.shapes if run_eager_forward(model, example_inputs, recorder, "eager grouped matmuls") else None
    if eager is None or len(eager) != len(calls):
        log.debug("grouped matmuls left as traced: %d in the graph, %s eagerly", len(calls),
                  "unknown" if eager is None else len(eager))
        return 0
    named = []
    for node in calls:
        arguments = dict(zip(("input", "weight", "offs"), node.args))
        arguments.update(node.kwargs)
        named.append(arguments)
    if any(set(a) != {"input", "weight", "offs"} or (traced_shape(a["input"]), traced_shape(a["weight"])) != shapes
           for a, shapes in zip(named, eager)):
        log.debug("grouped matmuls left as traced: their shapes differ from the eager calls'")
        return 0
    for node, arguments in zip(calls, named):
        node.target = _GROUPED_MM
        node.args = (arguments["input"], arguments["weight"], arguments["offs"])
        node.kwargs = {}
    gm.graph.lint()
    gm.recompile()
    return len(calls)
