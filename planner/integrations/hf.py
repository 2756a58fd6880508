"""The HuggingFace Trainer's way in: one callback plans the model on the first batch.

``Trainer(..., callbacks=[PlannerCallback(budget_fraction=0.6)])`` enables the planner on
``trainer.model`` in place when training begins (:func:`planner.integrations.inplace.enable`
with no example inputs): the first training forward plans for the batch exactly as the
Trainer hands it to the model (collated, on the device, with ``num_items_in_batch``), and
every later one runs the plan. The model stays the Trainer's own ``PreTrainedModel``, so
``save_model``, ``from_pretrained``, checkpoints and resuming work unchanged; evaluation runs in
eval mode, on the model's own forward. Needs ``transformers`` (``pip install ckpt-planner[hf]``).

The budget is for one training step's peak (parameters, gradients, activations, temporaries);
optimizer state is outside it: keep room for it with ``reserve_gb``. The Trainer's step takes
the output's ``loss`` and drops the output before ``backward`` (``compute_loss`` returns the
loss alone): the planner's default step (``loss_fn=None``, ``output_held=False``). A custom
``compute_loss`` that applies its own criterion passes it as ``loss_fn``.

Example:
    >>> callback = PlannerCallback(budget_fraction=0.6, timing_repeats=1)
    >>> callback.budget_fraction
    0.6
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from planner.integrations.inplace import check_enable_options, enable, is_enabled

__all__ = ["PlannerCallback"]

log = logging.getLogger(__name__)


class PlannerCallback(TrainerCallback):
    """Plan ``trainer.model`` in place on the first training batch.

    Args:
        budget_gb: peak training-step memory allowed, in GiB.
        budget_fraction: instead of ``budget_gb``: this share of the unoptimized step's peak,
            measured on the first batch.
        **options: any keyword option of :func:`planner.optimize` (``timing_repeats``,
            ``cache_dir``, ``reserve_gb``, ...).

    A model already enabled (by :func:`planner.enable` or an earlier ``train()``) is left as it
    is. Bad options raise :class:`planner.InputError` here, before training starts.

    Example:
        >>> PlannerCallback(budget_gb=1.0, budget_fraction=0.5)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: pass budget_gb or budget_fraction, not both
    """

    def __init__(self, budget_gb: float | None = None, *, budget_fraction: float | None = None,
                 **options: Any) -> None:
        check_enable_options(budget_gb, budget_fraction, options)
        self.budget_gb = budget_gb
        self.budget_fraction = budget_fraction
        self.options = options

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        """Enable the planner on ``model`` (planning happens on its first training forward)."""
        if model is None:
            log.warning("the Trainer passed no model to on_train_begin: nothing planned")
            return
        if is_enabled(model):
            log.info("%s is already enabled: keeping its plan", type(model).__name__)
            return
        enable(model, None, budget_gb=self.budget_gb, budget_fraction=self.budget_fraction, **self.options)
