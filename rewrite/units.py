"""FSDP2 units inside a flat captured graph: run each sharded submodule's hooks around its ops.

``fully_shard(block)`` registers forward hooks on ``block`` that gather its parameters before
its forward, free them after, gather them again when gradients reach its outputs and
reduce-scatter its gradients after its backward. The rewritten graph never calls ``block``:
its ops sit inline in one flat graph. So, for every sharded submodule (a *unit*), the graph
gets two extra nodes: ``_enter_module`` before the unit's first op runs the module's forward
pre-hooks on the activations entering it, and ``_exit_module`` after its last op runs the
forward hooks on the activations leaving it. The unit's parameters are read after
``_enter_module`` (when they are gathered). A checkpointed segment never spans two units, so
a recompute only runs ops of a unit whose parameters backward has already gathered.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    >>> gm = trace_module(model, (torch.randn(2, 4),))
    >>> calls = []
    >>> _ = model[2].register_forward_pre_hook(lambda module, args: calls.append("enter"))
    >>> insert_unit_hooks(gm, model, ("2",))
    >>> _ = gm(torch.randn(2, 4))
    >>> calls
    ['enter']
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx

from planner.core.errors import PlannerError

__all__ = ["fsdp_unit_paths", "unit_of_nodes", "insert_unit_hooks", "barrier_nodes", "ModuleRef"]


def fsdp_unit_paths(module: torch.nn.Module) -> tuple[str, ...]:
    """Qualified names of the submodules of ``module`` (not itself) that ``fully_shard`` wrapped.

    Example:
        >>> fsdp_unit_paths(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        ()
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return ()
    return tuple(name for name, m in module.named_modules() if m is not module and isinstance(m, FSDPModule))


class ModuleRef:
    """A module handed to graph nodes without becoming a submodule of the graph."""

    __slots__ = ("module", "path")

    def __init__(self, module: torch.nn.Module, path: str) -> None:
        self.module = module
        self.path = path

    def __repr__(self) -> str:
        return f"ModuleRef({self.path!r})"


def _enter_module(ref: ModuleRef, *args: Any) -> tuple[Any, ...]:
    """The module's forward pre-hooks on the activations entering it (FSDP: gather parameters)."""
    module = ref.module
    kwargs: dict[str, Any] = {}
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return tuple(args)


def _exit_module(ref: ModuleRef, inputs_count: int, *values: Any) -> tuple[Any, ...]:
    """The module's forward hooks on the activations leaving it (FSDP: free parameters, hook
    the outputs' gradients to gather them again in backward)."""
    module = ref.module
    args, output = values[:inputs_count], tuple(values[inputs_count:])
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, {}, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = tuple(result)
    return output


def _getitem(values: tuple[Any, ...], index: int) -> Any:
    return values[index]


def unit_of_nodes(graph: torch.fx.Graph, units: tuple[str, ...]) -> dict[str, str]:
    """For each ``call_function`` node, the innermost unit its op belongs to ("" for none)."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        inside = [u for u in units if u in paths]
        out[node.name] = max(inside, key=len) if inside else ""
    return out


def _ranges(graph: torch.fx.Graph, units: tuple[str, ...],
            wanted: tuple[str, ...] | None = None) -> dict[str, list[torch.fx.Node]]:
    """The contiguous run of ops of each unit in ``wanted`` (default all); a unit whose ops
    interleave with others' is refused."""
    owner = unit_of_nodes(graph, units)
    calls = [n for n in graph.nodes if n.op == "call_function"]
    out: dict[str, list[torch.fx.Node]] = {}
    for unit in units if wanted is None else wanted:
        positions = [i for i, n in enumerate(calls) if owner[n.name] == unit or owner[n.name].startswith(unit + ".")]
        if not positions:
            continue
        run = calls[positions[0]:positions[-1] + 1]
        strangers = [n.name for n in run if not (owner[n.name] == unit or owner[n.name].startswith(unit + "."))]
        if strangers:
            raise PlannerError(
                f"fully_shard on {unit!r}: its ops are interleaved with other ops in the captured graph "
                f"({', '.join(strangers[:3])}); shard a module whose ops run in one piece (a whole block)"
            )
        out[unit] = run
    return out


def barrier_nodes(graph: torch.fx.Graph, units: tuple[str, ...]) -> frozenset[str]:
    """Nodes a checkpointed segment must start at: the first op of every unit and the first op
    after it. Keeping them out of recompute keeps every segment inside one unit.

    Example:
        >>> from profiling.trace import trace_module
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        >>> sorted(barrier_nodes(trace_module(model, (torch.randn(2, 4),)).graph, ("1",)))
        ['linear_1', 'tanh']
    """
    calls = [n for n in graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(calls)}
    out: set[str] = set()
    for run in _ranges(graph, units).values():
        out.add(run[0].name)
        after = index[run[-1]] + 1
        if after < len(calls):
            out.add(calls[after].name)
    return frozenset(out)


def insert_unit_hooks(gm: torch.fx.GraphModule, root: torch.nn.Module, units: tuple[str, ...]) -> None:
    """Insert ``_enter_module`` / ``_exit_module`` around the ops of each unit of ``root`` in
    ``gm`` (an unrewritten captured graph) and move the reads of the unit's parameters after
    ``_enter_module``. Nested units are handled innermost last. ``gm`` is recompiled."""
    graph = gm.graph
    for k, unit in enumerate(sorted(units, key=lambda u: u.count("."))):  # outer units first: inner ranges stay valid
        run = _ranges(graph, units, (unit,)).get(unit)
        if not run:
            continue
        inside = set(run)
        own_attrs = [n for n in graph.nodes if n.op == "get_attr" and str(n.target).startswith(unit + ".")]
        leaks = [n.name for n in own_attrs for user in n.users if user not in inside]
        if leaks:
            raise PlannerError(f"fully_shard on {unit!r}: its parameters are also read outside it ({leaks[0]}); "
                               f"shard a module that owns all the parameters it shares")
        own = set(own_attrs)
        entering = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside and a not in own))
        attr = f"fsdp_unit_{k}"
        setattr(gm, attr, ModuleRef(root.get_submodule(unit), unit))  # a plain attribute, not a submodule
        with graph.inserting_before(run[0]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
            ref = graph.get_attr(attr)
            enter = graph.call_function(_enter_module, (ref, *entering))
            entered = [graph.call_function(_getitem, (enter, i)) for i in range(len(entering))]
            for node in own_attrs:  # read the parameters once they are gathered
                moved = graph.get_attr(node.target)
                moved.meta = dict(node.meta)
                node.replace_all_uses_with(moved)
                graph.erase_node(node)
        for old, new in zip(entering, entered):
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user in inside)
        leaving = [n for n in run if any(user not in inside for user in n.users)]
        with graph.inserting_after(run[-1]):
            exit_node = graph.call_function(_exit_module, (ref, len(entered), *entered, *leaving))
        anchor = exit_node
        for i, node in enumerate(leaving):
            with graph.inserting_after(anchor):
                item = graph.call_function(_getitem, (exit_node, i))
            item.meta = {key: value for key, value in node.meta.items() if key != "nn_module_stack"}
            node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside and user is not exit_node)
            anchor = item
    graph.lint()
    gm.recompile()
