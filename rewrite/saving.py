"""How the modules ``optimize`` returns save: as the model would, or refused before training.

:class:`rewrite.checkpointed_module.CheckpointedModule` and
:class:`rewrite.module_checkpoint.ModuleCheckpointedModule` wrap the user's model; their
``state_dict()`` is the model's own, tied weights included (two keys, one tensor), as
``model.state_dict()`` is. What saves a wrapper:

- ``opt.save_pretrained(...)`` (and ``push_to_hub``) call the model's own, where it has one:
  tied weights deduplicated, the config written, ``from_pretrained`` loads it.
- ``torch.save(opt)`` pickles the model and the plan; the rewritten graph does not pickle, so
  the loaded module captures it again on its first training call (no profiling: the profile is
  kept).
- ``torch.save(opt.state_dict())``, Accelerate's ``save_state`` and Lightning checkpoints save
  the model's tensors as they save the model's.
- The HuggingFace ``Trainer`` saves a module that is not a ``PreTrainedModel`` as one
  safetensors file of its ``state_dict()``: no config, so ``from_pretrained`` cannot load it,
  and tied weights make it fail at the end of training. A wrapper of a ``PreTrainedModel`` (or
  a PEFT model) therefore refuses a training call from inside a ``Trainer``
  (:func:`refuse_a_trainer_that_cannot_save`): ``planner.enable`` or ``PlannerCallback`` plan
  the model in place, which the Trainer saves as its own.
"""

from __future__ import annotations

import sys
from typing import Any

from planner.core.errors import InputError

__all__ = ["SavesAsTheModel", "refuse_a_trainer_that_cannot_save", "saves_as_pretrained", "TRAINER_FRAMES_SEARCHED"]

#: How many calling frames :func:`refuse_a_trainer_that_cannot_save` looks through for a
#: ``Trainer``: its ``compute_loss`` calls the module through ``nn.Module.__call__``, an
#: Accelerate mixed-precision wrapper and the forward wrapper, under 10 frames deep.
TRAINER_FRAMES_SEARCHED = 32


def saves_as_pretrained(model: Any) -> bool:
    """Whether the HuggingFace Trainer saves ``model`` with ``save_pretrained`` (a
    ``PreTrainedModel`` or a PEFT model), rather than as a bare state dict.

    Example:
        >>> import torch
        >>> saves_as_pretrained(torch.nn.Linear(2, 2))
        False
    """
    for module_name, class_name in (("transformers.modeling_utils", "PreTrainedModel"), ("peft", "PeftModel")):
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(model, cls):
            return True
    return False


def refuse_a_trainer_that_cannot_save(original: Any) -> None:
    """Raise :class:`planner.InputError` when this call comes from a HuggingFace ``Trainer``
    that would save the wrapper of ``original`` as a bare state dict (``original`` is a
    ``PreTrainedModel`` or a PEFT model); otherwise return. Called on each training call: the
    Trainer's first comes before any optimizer step. Without ``transformers.trainer`` imported,
    or for another model, it returns at once; otherwise it reads at most
    :data:`TRAINER_FRAMES_SEARCHED` frames (microseconds).

    Example:
        >>> import torch
        >>> refuse_a_trainer_that_cannot_save(torch.nn.Linear(2, 2))   # not a Trainer's model: nothing to do
    """
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(trainer_module, "Trainer", None)
    if trainer_class is None or not saves_as_pretrained(original):
        return
    frame = sys._getframe(1)
    for _ in range(TRAINER_FRAMES_SEARCHED):
        if frame is None:
            return
        if isinstance(frame.f_locals.get("self"), trainer_class):
            name = type(original).__name__
            raise InputError(
                f"the HuggingFace Trainer saves optimize()'s module as a bare state dict (no config; tied weights "
                f"fail at save_model): plan {name} in place instead, Trainer(model=planner.enable(model, batch, "
                f"budget_gb=...)) or callbacks=[PlannerCallback(budget_gb=...)]")
        frame = frame.f_back


#: The model's own saving methods a wrapper answers with, where the model has them.
_SAVING_METHODS = frozenset({"save_pretrained", "push_to_hub"})


class SavesAsTheModel:
    """Mixin of the wrappers (before ``torch.nn.Module`` in the bases; the instance has
    ``original``): ``save_pretrained`` and ``push_to_hub`` are the model's own, and a training
    call from a ``Trainer`` that would save the wrapper as a bare state dict is refused."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            original = self.__dict__.get("original")
            if name in _SAVING_METHODS and original is not None and hasattr(original, name):
                return getattr(original, name)
            raise

    def _check_the_caller(self) -> None:
        """On each training call: :func:`refuse_a_trainer_that_cannot_save` (the planner's own
        measured steps call the module too, so the first call is not always the Trainer's)."""
        refuse_a_trainer_that_cannot_save(self.__dict__["original"])
