"""Profile a model at ``nn.Module`` granularity, for models ``torch.export`` cannot capture.

One training step runs with forward hooks on every submodule (the call tree, each call's inputs,
outputs and forward time) and saved-tensor hooks (which storage autograd saves, and inside which
module call). :func:`choose_units` picks the checkpointable calls: descending from the root into
the calls that contain repeated blocks (two or more composite modules of one class in an
``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``), down to those blocks and the calls
beside them. :mod:`profiling.module_costgraph` turns the step into a :class:`CostGraph`.

Example:
    >>> import torch
    >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> model = torch.nn.Sequential(block(), block(), block())
    >>> profile = profile_modules(model, (torch.randn(4, 8),), timing_repeats=1)
    >>> [u.path for u in profile.units]
    ['0', '1', '2']
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from planner.core.errors import PlannerError, ProfileError
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes, preserved_state

__all__ = ["ModuleCall", "ModuleUnit", "ModuleProfile", "profile_modules", "choose_units", "unit_node_name"]

log = logging.getLogger(__name__)

#: Timed steps of a module-call profile where ``timing_repeats`` is None (docs/tuning.md#timing_repeats).
MODULE_TIMING_PASSES = 2

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass
class ModuleCall:
    """One call of a submodule in the profiled forward: where it sits in the call tree, which
    storages it read and returned, which autograd saved inside it, and its forward time."""

    index: int
    path: str
    parent: int | None
    start_seq: int
    end_seq: int = -1
    children: list[int] = field(default_factory=list)
    input_keys: tuple[int, ...] = ()
    output_keys: tuple[int, ...] = ()
    output_bytes: int = 0
    requires_grad: bool = False
    time_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ModuleUnit:
    """A module call the plan may run under ``torch.utils.checkpoint``; ``checkpointable`` is
    False (with ``reason``) for a module called more than once."""

    call: int
    path: str
    checkpointable: bool
    reason: str = ""


@dataclass
class ModuleProfile:
    """What one profiled step observed: the calls, the chosen units, every storage and, per
    saved storage, the sequence number and innermost call at which autograd saved it."""

    calls: list[ModuleCall]
    units: tuple[ModuleUnit, ...]
    storage_bytes: dict[int, int]
    persistent: dict[int, str]
    saves: list[tuple[int, int, int | None]]
    output_keys: tuple[int, ...]
    param_keys: dict[str, int]
    unit_param_keys: dict[int, tuple[int, ...]]
    step_ms: float
    measured_peak_bytes: int
    output_held: bool = True


def unit_node_name(unit: ModuleUnit) -> str:
    """The CostGraph node name of a unit: its module path (``<root>`` for the model itself), so
    that plan summaries name modules; ``path#<call index>`` for a module called more than once.

    Example:
        >>> unit_node_name(ModuleUnit(5, "transformer.h.0", True)), unit_node_name(ModuleUnit(2, "", True))
        ('transformer.h.0', '<root>')
    """
    name = unit.path or "<root>"
    return name if unit.checkpointable else f"{name}#{unit.call}"


class _Recorder:
    """Hooks that record the call tree and saved storages of one forward."""

    def __init__(self) -> None:
        self.seq = 0
        self.calls: list[ModuleCall] = []
        self.stack: list[int] = []
        self.keys: dict[int, int] = {}
        self.storage_bytes: dict[int, int] = {}
        self.held: list[torch.Tensor] = []
        self.saves: list[tuple[int, int, int | None]] = []
        self.starts: dict[int, float] = {}

    def key_of(self, t: torch.Tensor) -> int | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or tensor subclasses without one
            return None
        ptr = storage.data_ptr()
        if ptr not in self.keys:
            self.keys[ptr] = len(self.keys)
            self.storage_bytes[self.keys[ptr]] = storage.nbytes()
            self.held.append(t)  # held until the step ends: a freed address must not name two storages
        return self.keys[ptr]

    def tensor_keys(self, value: Any) -> tuple[int, ...]:
        keys = [self.key_of(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        return tuple(dict.fromkeys(k for k in keys if k is not None))

    def pre(self, path: str, args: Any, kwargs: Any) -> None:
        self.seq += 1
        parent = self.stack[-1] if self.stack else None
        call = ModuleCall(len(self.calls), path, parent, self.seq, input_keys=self.tensor_keys((args, kwargs)))
        self.calls.append(call)
        if parent is not None:
            self.calls[parent].children.append(call.index)
        self.stack.append(call.index)
        self.starts[call.index] = time.perf_counter()

    def post(self, output: Any) -> None:
        index = self.stack.pop()
        call = self.calls[index]
        call.time_ms.append((time.perf_counter() - self.starts.pop(index)) * 1e3)
        self.seq += 1
        call.end_seq = self.seq
        tensors = [t for t in tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple())
                   if isinstance(t, torch.Tensor)]
        call.output_keys = self.tensor_keys(tensors)
        call.output_bytes = sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
        call.requires_grad = any(t.requires_grad for t in tensors)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self.key_of(t)
        if key is not None:
            self.seq += 1
            self.saves.append((self.seq, key, self.stack[-1] if self.stack else None))
        return t


@contextmanager
def _hooked(model: torch.nn.Module, recorder: _Recorder) -> Iterator[None]:
    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, _p=path: recorder.pre(_p, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, o: recorder.post(o), always_call=False))
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()


def _is_block(module: torch.nn.Module) -> bool:
    return next(iter(module.children()), None) is not None


def _has_repeated_blocks(model: torch.nn.Module, calls: list[ModuleCall], index: int) -> bool:
    """Whether the subtree of call ``index`` calls two composite modules of one class that are
    children of one container module (a ``ModuleList`` is never called itself: its blocks are
    called by the module that loops over it)."""
    stack = [index]
    while stack:
        call = calls[stack.pop()]
        seen: set[tuple[str, type]] = set()
        for child in call.children:
            path = calls[child].path
            parent = path.rpartition(".")[0]
            module = model.get_submodule(path)
            if not _is_block(module) or not isinstance(model.get_submodule(parent), _CONTAINERS):
                continue
            kind = (parent, type(module))
            if kind in seen:
                return True
            seen.add(kind)
        stack.extend(call.children)
    return False


def choose_units(model: torch.nn.Module, calls: list[ModuleCall]) -> tuple[ModuleUnit, ...]:
    """The checkpointable granularity: from the root call, descend into every call whose subtree
    holds repeated blocks (the root always); the calls reached are the units, in call order.

    A module called more than once in the step is not checkpointable: recomputing one call
    would also have to recompute the others' effects on it.

    Example:
        >>> calls = [ModuleCall(0, "", None, 1, children=[1]), ModuleCall(1, "0", 0, 2)]
        >>> [u.path for u in choose_units(torch.nn.Sequential(torch.nn.Linear(2, 2)), calls)]
        ['0']
    """
    if not calls:
        raise ProfileError("the model's forward called no module: nothing to profile")
    chosen: list[int] = []

    def visit(index: int, is_root: bool) -> None:
        call = calls[index]
        if call.children and (is_root or _has_repeated_blocks(model, calls, index)):
            for child in call.children:
                visit(child, False)
        else:
            chosen.append(index)

    visit(0, True)
    counts: dict[str, int] = {}
    for call in calls:
        counts[call.path] = counts.get(call.path, 0) + 1
    return tuple(ModuleUnit(i, calls[i].path, counts[calls[i].path] == 1,
                            "" if counts[calls[i].path] == 1 else f"called {counts[calls[i].path]} times")
                 for i in chosen)


def profile_modules(model: torch.nn.Module, example_inputs: Any, *, timing_repeats: int | None = None,
                    step: TrainingStep = TrainingStep()) -> ModuleProfile:
    """Run ``timing_repeats`` (None: :data:`MODULE_TIMING_PASSES`) + 1 training steps of ``model``
    with module and saved-tensor hooks, without side effects (RNG, buffers, ``.grad`` restored);
    the first records the call tree and storages, all of them each unit's forward time (median).

    Raises:
        ProfileError: the training step fails when run eagerly, the forward calls no module, or
            one step's call tree differs from the first (the forward's Python takes another path
            on a rerun).
    """
    inputs = StepInputs.from_example(example_inputs)
    timing_repeats = MODULE_TIMING_PASSES if timing_repeats is None else timing_repeats
    recorders: list[_Recorder] = []
    step_ms: list[float] = []
    with preserved_state(model):
        for _ in range(timing_repeats + 1):
            recorder = _Recorder()
            for p in model.parameters():
                p.grad = None
            start = time.perf_counter()
            try:
                with _hooked(model, recorder):
                    output = model(*inputs.args, **inputs.kwargs)
                loss = step.loss(output)
                if not recorders:
                    root_output_keys = recorder.tensor_keys(
                        output if not hasattr(output, "to_tuple") else output.to_tuple())
                if not step.output_held:
                    output = None
                loss.backward()
                del loss
            except PlannerError:
                raise
            except Exception as exc:  # the model's own failure, whatever its type: one line naming it
                first_line = next((line for line in str(exc).splitlines() if line.strip()), "")
                raise ProfileError(f"one training step of {type(model).__name__} failed when run eagerly: "
                                   f"{type(exc).__name__}: {first_line}") from exc
            step_ms.append((time.perf_counter() - start) * 1e3)
            del output
            recorder.held.clear()
            recorders.append(recorder)
    first = recorders[0]
    for other in recorders[1:]:
        if [c.path for c in other.calls] != [c.path for c in first.calls]:
            raise ProfileError("the model called other modules on a repeated step with the same inputs: "
                               "its forward is not deterministic; the module path cannot plan it")
    if len(recorders) > 1:  # the first step warms up (allocations, lazy initialisation): its times are dropped
        for index, call in enumerate(first.calls):
            call.time_ms = [t for other in recorders[1:] for t in other.calls[index].time_ms]
    persistent: dict[int, str] = {}
    param_keys: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = first.key_of(p)
        if key is not None:
            param_keys[name] = key
            persistent.setdefault(key, "param" if p.requires_grad else "buffer")
    for name, b in model.named_buffers():
        key = first.key_of(b)
        if key is not None:
            persistent.setdefault(key, "buffer")
    for t in inputs.tensors():
        key = first.key_of(t)
        if key is not None:
            persistent.setdefault(key, "input")
    first.held.clear()
    units = choose_units(model, first.calls)
    unit_param_keys = {
        u.call: tuple(dict.fromkeys(param_keys[f"{u.path}.{n}" if u.path else n]
                                    for n, _ in model.get_submodule(u.path).named_parameters()
                                    if (f"{u.path}.{n}" if u.path else n) in param_keys))
        for u in units
    }
    measured = measure_step_peak_bytes(model, inputs, step)
    log.info("profiled %s at module granularity: %d module calls, %d units (%d checkpointable)",
             type(model).__name__, len(first.calls), len(units), sum(u.checkpointable for u in units))
    return ModuleProfile(first.calls, units, first.storage_bytes, persistent, first.saves, root_output_keys,
                         param_keys, unit_param_keys, statistics.median(step_ms[1:] or step_ms), measured,
                         step.output_held)
