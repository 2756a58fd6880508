"""Plan a model in place: ``enable(model, ...)`` returns the same object, whose training forward
runs the checkpointed graph; ``disable(model)`` gives it back its own forward.

:func:`planner.optimize` returns a wrapper, which training loops built around
``PreTrainedModel`` (``save_pretrained``, ``generate``, PEFT, ``from_pretrained``) do not
accept. :func:`enable` keeps the model's identity, type, ``config``, ``state_dict()`` and hooks,
and installs one instance attribute, ``model.forward``: in training (``model.training`` and
grad enabled) it runs the graph that ``optimize`` planned, otherwise the forward the model had.
Its ``inspect.signature`` is the model's own, so the HuggingFace Trainer picks the same
dataset columns.

``example_inputs=None`` defers planning to the first training forward, which plans for the
inputs it is called with (what :class:`planner.integrations.hf.PlannerCallback` uses: the
batch exactly as the training loop hands it to the model). ``budget_fraction`` sets the
budget to that share of the step's measured unoptimized peak.

A deep copy of an enabled model is enabled with its own copy of the plan. Pickling
(``torch.save(model)``) keeps the model and drops the plan: the unpickled model runs its own
forward (plan it again with :func:`enable`).

Example:
    >>> import torch
    >>> from planner import enable, disable
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    >>> x = torch.randn(8, 16)
    >>> enable(model, (x,), budget_gb=1.0) is model
    True
    >>> plan_of(model).budget_bytes == 2**30
    True
    >>> model(x).shape, type(model).__name__
    (torch.Size([8, 16]), 'Sequential')
    >>> disable(model) is model, is_enabled(model)
    (True, False)
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import types
from typing import Any

import torch

from planner.core.errors import InputError
from planner.core.options import check_budget_choice
from planner.core.plan import GIB, Plan
from planner.pipeline import optimize
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes
from rewrite.checkpointed_module import CheckpointedModule
from rewrite.graph_breaks import BreakCheckpointedModule
from rewrite.module_checkpoint import ModuleCheckpointedModule

__all__ = ["enable", "disable", "is_enabled", "plan_of", "checkpointed_module_of", "check_enable_options"]

log = logging.getLogger(__name__)

#: ``optimize``'s keyword options, which ``enable`` passes on (the budget is ``enable``'s own).
_OPTIONS = frozenset(name for name, p in inspect.signature(optimize).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY) - {"budget_fraction"}


def check_enable_options(budget_gb: float | None, budget_fraction: float | None, options: dict[str, Any]) -> None:
    """Raise :class:`InputError` unless exactly one of ``budget_gb`` and ``budget_fraction`` is
    given, valid, and every name in ``options`` is an option of :func:`planner.optimize`.

    Example:
        >>> check_enable_options(None, 0.6, {"timing_repeats": 1})
        >>> check_enable_options(1.0, 0.6, {})
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: pass budget_gb or budget_fraction, not both
    """
    check_budget_choice(budget_gb, budget_fraction)
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise InputError(f"unknown option {unknown[0]!r}; enable takes optimize's options: {', '.join(sorted(_OPTIONS))}")


def _parameter_fingerprint(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...], str, bool], ...]:
    """What the plan assumed of the parameters: names, shapes, dtypes and which train."""
    return tuple((name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters())


def _example_of_call(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's inputs as ``optimize`` takes them: a tuple, or a dict when any are named."""
    if not kwargs:
        return tuple(args)
    if not args:
        return dict(kwargs)
    if signature is None:
        raise InputError("the first training call mixes positional and keyword arguments and the model's forward "
                         "signature cannot be read: pass example_inputs to enable()")
    return dict(signature.bind_partial(*args, **kwargs).arguments)


def _unplanned_forward(model: torch.nn.Module, inner: Any) -> Any:
    """What a pickled enabled model's ``forward`` becomes: the forward it had before ``enable``."""
    return inner if inner is not None else types.MethodType(type(model).forward, model)


