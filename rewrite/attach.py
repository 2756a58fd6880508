"""Share a rewritten graph's parameters and buffers with the user's own module tree."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["attach_to_user_modules", "share_module_state"]


def _resolve(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def attach_to_user_modules(gm: torch.fx.GraphModule, original: torch.nn.Module) -> bool:
    """Make ``gm`` read its parameters and buffers through ``original``'s own module objects.

    After this, anything that swaps a parameter on the user's modules (FSDP's unshard and
    reshard, ``load_state_dict(assign=True)``, ``to_empty``) is what the graph reads, and
    ``state_dict()`` of a module sharing ``original``'s tree has exactly the user's keys.
    Returns False (and leaves ``gm`` alone) when some ``get_attr`` of the graph does not name
    the same object in ``original``.

    Example:
        >>> from profiling.trace import trace_module
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> gm = trace_module(model, (torch.randn(2, 4),))
        >>> attach_to_user_modules(gm, model), gm._modules["0"] is model[0]
        (True, True)
    """
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _resolve(gm, node.target)
        if isinstance(value, torch.Tensor) and _resolve(original, node.target) is not value:
            if node.target.split(".")[0] in gm._modules or node.target in gm._parameters or node.target in gm._buffers:
                return False
    own = {name: mod for name, mod in gm._modules.items() if name not in original._modules}
    if any(isinstance(mod, torch.nn.Module) and next(mod.parameters(), None) is not None for mod in own.values()):
        return False
    if set(gm._parameters) - set(original._parameters) or set(gm._buffers) - set(original._buffers):
        return False
    gm._modules = {**original._modules, **own}
    gm._parameters = original._parameters
    gm._buffers = original._buffers
    return True


def share_module_state(wrapper: torch.nn.Module, tree: torch.nn.Module) -> None:
    """Make ``wrapper``'s submodules, parameters and buffers ``tree``'s own objects, so its
    ``state_dict()`` keys, ``parameters()`` and ``.to()`` are the user's module's.

    Example:
        >>> inner, outer = torch.nn.Linear(2, 2), torch.nn.Module()
        >>> share_module_state(outer, inner)
        >>> list(outer.state_dict()) == list(inner.state_dict())
        True
    """
    wrapper._modules = tree._modules
    wrapper._parameters = tree._parameters
    wrapper._buffers = tree._buffers
    wrapper._non_persistent_buffers_set = tree._non_persistent_buffers_set
