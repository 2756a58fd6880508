"""Make each attention call of a captured graph the call the eager model makes.

``torch.export`` traces HuggingFace attention down a path of its own: the causal mask is built
as a tensor and passed to ``scaled_dot_product_attention`` (eager passes no mask and
``is_causal=True``), and grouped-query attention repeats the key and value heads
(``repeat_kv``: ``expand`` and ``reshape``) where eager passes the unrepeated heads with
``enable_gqa=True``. Each pair computes the same function with other kernels: other rounding of
the outputs and gradients, another dropout random stream, other saved tensors. The graph must be
the user's computation, so :func:`match_eager_attention` runs the eager forward once (no
autograd, no side effects), records how it called attention, and rewrites each graph call that
differs in one of these two ways into the eager call. Calls that already match, and calls it
cannot line up with an eager call, are left as they are.

Example:
    >>> import torch
    >>> class Attention(torch.nn.Module):
    ...     def forward(self, q):
    ...         if torch.compiler.is_exporting():   # as HuggingFace does while traced
    ...             i = torch.arange(q.shape[-2])
    ...             mask = i[:, None] >= i[None, :]
    ...             return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> q = torch.randn(1, 2, 4, 8)
    >>> gm = torch.export.export(Attention(), (q,), strict=False).module()
    >>> match_eager_attention(gm, Attention(), (q,))
    1
    >>> torch.equal(gm(q), Attention()(q))
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from profiling.attention_masks import (SDPA_ARGUMENTS, attention_nodes, drop_added_visible_masks, drop_constant_masks,
                                       named_arguments, share_constant_masks_over_batch, traced_shape)
from profiling.measure import StepInputs, preserved_state

__all__ = ["EagerAttentionCall", "eager_attention_calls", "match_eager_attention", "run_eager_forward"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# ops repeat_kv's ``x[:, :, None, :, :]`` becomes under export, besides the unsqueeze itself
_FULL_VIEWS = (_aten.slice.Tensor, _aten.alias.default)
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


@dataclass(frozen=True)
class EagerAttentionCall:
    """How the eager model called ``scaled_dot_product_attention`` once."""

    has_mask: bool
    is_causal: bool
    enable_gqa: bool
    key_shape: tuple[int, ...]
    #: the mask is one sample's expanded over a batch of several (stride 0 in dimension 0)
    mask_shared_over_batch: bool = False
    #: the mask's shape (empty without one)
    mask_shape: tuple[int, ...] = ()


class _EnoughCalls(Exception):
    """Raised by the recorder once it holds the calls it was asked for, to end the forward there."""


class _AttentionRecorder(TorchFunctionMode):
    def __init__(self, stop_after: int | None) -> None:
        super().__init__()
        self.calls: list[EagerAttentionCall] = []
        self.stop_after = stop_after

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(SDPA_ARGUMENTS, args))
            named.update(kwargs)
            key, mask = named.get("key"), named.get("attn_mask")
            self.calls.append(EagerAttentionCall(
                has_mask=mask is not None, is_causal=bool(named.get("is_causal")),
                enable_gqa=bool(named.get("enable_gqa")),
                key_shape=tuple(key.shape) if isinstance(key, torch.Tensor) else (),
                mask_shared_over_batch=isinstance(mask, torch.Tensor) and mask.dim() >= 1 and mask.shape[0] > 1
                and mask.stride(0) == 0,
                mask_shape=tuple(mask.shape) if isinstance(mask, torch.Tensor) else ()))
            if self.stop_after is not None and len(self.calls) >= self.stop_after:
                raise _EnoughCalls
        return func(*args, **kwargs)


def eager_attention_calls(model: torch.nn.Module, example_inputs: Any,
                          stop_after: int | None = None) -> list[EagerAttentionCall] | None:
    """Run ``model``'s forward once, without autograd and without side effects (RNG, buffers and
    gradients restored), and return how it called ``scaled_dot_product_attention``, in order;
    ``None`` when the forward fails. With ``stop_after``, the forward ends at that call, before
    running it: what follows the last attention (in a language model the output head, most of
    the forward's time) cannot change the calls already recorded.

    Example:
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, q):
        ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> eager_attention_calls(Attention(), (torch.randn(1, 1, 3, 4),))
        [EagerAttentionCall(has_mask=False, is_causal=True, enable_gqa=False, key_shape=(1, 1, 3, 4), mask_shared_over_batch=False, mask_shape=())]
    """
    recorder = _AttentionRecorder(stop_after)
    if not run_eager_forward(model, example_inputs, recorder, "eager attention calls"):
        return None
    return recorder.calls


def run_eager_forward(model: torch.nn.Module, example_inputs: Any, recorder: Any, what: str) -> bool:
    """Run ``model``'s forward once under ``recorder`` (a torch function or dispatch mode), without
    autograd and without side effects (RNG, buffers and gradients restored). False when the
    forward fails (``what`` names the record in the debug log): it ran under export already, so a
    failure here only means the record is unknown. A recorder ends the forward early by raising
    :class:`_EnoughCalls`.

    Example:
        >>> from torch.utils._python_dispatch import TorchDispatchMode
        >>> class Count(TorchDispatchMode):
        ...     ops = 0
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         Count.ops += 1
        ...         return func(*args, **(kwargs or {}))
        >>> run_eager_forward(torch.nn.Linear(2, 2), (torch.randn(1, 2),), Count(), "ops"), Count.ops > 0
        (True, True)
    """
    inputs = StepInputs.from_example(example_inputs)
    try:
        with preserved_state(model), torch.no_grad(), recorder:
            model(*inputs.args, **inputs.kwargs)
    except _EnoughCalls:
        pass
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("%s not recorded: %s", what, exc)
        return False
    return True


def _unrepeated(node: Any, kv_shape: tuple[int, ...]) -> torch.fx.Node | None:
    """The tensor of shape ``kv_shape`` (batch, kv heads, length, head dim) that ``node`` repeats
    head by head (``repeat_kv``: unsqueeze at dim 2, expand, reshape), or ``None`` when ``node`` is
    not exactly that."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES):
        return None
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.target is _aten.expand.default):
        return None
    batch, kv_heads, length, head_dim = kv_shape
    expanded, repeated = traced_shape(expand), traced_shape(node)
    if expanded is None or repeated is None or len(expanded) != 5 or \
            (expanded[0], expanded[1], expanded[3], expanded[4]) != (batch, kv_heads, length, head_dim) or \
            repeated != (batch, kv_heads * expanded[2], length, head_dim):
        return None
    current = expand.args[0]
    unsqueezed = False
    while isinstance(current, torch.fx.Node) and current.op == "call_function":
        if current.target is _aten.unsqueeze.default and not unsqueezed and current.args[1] == 2:
            unsqueezed = True
        elif current.target in _FULL_VIEWS and traced_shape(current) == traced_shape(current.args[0]) and \
                (current.target is _aten.alias.default or (current.args[4:5] or (1,))[0] == 1):
            pass
        else:
            break
        current = current.args[0]
        if unsqueezed and traced_shape(current) == kv_shape:
            return current
    return None


