"""The planner inside the training loops people use.

- :mod:`planner.integrations.inplace`: ``enable(model, ...)`` plans ``model`` in place (the same
  object, type, config and ``save_pretrained``), ``disable(model)`` undoes it; what the
  HuggingFace Trainer, Accelerate, PyTorch Lightning and PEFT work with.
- :mod:`planner.integrations.hf`: a ``TrainerCallback`` that plans on the first batch (needs
  ``transformers``: ``pip install ckpt-planner[hf]``).
- :mod:`planner.integrations.lightning`: a Lightning ``Callback`` that plans a LightningModule's
  inner model on the first batch (needs ``pytorch-lightning``: ``pip install ckpt-planner[lightning]``).

This package imports nothing itself, so ``import planner`` stays free of torch.

Example:
    >>> import planner.integrations
    >>> planner.integrations.__name__
    'planner.integrations'
"""
