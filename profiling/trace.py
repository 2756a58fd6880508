"""Capture a module's forward as an FX ``GraphModule`` that shares the module's parameters.

``torch.export`` (non-strict) is the default: it records aten-level ops, handles HuggingFace
models that ``torch.fx.symbolic_trace`` cannot, and keeps the output structure (tuples, dicts,
``ModelOutput``). ``symbolic_trace`` records module calls instead and needs Python control
flow that does not depend on tensor values.

After capture, each training-mode ``batch_norm`` that updates running statistics is split so a
whole conv-BatchNorm-ReLU block can be recomputed while its buffers change exactly once per
step (:mod:`profiling.batch_norm_updates`).
In-place ops on activations that nothing else observes (``x += residual``) become out-of-place,
so the ops before them can be recomputed too.

A HuggingFace model is captured with ``use_cache=False`` (:func:`profiling.capture_guards.training_step_without_kv_cache`):
every HF config defaults to ``use_cache=True``, a training step needs no key/value cache, and a
cache in the output is a type ``torch.export`` cannot flatten. The model's config is unchanged
after capture, and in eval mode the model returns its cache as before.

When capture fails, :class:`planner.core.errors.TraceError` names the submodule (its qualified name
and class), the source line, and what to change.

Example:
    >>> import torch
    >>> gm = trace_module(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()),
    ...                   (torch.randn(2, 3),))
    >>> any(n.op == "call_function" for n in gm.graph.nodes)
    True
"""

from __future__ import annotations

import linecache
import logging
from types import TracebackType
from typing import Any

import torch
import torch.fx

from planner.core.errors import InputError, TraceError
from planner.core.options import TRACE_METHODS
from profiling.attention_masks import simplify_constant_attention_masks
from profiling.batch_norm_updates import split_batch_norm_updates
from profiling.capture_guards import no_node_stack_traces, partial_graph_kept_off_stderr, training_step_without_kv_cache
from profiling.custom_functions import custom_functions_as_ops
from profiling.constant_folding import fold_constant_index_tensors
from profiling.eager_attention import match_eager_attention
from profiling.eager_grouped_mm import match_eager_grouped_mm
from profiling.inplace_activations import functionalize_inplace_activations
from profiling.slice_fills import group_slice_fills
from profiling.measure import StepInputs

__all__ = ["trace_module", "prepare_saved_program", "functionalize_inplace_activations", "TRACE_METHODS"]

log = logging.getLogger(__name__)


