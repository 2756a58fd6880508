"""One training step (forward plus backward) and its measured peak memory and FLOPs.

Peak training-step memory is the most bytes held by live tensors at any moment of one
forward plus backward, counting parameters, buffers, inputs, activations, gradients and
temporaries. It is the step's growth at the allocator on top of the bytes already held by the
module's parameters and buffers and by the inputs: on CUDA the rise of
``torch.cuda.max_memory_allocated`` over what was allocated before the step (so other models on
the device do not count) in a step after an unmeasured one (library workspaces a first step
allocates stay out); on CPU the running sum of the allocator's allocation and free events
recorded by ``torch.profiler`` with ``profile_memory=True``.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> inputs = StepInputs.from_example((torch.randn(2, 4),))
    >>> measure_step_peak_bytes(model, inputs) > 0
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_leaves, tree_unflatten

from planner.core.errors import PlannerError, ProfileError

__all__ = [
    "StepInputs",
    "allocation_events",
    "memory_profile",
    "device_of",
    "flat_graph_inputs",
    "loss_of",
    "TrainingStep",
    "run_step",
    "unflatten_output",
    "measure_step_peak_bytes",
    "profiled_step_peak_bytes",
    "measure_step_flops",
    "preserved_state",
]


@dataclass(frozen=True)
class StepInputs:
    """Example inputs as positional ``args`` and keyword ``kwargs``."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_example(cls, example_inputs: Any) -> "StepInputs":
        """Accept a tuple (or list) of positional arguments, a dict of keyword arguments, or one tensor."""
        if isinstance(example_inputs, StepInputs):
            return example_inputs
        if isinstance(example_inputs, torch.Tensor):
            return cls((example_inputs,), {})
        if isinstance(example_inputs, (tuple, list)):
            return cls(tuple(example_inputs), {})
        if isinstance(example_inputs, Mapping):
            return cls((), dict(example_inputs))
        raise PlannerError(
            f"example_inputs must be a tuple of positional arguments or a dict of keyword arguments, "
            f"got {type(example_inputs).__name__}"
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]


def loss_of(output: Any) -> torch.Tensor:
    """The scalar backward starts from: a ``loss`` field if the output has one, else the sum
    of every floating-point output that requires grad."""
    loss = None
    if isinstance(output, Mapping) or hasattr(output, "keys"):
        try:
            loss = output["loss"]
        except (KeyError, TypeError, IndexError):
            loss = None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss if loss.dim() == 0 else loss.sum()
    parts = [
        t.sum()
        for t in tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple())
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not parts:
        raise PlannerError("the module's output has no floating-point tensor that requires grad: nothing to train")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def flat_graph_inputs(gm: torch.fx.GraphModule, inputs: StepInputs) -> list[Any]:
    """The values of the graph's placeholders, in order, for ``gm(*inputs.args, **inputs.kwargs)``."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is not None:
        return list(tree_flatten_spec((inputs.args, inputs.kwargs), in_spec))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(inputs.args)
    for node in placeholders[len(values):]:
        if node.target in inputs.kwargs:
            values.append(inputs.kwargs[node.target])
        elif node.args:
            values.append(node.args[0])
        else:
            raise ProfileError(f"no example value for input {node.target!r}")
    return values


def unflatten_output(gm: torch.nn.Module, flat_out: Any) -> Any:
    """The module-level output structure from what ``Interpreter.run(..., enable_io_processing=False)``
    returned: exported graphs restore tuples, dicts and ``ModelOutput`` through ``_out_spec``."""
    out_spec = getattr(gm, "_out_spec", None)
    if out_spec is None:
        return flat_out
    leaves = list(flat_out) if isinstance(flat_out, (tuple, list)) else [flat_out]
    return tree_unflatten(leaves, out_spec)


@dataclass(frozen=True)
class TrainingStep:
    """One training step as the user's loop runs it: the loss taken from the module's output,
    the output dropped once the loss is taken (unless ``output_held``), then the backward.

    ``loss_fn`` maps the module's output to the scalar the backward starts from (a criterion
    outside the model: ``lambda out: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())``);
    None takes the output's ``loss`` field, else the sum of its floating-point outputs
    (:func:`loss_of`). ``output_held`` is for loops that keep the output alive through the
    backward (``out = model(x); loss = crit(out); loss.backward(); log(out)``): its tensors are
    then held until the step ends.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> step = TrainingStep(loss_fn=lambda out: out.pow(2).mean())
        >>> step.run(model, StepInputs.from_example((torch.randn(2, 4),))) is None   # output dropped
        True
        >>> model.weight.grad is not None
        True
    """

    loss_fn: Callable[[Any], torch.Tensor] | None = None
    output_held: bool = False

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar the backward starts from, for the module's ``output``."""
        if self.loss_fn is None:
            return loss_of(output)
        loss = self.loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            what = (f"a tensor of shape {tuple(loss.shape)} (requires_grad={loss.requires_grad})"
                    if isinstance(loss, torch.Tensor) else type(loss).__name__)
            raise PlannerError(f"loss_fn must return a one-element tensor that requires grad, got {what}: "
                               f"return the criterion's scalar (e.g. F.cross_entropy(out.logits, y))")
        return loss.reshape(()) if loss.dim() else loss

    def run(self, module: torch.nn.Module, inputs: StepInputs) -> Any:
        """Forward plus backward once; the module's output when ``output_held``, else None
        (the output is dropped before the backward, as the user's loop drops it)."""
        output = module(*inputs.args, **inputs.kwargs)
        loss = self.loss(output)
        if not self.output_held:
            output = None
        loss.backward()
        return output

    def describe(self) -> str:
        """A few words for logs and reports: which loss, and whether the output is held."""
        loss = "the output's loss" if self.loss_fn is None else f"loss_fn {getattr(self.loss_fn, '__qualname__', 'callable')}"
        return f"{loss}, output {'held through' if self.output_held else 'freed before'} the backward"


