"""What a rewritten graph is specialised to, and how to name it in a log line.

A captured graph holds its input shapes, dtypes and non-tensor values as constants, and a plan
depends on the autocast state it was profiled under: :class:`rewrite.checkpointed_module.CheckpointedModule`
keys its planned variants on :func:`input_signature` and :func:`autocast_state`, and names
inputs with :func:`describe_inputs`. The modules that wrap a model give their ``forward`` the
model's own signature (:class:`ForwardWithTheModelsSignature`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from profiling.measure import StepInputs

__all__ = ["input_signature", "describe_inputs", "autocast_state", "ForwardWithTheModelsSignature", "signature_of"]


def input_signature(inputs: StepInputs) -> tuple[Any, ...]:
    """What a captured graph is specialised to: the input structure, each tensor's shape, dtype
    and device, and the value of every non-tensor input.

    Example:
        >>> import torch
        >>> a = input_signature(StepInputs.from_example((torch.ones(8, 4),)))
        >>> a == input_signature(StepInputs.from_example((torch.zeros(8, 4),)))
        True
        >>> a == input_signature(StepInputs.from_example((torch.ones(2, 4),)))
        False
    """
    flat = _flat_signature(inputs)
    if flat is not None:
        return flat
    leaves, spec = tree_flatten((inputs.args, inputs.kwargs))
    return (str(spec), tuple(_leaf_signature(leaf) for leaf in leaves))


_PLAIN = (bool, int, float, str)


def _leaf_signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device.type)
    if leaf is None or isinstance(leaf, _PLAIN):
        return leaf
    return type(leaf).__qualname__


def _flat_signature(inputs: StepInputs) -> tuple[Any, ...] | None:
    """The signature of inputs that are tensors, ``None`` and plain values, positional or by
    keyword, without a pytree walk: it runs every training step, right after a backward has
    emptied the CPU caches, so one plain loop and no call per input. ``None`` for anything
    nested."""
    leaves: list[Any] = []
    for value in (*inputs.args, *inputs.kwargs.values()):
        if type(value) is torch.Tensor:
            leaves.append((value.shape, value.dtype, value.device.type))
        elif value is None or isinstance(value, _PLAIN):
            leaves.append(value)
        else:
            return None
    return ("flat", len(inputs.args), tuple(inputs.kwargs), tuple(leaves))


def describe_inputs(inputs: StepInputs) -> str:
    """Shapes and dtypes of the tensor inputs, e.g. ``"arg0=8x64 float32"``.

    Example:
        >>> import torch
        >>> describe_inputs(StepInputs.from_example({"input_ids": torch.ones(2, 16, dtype=torch.long)}))
        'input_ids=2x16 int64'
    """
    parts = []
    for path, leaf in tree_flatten_with_path((inputs.args, inputs.kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        first = path[1] if len(path) > 1 else None
        if hasattr(first, "key"):  # a keyword argument
            name = f"{first.key}{keystr(path[2:])}"
        else:
            name = f"arg{getattr(first, 'idx', 0)}{keystr(path[2:])}"
        shape = "x".join(str(d) for d in leaf.shape) or "scalar"
        parts.append(f"{name}={shape} {str(leaf.dtype).replace('torch.', '')}")
    return ", ".join(parts) or "no tensors"


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast devices and dtypes active now (part of what a plan was profiled under)."""
    state: tuple[tuple[str, str], ...] = ()
    for device in _autocast_devices():  # a plain loop: it runs every training step
        if torch.is_autocast_enabled(device):
            state += ((device, str(torch.get_autocast_dtype(device))),)
    return state


@functools.cache
def _autocast_devices() -> tuple[str, ...]:
    """The devices whose autocast state a plan depends on (asked once: it runs every step)."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class ForwardWithTheModelsSignature:
    """The ``forward`` of a module that wraps a model (``CheckpointedModule``,
    ``ModuleCheckpointedModule``): the owner's ``_checkpointed_forward``, whose
    ``inspect.signature`` is the instance's ``_forward_signature``, the wrapped model's own
    (``input_ids``, ``labels``, ...), so libraries that read it, such as the HuggingFace Trainer
    choosing which dataset columns to pass, see the model's arguments rather than
    ``*args, **kwargs``."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return owner._checkpointed_forward
        call = functools.partial(owner._checkpointed_forward, instance)
        call.__signature__ = instance._forward_signature  # type: ignore[attr-defined]
        return call


def signature_of(module: torch.nn.Module) -> inspect.Signature | None:
    """``inspect.signature(module.forward)``, or None where inspect cannot read it.

    Example:
        >>> str(signature_of(torch.nn.Linear(2, 2)))
        '(input: torch.Tensor) -> torch.Tensor'
    """
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: the generic one stands
        return None