def _use_unrepeated_heads(node: torch.fx.Node, call: EagerAttentionCall) -> list[torch.fx.Node]:
    """Pass the unrepeated key and value heads with ``enable_gqa=True``, as eager did; returns
    the repeating nodes no longer read here (empty when nothing changed)."""
    named = named_arguments(node)
    if not call.enable_gqa or named.get("enable_gqa") or len(call.key_shape) != 4:
        return []
    key, value = _unrepeated(named.get("key"), call.key_shape), _unrepeated(named.get("value"), call.key_shape)
    if key is None or value is None:
        return []
    query, repeated_key, repeated_value = named.pop("query"), named.pop("key"), named.pop("value")
    named["enable_gqa"] = True
    node.args, node.kwargs = (query, key, value), named
    return [repeated_key, repeated_value]


def _erase_unused(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    """Erase ``nodes`` and the views they were made of, as far as nothing else reads them."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.op != "call_function" or node.users or node.graph is not gm.graph:
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        stack.extend(inputs)


def match_eager_attention(gm: torch.fx.GraphModule, model: torch.nn.Module, example_inputs: Any) -> int:
    """Rewrite ``gm``'s attention calls into the calls the eager ``model`` makes on
    ``example_inputs``: a constant causal or all-visible mask dropped where eager passes none,
    repeated key/value heads replaced by ``enable_gqa=True`` where eager uses it, a constant mask
    repeated per sample held once where eager expands one sample's mask over the batch, a constant
    all-visible mask the traced graph adds to the model's own mask dropped where eager passes
    that mask alone (:func:`profiling.attention_masks.drop_added_visible_masks`). Returns how
    many calls changed. The eager forward runs only when ``gm`` has attention, and only up to
    the call that pairs with the graph's last; when eager makes fewer calls than the graph,
    nothing changes.
    """
    nodes = attention_nodes(gm)
    if not nodes:
        return 0
    calls = eager_attention_calls(model, example_inputs, stop_after=len(nodes))
    if calls is None or len(calls) != len(nodes):
        log.debug("attention calls kept as traced: eager made %s, the graph has %d",
                  "unknown" if calls is None else len(calls), len(nodes))
        return 0
    eager = dict(zip(nodes, calls))
    repeats = {node: _use_unrepeated_heads(node, eager[node]) for node in nodes}
    _erase_unused(gm, [r for repeated in repeats.values() for r in repeated])
    changed = {node for node, repeated in repeats.items() if repeated}
    changed |= drop_constant_masks(
        gm, lambda node, causal: not eager[node].has_mask and eager[node].is_causal == causal)
    changed |= share_constant_masks_over_batch(gm, lambda node: eager[node].mask_shared_over_batch)
    changed |= drop_added_visible_masks(gm, lambda node: eager[node].mask_shape)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return len(changed)
