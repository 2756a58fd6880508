"""The rewrite stage: a plan applied to a captured graph, and the module ``optimize`` returns.

- :mod:`rewrite.segments`: :func:`apply_plan` runs each planned segment under
  ``torch.utils.checkpoint`` (:class:`CheckpointedSegment`).
- :mod:`rewrite.checkpointed_module`: :class:`CheckpointedModule`, the rewritten graph behind
  the user's module tree, re-planned for inputs it was not planned for
  (:class:`PlannedVariant`, :data:`ReplanFunction`).
- :mod:`rewrite.attach`: :func:`attach_to_user_modules`, the graph reading the user's
  parameters and buffers.
- :mod:`rewrite.signature`: :func:`input_signature` and :func:`describe_inputs`, what a
  variant is specialised to.
- :mod:`rewrite.units`: FSDP2 units.
"""

from __future__ import annotations

from rewrite.attach import attach_to_user_modules
from rewrite.checkpointed_module import FSDP_UNITS_IN_FLIGHT, CheckpointedModule, PlannedVariant, ReplanFunction
from rewrite.segments import PRISTINE_GRAPH, CheckpointedSegment, apply_plan
from rewrite.signature import describe_inputs, input_signature

__all__ = [
    "apply_plan",
    "attach_to_user_modules",
    "describe_inputs",
    "input_signature",
    "CheckpointedSegment",
    "CheckpointedModule",
    "PlannedVariant",
    "ReplanFunction",
    "PRISTINE_GRAPH",
    "FSDP_UNITS_IN_FLIGHT",
]
