"""Measure the memory each node needs while it runs, beyond what it keeps.

An op can allocate more than its outputs: ``cross_entropy_loss`` runs ``log_softmax`` and
``nll_loss`` inside one FX node, and its backward holds two gradients of the logits' size at
once. The simulator cannot see those from tensor sizes alone, so they are measured: the graph
runs one forward plus backward under ``torch.profiler`` with ``profile_memory=True``, each FX
node wrapped in a ``record_function`` range. A node's forward window is its range; its
backward window spans the autograd functions whose sequence numbers its forward ops created.
For each window the result is the highest running allocation total reached inside it, minus
the total at its start.

Under fake tensors nothing is allocated, so :class:`FakeAllocationTracker` estimates the same
two numbers from the sizes of the tensors each aten op creates and when they are collected.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> from profiling.measure import StepInputs
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> peaks = measure_node_peaks(trace_module(model, (x,)), StepInputs.from_example((x,)))
    >>> peaks.forward["relu"] >= 4 * 8 * 4, peaks.step_peak_bytes > 0
    (True, True)
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from profiling.measure import (
    StepInputs,
    TrainingStep,
    allocation_events,
    device_of,
    flat_graph_inputs,
    memory_profile,
    preserved_state,
    profiled_step_peak_bytes,
    unflatten_output,
)
from profiling.node_times import TimedPass, after_last_save_shares

__all__ = ["measure_node_peaks", "NodePeaks", "FakeAllocationTracker"]

_PREFIX = "fxnode::"
_BACKWARD = "autograd::engine::evaluate_function:"


class _SaveClock:
    """Wall-clock marks of each node: ``[start, end]``, and the last save autograd made while it
    ran where it made one (:func:`profiling.node_times.after_last_save_shares`). Its ``pack`` is
    the saved-tensor hook, so the saved tensors reach this object alone, not the interpreter's
    values."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}
        self.running: list[float] | None = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.running is not None:
            self.running[2:] = [time.perf_counter()]
        # a detached alias, as autograd itself keeps: the tensor saved by its own grad_fn would
        # close a loop that holds it past its last use
        return t.detach()


class _LabelledInterpreter(torch.fx.Interpreter):
    """Runs each node inside a profiler range named after it, its marks on ``clock``."""

    def __init__(self, gm: torch.fx.GraphModule, clock: _SaveClock) -> None:
        super().__init__(gm)
        self.clock = clock

    def run_node(self, n: torch.fx.Node) -> Any:
        with torch.profiler.record_function(_PREFIX + n.name):
            running = self.clock.running = [time.perf_counter(), 0.0]
            try:
                return super().run_node(n)
            finally:
                running[1] = time.perf_counter()
                self.clock.marks[n.name], self.clock.running = running, None


def window_peaks(allocations: list[tuple[int, int]]) -> Callable[[int, int], int]:
    """From allocation events ``(time_ns, bytes allocated or, negative, freed)`` in time order: a
    function giving the most bytes allocated above the level at a window's start, within
    ``[start_ns, end_ns]``.

    Example:
        >>> peak_in = window_peaks([(10, 100), (20, 50), (30, -150), (40, 30)])
        >>> peak_in(15, 35), peak_in(0, 100), peak_in(50, 60)
        (50, 150, 0)
    """
    times = [t for t, _ in allocations]
    running: list[int] = []
    total = 0
    for _, delta in allocations:
        total += delta
        running.append(total)

    def peak_in(start_ns: int, end_ns: int) -> int:
        lo, hi = bisect.bisect_left(times, start_ns), bisect.bisect_right(times, end_ns)
        before = running[lo - 1] if lo > 0 else 0
        return max(0, max(running[lo:hi]) - before) if hi > lo else 0

    return peak_in


def walk_events(roots: list[Any]) -> list[Any]:
    out, stack = [], list(roots)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


class NodePeaks(NamedTuple):
    """Per node name, the peak bytes allocated during its forward and during its backward; and
    the whole step's peak (:func:`profiling.measure.measure_step_peak_bytes`'s figure, taken
    from the same profiled step on CPU; None on other devices). On CPU the same step is also
    a timed pass (``timed_pass``: each node's wall time inside its range, and the backward's),
    which :func:`profiling.node_times.time_nodes_in_passes` counts as its first."""

    forward: dict[str, int]
    backward: dict[str, int]
    step_peak_bytes: int | None
    timed_pass: TimedPass | None = None


