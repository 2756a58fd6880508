"""PyTorch Lightning's way in: a callback plans the LightningModule's inner model on the first batch.

``Trainer(callbacks=[PlannerCallback(budget_fraction=0.6)])`` enables the planner in place
(:func:`planner.integrations.inplace.enable`, no example inputs) on ``pl_module.model`` (or the
submodule named by ``submodule``) when fitting starts; the first training forward plans for
the batch the ``training_step`` passes it. The module tree, ``state_dict()`` and so Lightning's
checkpoints are unchanged; validation runs in eval mode, on the model's own forward. Needs
``pytorch-lightning`` (``pip install ckpt-planner[lightning]``); the ``lightning`` package's
``lightning.pytorch`` is used where it is installed instead.

A ``training_step`` applies its criterion outside the planned model
(``F.cross_entropy(self.model(x), y)``) and returns the loss, dropping the output: pass that
criterion as ``loss_fn`` (``PlannerCallback(budget_fraction=0.6, loss_fn=...)``, taking the
model's output) so what it saves for the backward is planned for; without it the step's loss is
the output's ``loss`` field, else the sum of its outputs. ``output_held=True`` for a step that
keeps the output until after ``backward``.

Example:
    >>> PlannerCallback(budget_fraction=0.6).submodule
    'model'
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package
    from pytorch_lightning import Callback, LightningModule, Trainer

from planner.core.errors import InputError
from planner.integrations.inplace import check_enable_options, enable, is_enabled

__all__ = ["PlannerCallback"]

log = logging.getLogger(__name__)


class PlannerCallback(Callback):
    """Plan ``pl_module.<submodule>`` in place on the first training batch.

    Args:
        budget_gb: peak training-step memory allowed, in GiB.
        budget_fraction: instead of ``budget_gb``: this share of the unoptimized step's peak,
            measured on the first batch.
        submodule: the attribute path of the model to plan (``"model"``, ``"net.backbone"``);
            ``""`` plans the LightningModule's own ``forward``.
        **options: any keyword option of :func:`planner.optimize`.

    Example:
        >>> PlannerCallback(budget_gb=-1)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: budget_gb must be a positive finite number of GiB, got -1
    """

    def __init__(self, budget_gb: float | None = None, *, budget_fraction: float | None = None,
                 submodule: str = "model", **options: Any) -> None:
        check_enable_options(budget_gb, budget_fraction, options)
        self.budget_gb = budget_gb
        self.budget_fraction = budget_fraction
        self.submodule = submodule
        self.options = options

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Enable the planner on the submodule (planning happens on its first training forward)."""
        try:
            target = pl_module.get_submodule(self.submodule) if self.submodule else pl_module
        except AttributeError:
            raise InputError(f"{type(pl_module).__name__} has no submodule {self.submodule!r} to plan: pass "
                             f"PlannerCallback(submodule=...) naming the model its training_step calls") from None
        if is_enabled(target):
            log.info("%s is already enabled: keeping its plan", type(target).__name__)
            return
        enable(target, None, budget_gb=self.budget_gb, budget_fraction=self.budget_fraction, **self.options)