class _PlannedForward:
    """The ``forward`` that ``enable`` installs on one model instance (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, inner: Any, budget_gb: float | None, budget_fraction: float | None,
                 options: dict[str, Any]) -> None:
        self.model = model
        self.inner = inner  # an instance forward the model had (a library's hook), else None
        self.budget_gb = budget_gb
        self.budget_fraction = budget_fraction
        self.options = dict(options)
        self.module: CheckpointedModule | ModuleCheckpointedModule | None = None
        self.fingerprint: tuple[Any, ...] = ()
        # set while planning or re-planning: tracing and profiling call model.forward, which must
        # then be the model's own
        self.busy = False
        self._describe()

    def _describe(self) -> None:
        own = self._unplanned()
        functools.update_wrapper(self, own, updated=())  # name, doc and __wrapped__; our own attributes stay
        try:
            self.__signature__ = inspect.signature(own)
        except (TypeError, ValueError):  # a forward inspect cannot read: callers see *args, **kwargs
            self.__signature__ = None

    @property
    def __code__(self) -> types.CodeType:
        # torch.export names the traced code after ``model.forward.__code__`` when re-planning
        own = inspect.unwrap(self._unplanned())
        own = getattr(own, "__func__", own)
        return getattr(own, "__code__", _PlannedForward.__call__.__code__)

    def _unplanned(self) -> Any:
        return self.inner if self.inner is not None else types.MethodType(type(self.model).forward, self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if args and args[0] is model:
            # bound again as a method (Accelerate's unwrap_model(keep_fp32_wrapper=False) rebinds the
            # forward it unwraps to with MethodType): a model is never an input of its own forward
            args = args[1:]
        if self.busy or not (model.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() \
                or torch.compiler.is_exporting():  # a capture of the model (assert_peak_memory) sees its own step
            return self._unplanned()(*args, **kwargs)
        self.busy = True
        graph = None
        try:
            module = self.module
            if module is None:
                module = self.plan(_example_of_call(self.__signature__, args, kwargs))
            elif _parameter_fingerprint(model) != self.fingerprint:
                raise InputError(
                    f"the parameters of {type(model).__name__} changed since planner.enable planned it (new, renamed, "
                    f"reshaped or (un)frozen parameters, e.g. LoRA adapters injected): apply PEFT and freezing first, "
                    f"or call planner.disable(model) and planner.enable(model, ...) again")
            if isinstance(module, ModuleCheckpointedModule):  # the module path: the model's own forward,
                with module.checkpoints_installed():          # its planned submodules checkpointed
                    output = self._unplanned()(*args, **kwargs)
            elif isinstance(module, BreakCheckpointedModule):  # the graph-break path: the model's own forward,
                with module.checkpoints_installed(*args, **kwargs):  # its planned op ranges checkpointed
                    output = self._unplanned()(*args, **kwargs)
            else:
                graph = module.training_graph_for(*args, **kwargs)
        finally:
            self.busy = False
        if graph is not None:
            output = graph(*args, **kwargs)
        module.watch_output(output)  # a loop that holds what the plan freed warns once
        return output

    def plan(self, example_inputs: Any) -> CheckpointedModule | ModuleCheckpointedModule:
        """Plan the model for ``example_inputs`` (RNG, buffers and ``.grad`` left as they were)."""
        model = self.model
        budget_gb = self.budget_gb
        was_busy, self.busy = self.busy, True
        try:
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
                if budget_gb is None:
                    fraction = float(self.budget_fraction or 1.0)  # check_enable_options requires one of the two
                    step = TrainingStep(self.options.get("loss_fn"), bool(self.options.get("output_held", False)))
                    peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example(example_inputs), step)
                    budget_gb = fraction * peak_bytes / GIB
                    log.info("budget %.4f GiB: %.3g of the measured unoptimized peak %.4f GiB", budget_gb,
                             fraction, peak_bytes / GIB)
                module = optimize(model, example_inputs, budget_gb, **self.options)
        finally:
            self.busy = was_busy
        self.module = module
        self.fingerprint = _parameter_fingerprint(model)
        plan = module.plan
        log.info("planned %s in place: predicted peak %.4f GiB of %.4f GiB budget (unoptimized %.4f GiB), %d segments",
                 type(model).__name__, plan.predicted_peak_bytes / GIB, plan.budget_bytes / GIB,
                 plan.unoptimized_peak_bytes / GIB, len(plan.segments))
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> "_PlannedForward":
        new = _PlannedForward.__new__(_PlannedForward)
        memo[id(self)] = new
        new.model = copy.deepcopy(self.model, memo)
        new.inner = copy.deepcopy(self.inner, memo)
        new.budget_gb, new.budget_fraction, new.options = self.budget_gb, self.budget_fraction, dict(self.options)
        new.module = copy.deepcopy(self.module, memo)
        new.fingerprint, new.busy = self.fingerprint, False
        new._describe()
        return new

    def __reduce__(self) -> tuple[Any, ...]:
        # the rewritten graphs do not pickle: the model comes back with the forward it had
        return _unplanned_forward, (self.model, self.inner)


def _found(model: Any) -> tuple[_PlannedForward | None, bool]:
    """The forward ``enable`` installed on ``model`` and whether it is ``model.forward`` itself
    (False: a library wrapped it since, as Accelerate's mixed precision wraps ``model.forward``
    with ``functools.wraps``)."""
    forward = getattr(model, "__dict__", {}).get("forward")
    for depth in range(8):
        if isinstance(forward, _PlannedForward):
            return forward, depth == 0
        if isinstance(forward, types.MethodType) and isinstance(forward.__func__, _PlannedForward):
            return forward.__func__, depth == 0  # rebound as a method: still the outermost forward
        forward = getattr(forward, "__wrapped__", None)
    return None, False


def _installed(model: Any) -> _PlannedForward | None:
    return _found(model)[0]


def enable(model: torch.nn.Module, example_inputs: Any = None, budget_gb: float | None = None, *,
           budget_fraction: float | None = None, **options: Any) -> torch.nn.Module:
    """Plan ``model`` in place and return it: the same object, whose training forward (in
    training mode, grad enabled) runs the checkpointed graph that fits ``budget_gb``.

    Args:
        model: an ``nn.Module`` in training mode; apply PEFT (``get_peft_model``) and freeze
            parameters before enabling, since the plan is for the parameters as they are.
        example_inputs: a tuple of positional arguments or a dict of keyword arguments shaped
            like a batch; None plans on the first training forward, for its inputs.
        budget_gb: peak training-step memory allowed, in GiB (as :func:`planner.optimize`).
        budget_fraction: instead of ``budget_gb``: this share of the unoptimized step's peak,
            measured on the example inputs (or the first batch).
        **options: any keyword option of :func:`planner.optimize` (``timing_repeats``,
            ``max_stages``, ``cache_dir``, ...).

    Eval mode and ``torch.no_grad()`` (evaluation, ``generate``) run the model's own forward.
    Inputs of another shape, or a step with gradients already held (accumulation), are
    re-planned for the same budget on first use, as :func:`planner.optimize`'s module does.

    Raises:
        InputError: the model is already enabled, or a budget or option is invalid (and every
            error of :func:`planner.optimize` when it plans). A training forward raises it too
            when the parameters changed since planning.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(8, 8)
        >>> enable(model, budget_gb=1.0, timing_repeats=1) is model   # plans on the first batch
        True
        >>> plan_of(model) is None
        True
        >>> _ = model(torch.randn(4, 8)).sum().backward()
        >>> plan_of(model).segments
        ()
        >>> enable(model, budget_gb=1.0)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: Linear is already enabled: call planner.disable(model) first to plan it again
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _installed(model) is not None:
        raise InputError(f"{type(model).__name__} is already enabled: call planner.disable(model) first to plan it again")
    check_enable_options(budget_gb, budget_fraction, options)
    if example_inputs is not None and not model.training:  # deferred: the first training forward plans
        raise InputError("model is in eval mode: call model.train() before planner.enable() (the plan is for "
                         "training steps; inference needs no plan)")
    forward = _PlannedForward(model, model.__dict__.get("forward"), budget_gb, budget_fraction, options)
    if example_inputs is not None:
        forward.plan(example_inputs)
    model.__dict__["forward"] = forward
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable`: ``model.forward`` is again the forward it had; returns ``model``.

    Example:
        >>> import torch
        >>> disable(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: Linear is not enabled: nothing to disable
    """
    forward, outermost = _found(model)
    if forward is None:
        raise InputError(f"{type(model).__name__} is not enabled: nothing to disable")
    if not outermost:
        raise InputError(f"{type(model).__name__}.forward was wrapped by another library after planner.enable: "
                         f"remove that wrapper first (accelerator.unwrap_model(model, keep_fp32_wrapper=False))")
    if forward.inner is not None:
        model.__dict__["forward"] = forward.inner
    else:
        del model.__dict__["forward"]
    forward.module = None
    return model


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` installed its forward on ``model``.

    Example:
        >>> import torch
        >>> is_enabled(torch.nn.Linear(2, 2))
        False
    """
    return _installed(model) is not None


def checkpointed_module_of(model: Any) -> CheckpointedModule | ModuleCheckpointedModule | None:
    """The :class:`CheckpointedModule` behind an enabled model (its ``plans``, ``plan_for``; a
    :class:`ModuleCheckpointedModule` where the model could not be captured),
    or None before the first plan or when not enabled.

    Example:
        >>> import torch
        >>> checkpointed_module_of(torch.nn.Linear(2, 2)) is None
        True
    """
    forward = _installed(model)
    return forward.module if forward is not None else None


def plan_of(model: Any) -> Plan | None:
    """The plan an enabled model was planned with (for its example inputs or first batch), or
    None before the first plan or when not enabled.

    Example:
        >>> import torch
        >>> plan_of(torch.nn.Linear(2, 2)) is None
        True
    """
    module = checkpointed_module_of(model)
    return module.plan if module is not None else None
