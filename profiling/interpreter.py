"""The interpreter that runs a captured graph once and records what each node did.

For every FX node, :class:`ProfilingInterpreter` records its result, the tensors autograd saved
while it ran (``torch.autograd.graph.saved_tensors_hooks``), its FLOPs (``FlopCounterMode``), a
first time, whether it mutated state, and what a selective checkpoint policy would cache if the
node were kept (:class:`DispatchSpy`). :mod:`profiling.cost_nodes` turns these records into
``CostNode`` objects. It follows PyTorch's ``shape_prop.py``: failures are re-raised naming
the node.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> interp = ProfilingInterpreter(trace_module(model, (x,)), torch.device("cpu"))
    >>> _ = interp.run(x)
    >>> interp.records["relu"]["flops"], interp.records["relu"]["mutating"]
    (0, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from planner.core.errors import ProfileError
from profiling.node_times import Timer, cpu_timer
from profiling.progress import NodeProgress
from profiling.temporaries import FakeAllocationTracker
from profiling.batch_norm_updates import RUN_ONCE_OPS

__all__ = ["ProfilingInterpreter", "DispatchSpy", "SaveRecorder", "unpack_saved", "tensors_of", "step_timer"]


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of ``value``."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_mutating(node: torch.fx.Node) -> bool:
    """Whether the op's schema says it writes an argument (in-place ops; the interpreter also
    catches ops that bump an input's version counter, such as batch_norm's running stats)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    if node.op == "call_function" and node.is_impure():
        return True  # e.g. profiling.batch_norm_updates.update_running_stats
    if node.op == "call_module":
        return str(node.target).startswith("_guards")
    return False


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, FakeTensor):
        return True  # no values to compare; version counters and op names decide
    return bool(torch.equal(a, b))


_RUNNING_STATS_OPS = ("batch_norm", "instance_norm")


def _updates_running_stats(node: torch.fx.Node) -> bool:
    """Normalisation ops in training mode update running statistics in place."""
    name = str(node.target)
    if node.op == "call_module":
        return False
    if not any(op in name for op in _RUNNING_STATS_OPS):
        return False
    if len(node.args) > 4 and node.args[3] is None and node.args[4] is None:
        return False  # no running statistics: a pure op (see profiling.batch_norm_updates.split_batch_norm_updates)
    training = [a for a in node.args if isinstance(a, bool)]
    return bool(training and training[0]) or node.kwargs.get("training", False) is True


class DispatchSpy(TorchDispatchMode):
    """Watches the ops dispatched inside one node for what a selective checkpoint policy would
    cache if the node were kept: the outputs of every one of them.

    ``writes_in_place``: some op writes an argument in place; the policy refuses (at recompute)
    a cached tensor modified afterwards, which composite ops such as CPU dropout and attention
    do to their own intermediates. ``input_views``: op outputs that are views of the node's
    inputs (a linear reshaping its input); cached, they hold the input's storage.
    ``op_count``: ops dispatched so far.
    """

    def __init__(self, input_storages: set[int]) -> None:
        super().__init__()
        self.input_storages = input_storages
        self.writes_in_place = False
        self.input_views: list[torch.Tensor] = []
        self.op_count = 0
        self.muted = False  # the profiler's own ops (a pack hook's detach) are not the node's

    @contextlib.contextmanager
    def mute(self) -> Iterator[None]:
        """Ops dispatched inside are not counted or watched."""
        self.muted = True
        try:
            yield
        finally:
            self.muted = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.muted:
            return func(*args, **(kwargs or {}))
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            self.writes_in_place = True
        out = func(*args, **(kwargs or {}))
        self.op_count += 1
        for t in tensors_of(out):
            if t.untyped_storage()._cdata in self.input_storages:
                self.input_views.append(t)
        return out


def _after_last_save_fraction(flops: int, op_count: int, at_last_pack: tuple[int, int]) -> float:
    """The share of a node's forward that ran after autograd saved its last tensor: by FLOPs
    when the node counts any (a composite attention saves its scores before its last matmul),
    else by dispatched ops (a gelu saves its input before its one op runs: 1.0)."""
    flops_then, ops_then = at_last_pack
    if flops > 0:
        return min(1.0, max(0.0, (flops - flops_then) / flops))
    if op_count > 0:
        return min(1.0, max(0.0, (op_count - ops_then) / op_count))
    return 0.0


def step_timer(device: torch.device) -> Timer:
    """Milliseconds one call takes: CUDA events on a GPU, a wall-clock timer on CPU."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end))
        return cuda_time
    return cpu_timer


def _signature(n: torch.fx.Node, inputs: list[tuple[torch.Tensor, int]], result: Any) -> tuple[Any, ...]:
    """What an op's time depends on: the op, the shapes, strides and dtypes it reads and makes."""
    def describe(t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.shape), t.stride(), str(t.dtype)

    return (n.op, str(n.target), tuple(describe(t) for t, _ in inputs),
            tuple(describe(t) for t in tensors_of(result)), repr(n.kwargs) if n.kwargs else "")


def unpack_saved(t: torch.Tensor) -> torch.Tensor:
    """The unpack hook paired with :meth:`SaveRecorder.pack`."""
    return t


