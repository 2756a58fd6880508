"""Which ATen ops count when the ops of an eager forward are numbered.

The graph-break path names the k-th counted op of the forward ``op<k>`` in its profile
(:mod:`profiling.graph_breaks`, :mod:`profiling.op_times`, :mod:`profiling.op_temporaries`), and
its rewrite (:class:`rewrite.op_regions.RegionRunner`) checkpoints ranges of ops by the same
numbers, so both skip the same ops.

Example:
    >>> "aten.detach.default" in UNCOUNTED_OPS
    True
"""

from __future__ import annotations

__all__ = ["UNCOUNTED_OPS"]

#: Ops autograd dispatches or not depending on whether saved-tensor hooks are active (saving an
#: output detaches it): not counted, so op indices are the same with and without a region open.
UNCOUNTED_OPS = frozenset({"aten.detach.default"})
