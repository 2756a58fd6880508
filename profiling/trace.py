"""Capture a module's forward as an FX ``GraphModule`` that shares the module's parameters.

``torch.export`` (non-strict) is the default: it records aten-level ops, handles HuggingFace
models that ``torch.fx.symbolic_trace`` cannot, and keeps the output structure (tuples, dicts,
``ModelOutput``). ``symbolic_trace`` records module calls instead and needs Python control
flow that does not depend on tensor values.

Example:
    >>> import torch
    >>> gm = trace_module(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()),
    ...                   (torch.randn(2, 3),))
    >>> any(n.op == "call_function" for n in gm.graph.nodes)
    True
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import torch
import torch.fx

from planner.errors import TraceError
from profiling.measure import StepInputs

__all__ = ["trace_module", "TRACE_METHODS"]

log = logging.getLogger(__name__)

TRACE_METHODS = ("export", "symbolic_trace")


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch, as 'file:line in function'."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/profiling/trace.py" not in path:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown location"


def trace_module(model: torch.nn.Module, example_inputs: Any, method: str = "export") -> torch.fx.GraphModule:
    """Capture ``model`` called on ``example_inputs`` as a GraphModule.

    Args:
        model: the module, in the mode it will train in.
        example_inputs: a tuple of positional arguments or a dict of keyword arguments.
        method: ``"export"`` (``torch.export``, non-strict) or ``"symbolic_trace"``.

    Raises:
        TraceError: capture failed; the message names the module, the source line and a hint.
    """
    if method not in TRACE_METHODS:
        raise TraceError(f"unknown trace method {method!r}; use one of {TRACE_METHODS}")
    inputs = StepInputs.from_example(example_inputs)
    name = type(model).__name__
    try:
        if method == "export":
            program = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
            gm = program.module()
        else:
            if inputs.kwargs:
                raise TraceError(
                    f"symbolic_trace of {name} takes positional inputs only; pass a tuple or use method='export'"
                )
            gm = torch.fx.symbolic_trace(model)
    except TraceError:
        raise
    except Exception as exc:  # capture failures come as many exception types
        hint = (
            "try use_cache=False for HuggingFace models, static shapes, and no data-dependent Python "
            "control flow"
            if method == "export"
            else "try method='export', which handles data-dependent shapes and HuggingFace models"
        )
        raise TraceError(
            f"could not capture {name} with {method} at {_user_frame(exc)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({hint})"
        ) from exc
    _share_parameters(model, gm)
    log.info("captured %s with %s: %d nodes", name, method, len(gm.graph.nodes))
    return gm


def _share_parameters(model: torch.nn.Module, gm: torch.fx.GraphModule) -> None:
    """Make the graph use the user's own parameter and buffer objects, under the same names."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own_buffers = dict(model.named_buffers(remove_duplicate=False))
    for fqn, param in list(gm.named_parameters(remove_duplicate=False)):
        if fqn in own and own[fqn] is not param:
            owner, _, leaf = fqn.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, leaf, own[fqn])
    for fqn, buf in list(gm.named_buffers(remove_duplicate=False)):
        if fqn in own_buffers and own_buffers[fqn] is not buf:
            owner, _, leaf = fqn.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            mod._buffers[leaf] = own_buffers[fqn]
