"""Check a model and its example inputs before the slow work, with errors that say what to do.

``optimize`` calls :func:`check_model_and_inputs` first, so a model in eval mode, on the meta
device, with nothing to train, or inputs that do not fit ``forward`` fail in milliseconds with
one line instead of deep inside tracing or profiling.

Example:
    >>> import torch
    >>> check_model_and_inputs(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> check_model_and_inputs(torch.nn.Linear(3, 2).eval(), (torch.randn(4, 3),))
    Traceback (most recent call last):
    ...
    planner.core.errors.InputError: model is in eval mode: call model.train() before optimize() ...
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from planner.core.errors import InputError

__all__ = ["check_model_and_inputs", "input_tensors"]


def input_tensors(example_inputs: Any) -> list[torch.Tensor]:
    """Every tensor inside ``example_inputs`` (nested tuples, lists and dicts).

    Example:
        >>> len(input_tensors(({"a": torch.ones(1)}, [torch.ones(2), 3])))
        2
    """
    leaves, _ = torch.utils._pytree.tree_flatten(example_inputs)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _forward_name(model: torch.nn.Module) -> str:
    try:
        signature = str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        signature = "(...)"
    return f"{type(model).__name__}.forward{signature}"


def check_model_and_inputs(model: Any, example_inputs: Any) -> None:
    """Raise :class:`planner.core.errors.InputError` when ``model`` cannot be planned with ``example_inputs``.

    Checked: ``model`` is an ``nn.Module`` in training mode whose parameters and buffers are real
    (not on the meta device); something requires grad (a parameter or an input tensor);
    ``example_inputs`` is a tuple/list of positional arguments or a dict of keyword arguments
    that binds to ``model.forward``; input tensors are real and on the parameters' device.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not model.training:
        raise InputError("model is in eval mode: call model.train() before optimize() (the plan is for "
                         "training steps; inference needs no plan)")
    if not isinstance(example_inputs, (tuple, list, dict)):
        hint = " (wrap a single tensor as (x,))" if isinstance(example_inputs, torch.Tensor) else ""
        raise InputError("example_inputs must be a tuple of positional arguments or a dict of keyword "
                         f"arguments, got {type(example_inputs).__name__}{hint}")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                raise InputError(
                    f"{kind} {name!r} is on the meta device: materialise the model first "
                    "(model.to_empty(device='cpu') and load its weights), or plan without running it on fake tensors: "
                    "profile_graph(..., fake=True, target='h100') or `ckpt-planner report --target h100`"
                )
    tensors = input_tensors(example_inputs)
    for tensor in tensors:
        if tensor.is_meta:
            raise InputError("an example input is on the meta device: pass real tensors shaped like a batch")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and not any(t.requires_grad for t in tensors):
        raise InputError(
            f"nothing to train: {type(model).__name__} has no parameter that requires grad and no input "
            "requires grad, so there is no backward pass whose memory could be planned"
        )
    devices = {p.device for p in trainable} | {b.device for b in model.buffers()}
    for tensor in tensors:
        if devices and tensor.device not in devices:
            raise InputError(
                f"example inputs are on {tensor.device} but the model is on {sorted(map(str, devices))}: "
                "move them to the model's device"
            )
    args, kwargs = (tuple(example_inputs), {}) if not isinstance(example_inputs, dict) else ((), example_inputs)
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(f"example_inputs do not match {_forward_name(model)}: {exc}") from None
    except ValueError:  # no signature available (a C-implemented forward): nothing to check
        pass
