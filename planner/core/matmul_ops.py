"""The matmul-like operators the save-matmuls policy keeps, and what a compiled policy by
operator saves for them (torch-free: names of ATen operators).

Example:
    >>> "aten.linear.default" in SAVED_MATMUL_OPS
    True
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

__all__ = ["SAVED_MATMUL_OPS", "compiled_saved_ops", "segment_saved_ops"]

#: What the save-matmuls policy keeps in a checkpointed layer (docs/tuning.md#saved_matmul_ops).
SAVED_MATMUL_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.matmul.default", "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
})

#: What a matmul-like op of the captured graph runs as when AOTAutograd traces it for
#: ``torch.compile`` (composite ops decompose), for a compiled policy that decides by operator.
_COMPILED_AS = {
    "aten.linear.default": ("aten.linear.default", "aten.mm.default", "aten.addmm.default"),
    "aten.matmul.default": ("aten.matmul.default", "aten.mm.default", "aten.bmm.default"),
    "aten.scaled_dot_product_attention.default": (
        "aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default"),
}


def compiled_saved_ops(kept_ops: Iterable[str], recomputed_ops: Iterable[str]) -> frozenset[str] | None:
    """The operators a compiled policy by operator saves so that a segment keeps the outputs of
    its nodes of ``kept_ops`` and recomputes those of ``recomputed_ops`` (the matmul-like ops,
    :data:`SAVED_MATMUL_OPS`, it does not keep); None where one operator would stand for both.

    Example:
        >>> sorted(compiled_saved_ops(["aten.linear.default"], ["aten.scaled_dot_product_attention.default"]))
        ['aten.addmm.default', 'aten.linear.default', 'aten.mm.default']
        >>> compiled_saved_ops(["aten.linear.default"], ["aten.mm.default"]) is None
        True
    """
    saved = frozenset(op for kept in kept_ops for op in _COMPILED_AS.get(kept, (kept,)))
    recomputed = frozenset(op for other in recomputed_ops for op in _COMPILED_AS.get(other, (other,)))
    return None if saved & recomputed else saved


def segment_saved_ops(ops: Mapping[str, str], kept: Collection[str]) -> frozenset[str] | None:
    """What a compiled policy by operator saves for a segment whose nodes run ``ops`` (node name
    -> operator name) and keep the outputs of ``kept``: None where ``kept`` is empty, holds a
    node that is not matmul-like, or one operator would stand for a kept and a recomputed node.

    Example:
        >>> sorted(segment_saved_ops({"a": "aten.addmm.default", "b": "aten.relu.default"}, {"a"}))
        ['aten.addmm.default']
        >>> segment_saved_ops({"a": "aten.addmm.default", "b": "aten.relu.default"}, {"b"}) is None
        True
    """
    if not kept or any(ops.get(name) not in SAVED_MATMUL_OPS for name in kept):
        return None
    return compiled_saved_ops([ops[name] for name in kept],
                              [op for name, op in ops.items() if name not in kept and op in SAVED_MATMUL_OPS])