class SaveRecorder:
    """A pack hook for ``torch.autograd.graph.saved_tensors_hooks`` that records every tensor
    autograd saves (``saved``) and, at each save, what ``on_save`` returns (``last_mark``).

    Every tensor saved under a hook keeps the hook, so a hook that reached the saved tensors
    (or one that returned a saved output itself) would close a loop through the autograd graph
    that Python's collector cannot see: where no backward runs, as in a profiling forward, the
    forward's memory would stay allocated for good. So :meth:`pack` hands autograd a detached
    tensor (``detach=False``: the tensor itself, where a backward follows and frees the loop, as on
    fake tensors, whose allocation tracker would count the detached tensor), and :meth:`close`
    lets go of everything the hook reached.

    Example:
        >>> x = torch.randn(3, requires_grad=True)
        >>> saves = SaveRecorder()
        >>> with torch.autograd.graph.saved_tensors_hooks(saves.pack, unpack_saved):
        ...     y = x.exp()
        >>> [t is y for t in saves.close()], saves.saved
        ([True], [])
    """

    def __init__(self, on_save: Callable[[], Any] | None = None,
                 quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 detach: bool = True) -> None:
        self.on_save = on_save
        self.detach = detach
        self.quiet = quiet  # where the detach runs: unseen by a dispatch mode watching the node
        self.saved: list[torch.Tensor] = []
        self.last_mark: Any = None
        self.closed = False

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.closed:
            self.saved.append(t)
            if self.on_save is not None:
                self.last_mark = self.on_save()
        if not self.detach:
            return t
        with self.quiet():
            return t.detach()

    def close(self) -> list[torch.Tensor]:
        """The tensors saved so far; nothing more is recorded."""
        saved, self.saved, self.on_save, self.quiet, self.closed = self.saved, [], None, contextlib.nullcontext, True
        return saved


class ProfilingInterpreter(torch.fx.Interpreter):
    """Runs the graph once with autograd on, recording per-node storages, saves, FLOPs and time.

    ``records`` maps each node name to a dict: ``signature`` (what its time depends on),
    ``run_once``, ``result``, ``saved``, ``flops``, ``time_ms`` (this first run's),
    ``mutating``, ``writes_in_place``, ``input_views`` and ``after_last_save_fraction``.
    """

    def __init__(self, gm: torch.fx.GraphModule,
                 device: torch.device, to_fake: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 progress: NodeProgress | None = None, tracker: FakeAllocationTracker | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.progress = progress
        self.tracker = tracker
        self.to_fake = to_fake
        self.time = step_timer(device)
        self.records: dict[str, dict[str, Any]] = {}
        self.buffer_ids = {id(to_fake(b) if to_fake else b) for b in gm.buffers()}

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.to_fake is not None and isinstance(value, torch.Tensor):
            return self.to_fake(value)
        return value

    def run_node(self, n: torch.fx.Node) -> Any:
        counter = FlopCounterMode(display=False)
        spy = DispatchSpy({t.untyped_storage()._cdata for a in n.all_input_nodes for t in tensors_of(self.env.get(a))})
        # (FLOPs, ops) counted when autograd saved its last tensor
        saves = SaveRecorder(lambda: (int(counter.get_total_flops()), spy.op_count), spy.mute,
                             detach=self.tracker is None)
        result: Any = None

        def run_once() -> None:
            nonlocal result
            with torch.autograd.graph.saved_tensors_hooks(saves.pack, unpack_saved), counter, spy:
                result = super(ProfilingInterpreter, self).run_node(n)

        before = [(t, t._version) for a in n.all_input_nodes for t in tensors_of(self.env.get(a))]
        buffers_before = [(t, t.clone()) for t, _ in before if id(t) in self.buffer_ids]
        if self.tracker is not None:
            self.tracker.node_started(n.name)
        try:
            first_run_ms = self.time(run_once)
        except Exception as exc:
            stack = n.meta.get("nn_module_stack") or {}
            where = f" (in module {list(stack.values())[-1][0]})" if stack else ""
            raise ProfileError(
                f"node {n.name!r} ({n.op} {n.target}){where} failed while profiling: {type(exc).__name__}: {exc}"
            ) from exc
        if self.tracker is not None:
            self.tracker.node_finished(n.name)
        at_last_pack: tuple[int, int] = saves.last_mark or (0, 0)
        saved = saves.close()
        flops = int(counter.get_total_flops())
        mutating = (
            _is_mutating(n)
            or any(t._version != v for t, v in before)
            or any(not _same(t, copy) for t, copy in buffers_before)  # kernels that skip the version bump
            or _updates_running_stats(n)
        )
        self.records[n.name] = {
            "signature": _signature(n, before, result),
            "run_once": n.op == "call_function" and n.target in RUN_ONCE_OPS,
            "result": result,
            "saved": saved,
            "flops": flops,
            "time_ms": first_run_ms,  # measured profiles replace it by warm passes (profiling.node_times)
            "mutating": mutating,
            "writes_in_place": spy.writes_in_place,
            "input_views": spy.input_views,
            "after_last_save_fraction": _after_last_save_fraction(flops, spy.op_count, at_last_pack) if saved else None,
        }
        if self.progress is not None:
            self.progress.step()
        return result