def measure_node_peaks(gm: torch.fx.GraphModule, inputs: StepInputs, step: TrainingStep = TrainingStep(),
                       loss_node: str = "loss_fn") -> NodePeaks:
    """Measure each node's forward and backward peak in one profiled training step run as
    ``step`` runs it (values freed after their last use, as the module's own forward frees
    them; the output dropped before the backward unless ``step.output_held``). The loss's own
    ops are measured under the name ``loss_node`` (:mod:`profiling.criterion`)."""
    flat = flat_graph_inputs(gm, inputs)
    clock = _SaveClock()
    with preserved_state(gm), memory_profile() as prof:
        # the pack hook returns an alias of each saved tensor: what the step holds is unchanged
        with torch.autograd.graph.saved_tensors_hooks(clock.pack, lambda t: t):
            flat_out = _LabelledInterpreter(gm, clock).run(*flat, enable_io_processing=False)
        output = unflatten_output(gm, flat_out)
        with torch.profiler.record_function(_PREFIX + loss_node):
            loss = step.loss(output)
        if not step.output_held:
            del output, flat_out
            output = flat_out = None
        backward_started = time.perf_counter()
        loss.backward()
        backward_ms = (time.perf_counter() - backward_started) * 1e3
        del output, flat_out, loss
    device_type = device_of(gm, inputs).type
    step_peak_bytes = profiled_step_peak_bytes(gm, inputs, prof) if device_type == "cpu" else None

    events = walk_events(list(prof.profiler.kineto_results.experimental_event_tree()))
    peak_in = window_peaks(allocation_events(prof, device_type))

    forward: dict[str, int] = {}
    forward_ms: dict[str, float] = {}
    node_of_sequence: dict[int, str] = {}
    for event in events:
        if event.name.startswith(_PREFIX):
            name = event.name[len(_PREFIX):]
            forward[name] = peak_in(event.start_time_ns, event.end_time_ns)
            forward_ms[name] = (event.end_time_ns - event.start_time_ns) / 1e6
            for child in walk_events(list(event.children)):
                seq = getattr(child.extra_fields, "sequence_number", -1)
                if seq is not None and seq >= 0:
                    node_of_sequence.setdefault(seq, name)
    windows: dict[str, tuple[int, int]] = {}
    for event in events:
        if event.name.startswith(_BACKWARD):
            seq = getattr(event.extra_fields, "sequence_number", -1)
            name = node_of_sequence.get(seq)
            if name is None:
                continue
            lo, hi = windows.get(name, (event.start_time_ns, event.end_time_ns))
            windows[name] = (min(lo, event.start_time_ns), max(hi, event.end_time_ns))
    backward = {name: peak_in(lo, hi) for name, (lo, hi) in windows.items()}
    # the profiler's ranges time the host; on a GPU the kernels run later, so no timed pass there
    timed = TimedPass(forward_ms, backward_ms, after_last_save_shares(clock.marks)) \
        if device_type == "cpu" else None
    return NodePeaks(forward, backward, step_peak_bytes, timed)


