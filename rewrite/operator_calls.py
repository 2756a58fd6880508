"""The rewritten graph's forward calls each ATen operator's C++ entry point directly.

FX writes every operator call as ``torch.ops.aten.mm.default(x, w)``: four attribute lookups
and ``OpOverload.__call__``, a Python frame whose only work is to call the operator's C++
entry point (``OpOverload._op``). Eager PyTorch pays neither, and on a model of small kernels
the difference is most of the captured graph's step-time gap to eager
(docs/tuning.md#direct-operator-calls). :func:`call_operators_directly` gives a graph module
(and the graph modules in its module tree) a forward that calls those entry points, bound once
as globals; :mod:`rewrite.segments` binds each checkpointed segment's graph as it makes it.

The operators, their arguments and their order are FX's own code, so every kernel, rounding
and random stream is the same. Under ``torch.compile`` the forward runs FX's code (Dynamo does
not trace a bound C++ entry point); ``recompile()`` restores FX's forward. ``gm.code`` is
unchanged.

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> x = torch.randn(2, 4)
    >>> gm = make_fx(lambda a: torch.relu(a * 2))(x)  # calls aten.mul.Tensor, aten.relu.default
    >>> call_operators_directly(gm)
    2
    >>> torch.equal(gm(x), torch.relu(x * 2)), "torch.ops.aten.mul.Tensor(" in gm.code
    (True, True)
"""

from __future__ import annotations

import functools
import itertools
import linecache
import logging
from typing import Any

import torch
import torch.fx
from torch._ops import OpOverload
from torch.fx.node import _get_qualified_name

__all__ = ["call_operators_directly", "DIRECT_CALLS"]

log = logging.getLogger(__name__)

#: ``gm.meta`` key: how many operator call sites the bound forward calls directly
DIRECT_CALLS = "checkpoint_planner_direct_operator_calls"

_SOURCE_IDS = itertools.count()


def call_operators_directly(gm: torch.fx.GraphModule) -> int:
    """Give ``gm`` and every graph module inside it a forward that calls ATen operators through
    their C++ entry points (see module docs); returns the number of call sites bound, also kept
    in ``gm.meta[DIRECT_CALLS]``."""
    bound = 0
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            bound += _bind(module)
    gm.meta[DIRECT_CALLS] = bound
    return bound


def _bind(gm: torch.fx.GraphModule) -> int:
    cls = type(gm)
    fx_forward = cls.forward
    if getattr(fx_forward, "_direct_calls", None) is not None:  # bound already, not recompiled since
        return int(fx_forward._direct_calls)
    source = gm.code
    names: dict[str, str] = {}
    operators: dict[str, Any] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or type(target) is not OpOverload:
            continue
        qualified = _get_qualified_name(target)
        if qualified in names:
            continue
        alias = "_op_" + qualified.replace(".", "_")
        names[qualified] = alias
        operators[alias] = target._op
    calls = 0
    for qualified, alias in names.items():
        calls += source.count(qualified + "(")
        source = source.replace(qualified + "(", alias + "(")
    if not calls:
        return 0
    namespace = dict(fx_forward.__globals__)
    namespace.update(operators)
    filename = f"<direct operator calls {next(_SOURCE_IDS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - FX's own code, operators rebound
    direct = namespace["forward"]

    @functools.wraps(fx_forward)
    def forward(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fx_forward(self, *args, **kwargs)
        return direct(self, *args, **kwargs)

    forward._direct_calls = calls  # type: ignore[attr-defined]
    cls.forward = forward
    log.debug("graph module forward: %d operator calls bound to their C++ entry points", calls)
    return calls