def _frames(exc: BaseException) -> list[tuple[str, int, str, Any]]:
    """(file, line, function, ``self`` or None) for every traceback frame, outermost first,
    following ``__cause__``/``__context__`` into the exception that started it."""
    out: list[tuple[str, int, str, Any]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    chain: list[BaseException] = []
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for e in reversed(chain):
        tb: TracebackType | None = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            out.append((frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name, frame.f_locals.get("self")))
            tb = tb.tb_next
    return out


def _is_library(path: str) -> bool:
    path = path.replace("\\", "/")
    return path.startswith("<") or "/torch/" in path or "/profiling/trace.py" in path


def _location(exc: BaseException, model: torch.nn.Module) -> tuple[str, str]:
    """The failing submodule (qualified name and class) and source line ('file:line in fn: code')."""
    names = {id(m): name for name, m in model.named_modules()}
    module = f"{type(model).__name__} (the top-level module)"
    source = "unknown location"
    frames = _frames(exc)
    for path, line, func, owner in reversed(frames):
        if _is_library(path):
            continue
        code = linecache.getline(path, line).strip()
        source = f"{path}:{line} in {func}" + (f" (`{code}`)" if code else "")
        break
    for path, line, func, owner in reversed(frames):
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            name = names[id(owner)]
            module = f"{name or '<root>'} ({type(owner).__name__})"
            break
    return module, source


def _hint(exc: BaseException, method: str, source: str = "") -> str:
    """What to change, from the kind of failure (and the failing source line)."""
    text = " ".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    kind = type(exc).__name__
    if "(`raise " in source:
        return ("the model's own code rejected the example inputs at that line: change the inputs or the "
                "model's config as its message says, and trace again")
    if "Cache" in text and ("output" in text or "pytree" in text) or "past_key_values" in text:
        return ("the model returns a key/value cache: build it with use_cache=False "
                "(config.use_cache=False, or pass use_cache=False in the inputs)")
    if "data-dependent" in text or "DataDependent" in kind or "GuardOnDataDependent" in kind:
        return ("Python control flow or a shape depends on tensor values at that line (if on a tensor, "
                ".item(), .tolist(), nonzero or boolean masks): make it static for the example shapes, "
                "e.g. branch on shapes or config values instead of tensor contents, use torch.where, or "
                "compute the value outside forward and pass it in")
    if "not a known type" in text or "register a pytree" in text:
        return ("an input or output has a type torch.export cannot flatten: return tensors, tuples, dicts "
                "or dataclasses, or register the type with torch.utils._pytree.register_pytree_node")
    if "Dynamic" in text and "shape" in text or "Constraint" in kind:
        return "use static shapes: call optimize with the exact batch and sequence shapes you train with"
    if method == "export":
        return ("try use_cache=False for HuggingFace models, static shapes, no data-dependent Python "
                "control flow, or trace_method='symbolic_trace'")
    return "try method='export', which handles data-dependent shapes and HuggingFace models"


def trace_module(model: torch.nn.Module, example_inputs: Any, method: str = "export", *,
                 recomputable_batch_norm: bool = True, functionalize: bool = True,
                 simplify_attention_masks: bool = False) -> torch.fx.GraphModule:
    """Capture ``model`` called on ``example_inputs`` as a GraphModule.

    Args:
        model: the module, in the mode it will train in.
        example_inputs: a tuple of positional arguments or a dict of keyword arguments.
        method: ``"export"`` (``torch.export``, non-strict) or ``"symbolic_trace"``.
        recomputable_batch_norm: split training ``batch_norm`` into a running-statistics update
            (run once) and a pure, recomputable normalisation (see
            :func:`split_batch_norm_updates`).
        functionalize: make in-place ops on activations out-of-place where nothing else sees
            the write (see :func:`functionalize_inplace_activations`), and make each fresh
            tensor filled slice by slice one node (see :func:`group_slice_fills`), so the ops
            before them stay recomputable.
        simplify_attention_masks: drop every constant causal or all-visible attention mask
            (``is_causal`` instead), whatever the eager model passes: a faster kernel that changes
            rounding and the attention-dropout stream (opt-in; recorded in
            ``gm.meta["computation_changes"]``). By default a constant mask is dropped only
            where the eager model itself calls that attention without one
            (:mod:`profiling.attention_masks`), so the graph computes what the model computes.

    Raises:
        TraceError: capture failed; the message names the submodule, the source line and a hint.

    Example:
        >>> bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
        >>> gm = trace_module(bn, (torch.randn(8, 4),))
        >>> sum(n.name.endswith("update_stats") for n in gm.graph.nodes)
        1
    """
    if method not in TRACE_METHODS:
        raise TraceError(f"unknown trace method {method!r}; use one of {TRACE_METHODS}")
    inputs = StepInputs.from_example(example_inputs)
    name = type(model).__name__
    try:
        if method == "export":
            with training_step_without_kv_cache(model) as turned_off, custom_functions_as_ops() as functions, \
                    partial_graph_kept_off_stderr(), no_node_stack_traces():
                program = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
            if functions:
                names = ", ".join(dict.fromkeys(f.__qualname__ for f in functions))
                raise TraceError(
                    f"could not capture {name} exactly: it applies the custom autograd.Function {names}, whose "
                    f"outputs are not new tensors (an input, a view or not a tensor), so a captured graph would "
                    f"replace its own backward by autograd of its forward ops")
            if turned_off:
                log.info("captured %s with use_cache=False (%d configs; a training step needs no key/value cache; "
                         "the model's config is unchanged)", name, turned_off)
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
        module, source = _location(exc, model)
        first_line = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise TraceError(
            f"could not capture {name} with {method}: in submodule {module}, at {source}: "
            f"{type(exc).__name__}: {first_line} -- what to do: {_hint(exc, method, source)}"
        ) from exc
    _share_parameters(model, gm)
    split = split_batch_norm_updates(gm) if recomputable_batch_norm and method == "export" else 0
    functional = functionalize_inplace_activations(gm) if functionalize and method == "export" else 0
    fills = group_slice_fills(gm) if functionalize and method == "export" else 0
    masks, changes, folded = 0, (), 0
    if method == "export" and simplify_attention_masks:
        masks = simplify_constant_attention_masks(gm)
        if masks:
            changes = (f"{masks} attention calls use is_causal or no mask instead of their constant mask "
                       f"(--simplify-attention-masks): another kernel, other rounding and dropout stream",)
    elif method == "export":
        masks = match_eager_attention(gm, model, example_inputs)
    if method == "export":
        _drop_metadata_asserts(gm)
        _drop_export_call_hooks(gm)
        match_eager_grouped_mm(gm, model, example_inputs)
        folded = fold_constant_index_tensors(gm)
    gm.meta["computation_changes"] = changes
    log.info("captured %s with %s: %d nodes%s%s%s%s%s", name, method, len(gm.graph.nodes),
             f", {split} batch_norm running-stat updates split out" if split else "",
             f", {functional} in-place ops on activations made out-of-place" if functional else "",
             f", {fills} tensors filled slice by slice made one node each" if fills else "",
             f", {masks} attention calls {'simplified' if simplify_attention_masks else 'made as the eager model makes them'}"
             if masks else "",
             f", {folded} constant index tensors computed once" if folded else "")
    return gm


def _drop_metadata_asserts(gm: torch.fx.GraphModule) -> int:
    """Erase the ``aten._assert_tensor_metadata`` checks export puts after each ``Tensor.to``
    (dtype and device as traced); returns how many. They compute nothing, and a step runs only
    on inputs of the signature it was captured for (another signature is captured anew), but
    each is a dispatched call per step: on a 4-layer Llama, 18 of them made the captured step
    about 5 % slower than without (docs/tuning.md#metadata-asserts)."""
    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users
               and n.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:
        gm.recompile()
    log.debug("captured graph: %d tensor-metadata checks erased", len(asserts))
    return len(asserts)


def _drop_export_call_hooks(gm: torch.fx.GraphModule) -> int:
    """Remove the module hooks ``torch.export``'s ``module()`` puts around every call, where they
    check nothing a captured step needs; returns how many. The input-structure check repeats
    what the plan lookup keys on (a step runs only on inputs of the signature it was captured
    for; the graph's own guards still check shapes), and the pair that registers module-typed
    inputs as pytree nodes does nothing without such inputs. Any hook on a module takes every
    call off ``nn.Module``'s fast path: on a 2-layer Llama the three cost about 2 % of the
    forward (docs/tuning.md#export-call-hooks)."""
    from torch.export._unlift import _check_input_constraints_pre_hook

    def empty_pair(hook: Any) -> bool:
        cells = [c.cell_contents for c in (getattr(hook, "__closure__", None) or ())]
        return "_create_stateful_graph_module" in getattr(hook, "__qualname__", "") and \
            len(cells) == 1 and isinstance(cells[0], (set, frozenset)) and not cells[0]

    dropped = 0
    for hooks in (gm._forward_pre_hooks, gm._forward_hooks):
        for key, hook in list(hooks.items()):
            if hook is _check_input_constraints_pre_hook or empty_pair(hook):
                del hooks[key]
                gm._forward_pre_hooks_with_kwargs.pop(key, None)
                gm._forward_hooks_with_kwargs.pop(key, None)
                gm._forward_hooks_always_called.pop(key, None)
                dropped += 1
    return dropped


def _eval_mode_ops(gm: torch.fx.GraphModule) -> list[str]:
    """What in ``gm`` only an eval-mode export makes, one phrase per op: ``batch_norm`` reading
    its running statistics (``training=False``) and ``dropout`` with ``train=False``."""
    found = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.batch_norm.default and len(node.args) > 5 and node.args[5] is False \
                and isinstance(node.args[3], torch.fx.Node):
            found.append("batch_norm reads its running statistics")
        elif node.target is torch.ops.aten.dropout.default and len(node.args) > 2 and node.args[2] is False:
            found.append("dropout is off")
    return found


def prepare_saved_program(gm: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
    """Make a saved ``torch.export`` program's module plannable as :func:`trace_module` makes a
    captured one: training BatchNorm split into a run-once update and a recomputable
    normalisation, in-place ops on activations made out-of-place. A program exported in eval
    mode is refused, since the plan is for a training step.

    Raises:
        InputError: the program was exported in eval mode.

    Example:
        >>> bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> program = torch.export.export(bn.train(), (torch.randn(8, 4),), strict=False)
        >>> gm = prepare_saved_program(program.module(), "bn.pt2")
        >>> sum(n.name.endswith("update_stats") for n in gm.graph.nodes)
        1
        >>> prepare_saved_program(torch.export.export(bn.eval(), (torch.randn(8, 4),), strict=False).module(),
        ...                       "bn.pt2")
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: bn.pt2 was exported in eval mode (batch_norm reads its running statistics): \
this tool plans a training step; export the model after model.train()
    """
    eval_ops = _eval_mode_ops(gm)
    if eval_ops:
        raise InputError(f"{name} was exported in eval mode ({eval_ops[0]}): this tool plans a training step; "
                         f"export the model after model.train()")
    split = split_batch_norm_updates(gm)
    functional = functionalize_inplace_activations(gm)
    log.info("prepared %s: %d batch_norm running-stat updates split out, %d in-place ops on activations made "
             "out-of-place", name, split, functional)
    gm.meta["computation_changes"] = ()
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