def run_step(module: torch.nn.Module, inputs: StepInputs, step: TrainingStep = TrainingStep()) -> Any:
    """Forward plus backward once, as ``step`` says; returns the module's output when the step
    holds it, else None."""
    return step.run(module, inputs)


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Run a measurement without side effects: RNG, buffers and ``.grad`` are restored."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            for p in params:
                p.grad = None
            yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def _held_bytes(module: torch.nn.Module, inputs: StepInputs) -> int:
    """Bytes of the distinct storages of parameters, buffers and inputs."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers(), *inputs.tensors()]:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def device_of(module: torch.nn.Module, inputs: StepInputs) -> torch.device:
    """The device of the module's first parameter, else of the first input tensor, else CPU."""
    for t in [*module.parameters(), *inputs.tensors()]:
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to the null device: the profiler's C++ side prints a line to it
    on every start and stop (``USDT: ... profiler_start``), which no setting turns off."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def memory_profile() -> Iterator[torch.profiler.profile]:
    """A CPU ``torch.profiler`` session that records every allocation and free, started and
    stopped without the profiler's own lines on stderr.

    Example:
        >>> with memory_profile() as prof:
        ...     x = torch.ones(1024)
        >>> sum(delta for _, delta in allocation_events(prof))
        4096
    """
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.stop()


def measure_step_peak_bytes(module: torch.nn.Module, inputs: StepInputs, step: TrainingStep = TrainingStep()) -> int:
    """Peak bytes of one forward plus backward (``step``: the loss, and whether the output is
    held through the backward), measured at the allocator.

    RNG state, buffers and existing ``.grad`` are restored afterwards.
    """
    device = device_of(module, inputs)
    with preserved_state(module):
        baseline = _held_bytes(module, inputs)
        if device.type == "cuda":
            # The device may hold other models and tensors: count the step's growth above what
            # was allocated before it, plus this module's parameters, buffers and inputs. An
            # unmeasured step first: a process's first matmuls allocate cuBLAS workspaces that
            # stay for good and are no tensor of this step.
            run_step(module, inputs, step)
            for p in module.parameters():
                p.grad = None
            torch.cuda.synchronize(device)
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            output = run_step(module, inputs, step)
            del output
            torch.cuda.synchronize(device)
            return baseline + int(torch.cuda.max_memory_allocated(device)) - allocated_before
        with memory_profile() as prof:
            output = run_step(module, inputs, step)
            del output
        return baseline + _running_peak_bytes(prof)


def profiled_step_peak_bytes(module: torch.nn.Module, inputs: StepInputs, prof: torch.profiler.profile) -> int:
    """The peak of one CPU training step of ``module`` that ran inside ``prof`` (a
    :func:`memory_profile`), as :func:`measure_step_peak_bytes` measures it: what the module
    and its inputs hold, plus the highest running sum of the step's allocations."""
    return _held_bytes(module, inputs) + _running_peak_bytes(prof)


def allocation_events(prof: torch.profiler.profile, device_type: str = "cpu") -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every allocation (+) and free (-) on ``device_type`` that a memory
    profile recorded, in time order. Their sum is the net growth over the profiled window; the highest running sum
    is its peak above what was allocated before.

    Only frees of blocks allocated inside the window count. The CPU allocator remembers the size
    of every block allocated while any memory profile was on, so a block left from an earlier
    profile (garbage the collector frees in the middle of this one) would otherwise show as a
    free of memory this window never held and lower its running sum.

    Example:
        >>> with memory_profile() as prof:
        ...     x = torch.ones(1024)
        >>> sum(delta for _, delta in allocation_events(prof))
        4096
    """
    recorded: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if str(node.tag).endswith("Allocation") and node.extra_fields.device.type == device_type:
            fields = node.extra_fields
            recorded.append((node.start_time_ns, int(fields.ptr), int(fields.alloc_size)))
        stack.extend(node.children)
    recorded.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    events: list[tuple[int, int]] = []
    for time_ns, ptr, delta in recorded:
        if delta > 0:
            live[ptr] = delta
        elif live.pop(ptr, None) is None:
            continue  # allocated before the window began
        events.append((time_ns, delta))
    return events


def _running_peak_bytes(prof: torch.profiler.profile) -> int:
    """Highest running sum of allocation (+) and free (-) events, in time order."""
    running = peak = 0
    for _, delta in allocation_events(prof):
        running += delta
        peak = max(peak, running)
    return peak


def measure_step_flops(module: torch.nn.Module, inputs: StepInputs, step: TrainingStep = TrainingStep()) -> int:
    """FLOPs of one forward plus backward as ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with preserved_state(module):
        counter = FlopCounterMode(display=False)
        with counter:
            output = run_step(module, inputs, step)
            del output
        return int(counter.get_total_flops())