class FakeAllocationTracker(TorchDispatchMode):
    """Counts the bytes fake tensors would allocate, to estimate temporaries without running.

    Pushed above a ``FakeTensorMode``, it sees every aten op (composite ops already decomposed,
    so intermediates such as ``cross_entropy_loss``'s ``log_softmax`` are visible), adds the
    bytes of each new output storage to a running total, and subtracts them when the last
    tensor on that storage is garbage collected. Forward windows are marked by the profiler
    (:meth:`node_started`/:meth:`node_finished`, which also record the autograd sequence
    numbers a node creates); backward windows come from the autograd node running each op.
    Scratch memory inside a single kernel (no aten op of its own) is invisible to it, so
    ``kernel_scratch`` (``(func, args, kwargs) -> bytes``, None: none) names what the target
    device's kernel of an op takes and gives back before returning; profiling for a GPU sets it to
    :func:`profiling.gpu_rules.kernel_scratch_bytes` (a reduction's staging buffer), which counts on
    top of the op's outputs at that op. On the CPU target it stays None. In a backward that
    scratch is a broadcast gradient's reduction to its input's shape (a bias's), which autograd
    runs on the outputs of the node's backward function after it has returned; what it adds
    to a node's backward peak beyond the function's own high point is
    :meth:`backward_late_scratch`.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode() as mode:
        ...     x = mode.from_tensor(torch.randn(4, 8))
        ...     with FakeAllocationTracker() as tracker:
        ...         tracker.node_started("soft")
        ...         y = torch.nn.functional.log_softmax(x.exp() + 1, dim=1)
        ...         tracker.node_finished("soft")
        >>> tracker.forward_peaks()["soft"] >= 2 * 4 * 8 * 4
        True
    """

    def __init__(self, kernel_scratch: Callable[[Any, Any, dict[str, Any]], int] | None = None) -> None:
        super().__init__()
        self.kernel_scratch = kernel_scratch
        self.live_bytes = 0
        self.running: list[int] = []  # running total after each allocation or free, in order
        self._holders: dict[int, int] = {}  # storage key -> tracked tensors alive on it
        self._size: dict[int, int] = {}
        self._forward: dict[str, tuple[int, int]] = {}  # node -> (first, end) index into running
        self._sequence_start: dict[str, int] = {}
        self._sequences: list[tuple[int, int, str]] = []  # [start, end) sequence numbers per node
        self._backward: dict[int, tuple[int, int]] = {}  # autograd sequence number -> (first, end)
        self._late: set[int] = set()  # indices into running of a backward op's kernel scratch
        self._open: tuple[str, int] | None = None

    def node_started(self, name: str) -> None:
        """Open ``name``'s forward window."""
        self._open = (name, len(self.running))
        self._sequence_start[name] = int(torch._C._autograd._get_sequence_nr())

    def node_finished(self, name: str) -> None:
        """Close ``name``'s forward window."""
        if self._open is not None and self._open[0] == name:
            self._forward[name] = (self._open[1], len(self.running))
        self._open = None
        start = self._sequence_start.pop(name, None)
        end = int(torch._C._autograd._get_sequence_nr())
        if start is not None and end > start:
            self._sequences.append((start, end, name))

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] <= 0:
            del self._holders[key]
            self.live_bytes -= self._size.pop(key)
            self.running.append(self.live_bytes)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._holders:
            self._holders[key] = 0
            self._size[key] = int(storage.nbytes())
            self.live_bytes += self._size[key]
            self.running.append(self.live_bytes)
        self._holders[key] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        node = torch._C._current_autograd_node()
        first = len(self.running)
        known = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in known:
                self._track(t)
        scratch = self.kernel_scratch(func, args, kwargs or {}) if self.kernel_scratch is not None else 0
        if scratch:
            # taken by the kernel once its outputs exist, given back before the op returns
            if node is not None:
                self._late.add(len(self.running))
            self.running.append(self.live_bytes + scratch)
            self.running.append(self.live_bytes)
        if node is not None:
            seq = int(node._sequence_nr())
            lo, hi = self._backward.get(seq, (first, len(self.running)))
            self._backward[seq] = (min(lo, first), max(hi, len(self.running)))
        return out

    def _peak(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        before = self.running[lo - 1] if lo > 0 else 0
        return max(0, max(self.running[lo:hi]) - before)

    def forward_peaks(self) -> dict[str, int]:
        """Per node: bytes its forward allocated at its high point, above the total at its start."""
        return {name: self._peak(lo, hi) for name, (lo, hi) in self._forward.items()}

    def backward_peaks(self) -> dict[str, int]:
        """Per node: the same for the autograd functions its forward created."""
        return {name: self._peak(lo, hi) for name, (lo, hi) in self._backward_windows().items()}

    def backward_late_scratch(self) -> dict[str, int]:
        """Per node with some: how far kernel scratch in its backward raises :meth:`backward_peaks`
        above the high point of the rest of its backward (``CostNode.backward_late_scratch_bytes``).

        The scratch a backward op's kernel takes is a reduction of a gradient to a broadcast
        input's shape, which autograd runs after the node's backward function has returned.
        """
        late: dict[str, int] = {}
        for name, (lo, hi) in self._backward_windows().items():
            rest = [i for i in range(lo, hi) if i not in self._late]
            before = self.running[lo - 1] if lo > 0 else 0
            early = max(0, max((self.running[i] for i in rest), default=before) - before)
            if self._peak(lo, hi) > early:
                late[name] = self._peak(lo, hi) - early
        return late

    def _backward_windows(self) -> dict[str, tuple[int, int]]:
        """Per node: the (first, end) indices into ``running`` of the autograd functions its
        forward created."""
        starts = sorted(self._sequences)
        keys = [s for s, _, _ in starts]
        windows: dict[str, tuple[int, int]] = {}
        for seq, (lo, hi) in self._backward.items():
            i = bisect.bisect_right(keys, seq) - 1
            if i < 0 or seq >= starts[i][1]:
                continue
            name = starts[i][2]
            a, b = windows.get(name, (lo, hi))
            windows[name] = (min(a, lo), max(b, hi))
        return windows
