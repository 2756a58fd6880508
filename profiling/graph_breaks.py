"""Profile a model that cannot be captured as one graph as the sequence of ATen ops its step runs.

A forward with graph breaks (``.item()`` branches, ``nonzero`` routing, NumPy calls,
data-dependent loop counts) runs in Python, but every tensor op it runs is dispatched as an ATen
op. :func:`profile_op_stream` runs one step under a dispatch mode that records, op by op, the
storages read and written, the storages autograd saved while the op ran, its FLOPs, its time,
whether it draws random numbers, and the innermost submodule running it. Tensors that enter
from outside ATen (``torch.from_numpy``, Python-side caches) become opaque ``py_k`` nodes, never
recomputed. The ops that hand a tensor's data to Python (``.item()``, ``nonzero``'s shape) and
the opaque entries are the breaks: ``1 + breaks`` subgraphs. The result is one
:class:`CostGraph` for the whole step, node ``op<k>_<name>`` for the model's k-th op, so
:mod:`rewrite.graph_breaks` can turn a plan's segments back into op ranges.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> graph = profile_op_stream(model, (torch.randn(4, 8),), timing_repeats=1)
    >>> [n.name for n in graph.compute_nodes]
    ['op0_t', 'op1_addmm', 'op2_tanh', 'loss0_sum']
    >>> graph.metadata["subgraphs"]
    1
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from planner.core.costgraph import CostGraph, CostNode, Storage
from profiling.cache import resolve_cache_dir, through_cache
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes, preserved_state
from profiling.module_costgraph import calibrated
from profiling.op_counting import UNCOUNTED_OPS
from profiling.op_stream_key import op_stream_fingerprint
from profiling.op_temporaries import measure_op_peaks
from profiling.op_times import time_ops

__all__ = ["OpRecord", "profile_op_stream", "op_node_index", "BREAK_OPS"]

log = logging.getLogger(__name__)

#: Timing steps of an op-stream profile where ``timing_repeats`` is None (docs/tuning.md#timing_repeats).
OP_STREAM_TIMING_PASSES = 2

#: Ops whose result Python reads as data (a scalar, or a shape that depends on values): where
#: Dynamo and ``torch.export`` break the graph.
BREAK_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique_dim",
                       "_unique2", "unique_consecutive", "repeat_interleave", "allclose",
                       "lift_fresh", "lift_fresh_copy"})  # the last two: a tensor made by torch.from_numpy


@dataclass
class OpRecord:
    """One dispatched op of the profiled step."""

    index: int
    func: str
    name: str
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    outputs: tuple[int, ...]
    output_bytes: int
    requires_grad: bool
    is_random: bool
    module: str
    flops: int
    in_loss: bool
    saved: list[int] = field(default_factory=list)
    saved_own_output: bool = False
    #: ran with grad disabled inside a grad-enabled step: an op of a custom Function's forward
    grad_disabled: bool = False
    #: bytes a custom Function whose forward ended with this op saved after it returned
    function_saved_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    time_ms: list[float] = field(default_factory=list)


def op_node_index(name: str) -> int | None:
    """The model op index of a node ``op<k>_<name>`` (None for other nodes).

    Example:
        >>> op_node_index("op12_addmm"), op_node_index("loss0_sum")
        (12, None)
    """
    if not name.startswith("op"):
        return None
    head = name[2:].split("_", 1)[0]
    return int(head) if head.isdigit() else None


def _key(t: torch.Tensor) -> int | None:
    if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records every op dispatched while active; ``kept`` holds every tensor seen so that a
    storage address names one storage for the whole step."""

    def __init__(self, counter: FlopCounterMode, module_stack: list[str]) -> None:
        super().__init__()
        self.counter = counter
        self.module_stack = module_stack
        self.ops: list[OpRecord] = []
        self.kept: list[torch.Tensor] = []
        self.bytes_of: dict[int, int] = {}
        self.in_loss = False
        self.model_ops = 0
        self.output_keys: tuple[int, ...] = ()
        self.pending_saves: list[int] = []
        self.last_outputs: list[torch.Tensor] = []
        self.outputs_of: list[list[torch.Tensor]] = []

    def _keys(self, leaves: list[Any]) -> list[int]:
        keys = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and (key := _key(leaf)) is not None:
                self.kept.append(leaf)
                self.bytes_of[key] = leaf.untyped_storage().nbytes()
                keys.append(key)
        return keys

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func) in UNCOUNTED_OPS:
            return func(*args, **kwargs)
        in_leaves = tree_flatten((args, kwargs))[0]
        flops_before = self.counter.get_total_flops()
        started = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        schema = func._schema
        written = [a for i, a in enumerate(args) if i < len(schema.arguments) and isinstance(a, torch.Tensor)
                   and schema.arguments[i].alias_info is not None and schema.arguments[i].alias_info.is_write]
        out_leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        short = schema.name.split("::")[-1]
        index = self.model_ops if not self.in_loss else len(self.ops) - self.model_ops
        record = OpRecord(
            index=index, func=str(func), name=short, reads=tuple(dict.fromkeys(self._keys(in_leaves))),
            writes=tuple(self._keys(written)), outputs=tuple(dict.fromkeys(self._keys(out_leaves))),
            output_bytes=sum(t.numel() * t.element_size() for t in out_leaves),
            requires_grad=False,
            is_random=torch.Tag.nondeterministic_seeded in func.tags, module=self.module_stack[-1],
            flops=int(self.counter.get_total_flops() - flops_before), in_loss=self.in_loss, time_ms=[elapsed_ms],
            saved=self.pending_saves, grad_disabled=not torch.is_grad_enabled())
        self.pending_saves = []
        self.last_outputs = out_leaves
        self.outputs_of.append(out_leaves)
        self.ops.append(record)
        if not self.in_loss:
            self.model_ops += 1
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """A save after op ``k - 1`` ran belongs to it when it made the tensor (an output saved),
        else to op ``k`` (an input saved before op ``k`` runs), as :mod:`rewrite.op_regions` decides."""
        key = _key(t)
        if key is None:
            return t
        self.kept.append(t)
        self.bytes_of[key] = t.untyped_storage().nbytes()
        last = self.ops[-1] if self.ops else None
        if last is not None and any(o is t for o in self.last_outputs):
            last.saved.append(key)
            last.saved_own_output = True
        else:
            self.pending_saves.append(key)
            if last is not None and last.grad_disabled:
                # a custom Function saving after its forward's ops (which ran with grad disabled):
                # the save is the next op's, as the rewrite sees it, but the Function's backward
                # (this op's, the one that made its output) still reads it. After an op of a
                # no_grad block this is the next op's input, and the op, with no backward, never
                # counts it.
                last.function_saved_bytes += self.bytes_of[key]
        return t


@contextmanager
def _module_stack(model: torch.nn.Module, stack: list[str]) -> Iterator[None]:
    paths = {id(m): path for path, m in model.named_modules()}

    def pre(module: torch.nn.Module, args: Any) -> None:
        stack.append(paths.get(id(module), stack[-1]))

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if len(stack) > 1:
            stack.pop()

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _NoModuleTracking:
    """Stands in for ``FlopCounterMode``'s module tracker, which counts every FLOP under the
    global scope alone here: its hooks on each module call dispatch ``view`` ops of their own
    where a module's input is a leaf that requires grad (wav2vec2's feature encoder), which the
    plain forward the rewrite numbers its ops in does not dispatch."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_NoModuleTracking":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _record_step(model: torch.nn.Module, inputs: StepInputs, step: TrainingStep) -> _Recorder:
    stack = [""]
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModuleTracking()  # type: ignore[assignment]
    recorder = _Recorder(counter, stack)
    with preserved_state(model), _module_stack(model, stack), counter, \
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        with recorder:
            output = model(*inputs.args, **inputs.kwargs)
            recorder.in_loss = True
            recorder.output_keys = tuple(recorder._keys(tree_flatten(output)[0]))
            loss = step.loss(output)
        # autograd marks an op's outputs after the dispatch returns (a custom Function's, after it)
        for record, outs in zip(recorder.ops, recorder.outputs_of):
            record.requires_grad = any(t.requires_grad for t in outs)
        recorder.outputs_of = []
        if not step.output_held:
            output = None
        loss.backward()
    if recorder.pending_saves and recorder.ops:
        recorder.ops[-1].saved.extend(recorder.pending_saves)
    recorder.kept, recorder.last_outputs, recorder.pending_saves = [], [], []
    return recorder


def profile_op_stream(model: torch.nn.Module, example_inputs: Any, *, timing_repeats: int | None = None,
                      step: TrainingStep | None = None, cache_dir: str | os.PathLike[str] | None = None) -> CostGraph:
    """One :class:`CostGraph` for ``model``'s training step as the ATen ops it dispatches.

    With ``cache_dir`` (``"auto"``: the user's cache folder, :func:`profiling.cache.resolve_cache_dir`)
    the profile is kept there, keyed by the recorded op stream (:func:`profiling.op_stream_key.op_stream_fingerprint`):
    a later call on the same ops runs the recording step and reads the rest (node times, peaks)
    from the file, so it gets the same profile, and the same plan, as the first.

    Example:
        >>> import tempfile
        >>> lin = torch.nn.Linear(4, 4)
        >>> g = profile_op_stream(lin, (torch.randn(2, 4),), timing_repeats=1)
        >>> g.metadata["capture"], g.metadata["model_ops"]
        ('graph-breaks', 2)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     first = profile_op_stream(lin, (torch.randn(2, 4),), timing_repeats=1, cache_dir=folder)
        ...     again = profile_op_stream(lin, (torch.randn(2, 4),), timing_repeats=1, cache_dir=folder)
        >>> first.metadata["cache"], again.metadata["cache"], again.nodes == first.nodes
        ('miss', 'hit', True)
    """
    # its memory step times nothing: two timing steps of their own where none is asked for
    timing_repeats = OP_STREAM_TIMING_PASSES if timing_repeats is None else timing_repeats
    step = step if step is not None else TrainingStep()
    inputs = example_inputs if isinstance(example_inputs, StepInputs) else StepInputs.from_example(example_inputs)
    first = _record_step(model, inputs, step)
    persistent = _persistent_storages(model, inputs, first)
    folder = resolve_cache_dir(cache_dir)
    if folder is None:
        return _measured_profile(model, inputs, step, timing_repeats, first, persistent)
    tensors = [*model.parameters(), *model.buffers(), *inputs.tensors()]
    key = op_stream_fingerprint(_cost_graph(first, persistent, step, 0.0, 0), tensors, step)
    return through_cache(folder, key,
                         lambda: _measured_profile(model, inputs, step, timing_repeats, first, persistent))


def _persistent_storages(model: torch.nn.Module, inputs: StepInputs, first: _Recorder) -> dict[int, str]:
    """The storages of the parameters, buffers and inputs, by key: ``param``, ``buffer`` or ``input``."""
    persistent: dict[int, str] = {}
    for kind, tensors in (("param", model.parameters()), ("buffer", model.buffers()), ("input", inputs.tensors())):
        for t in tensors:
            if (key := _key(t)) is not None:
                persistent.setdefault(key, kind)
                first.bytes_of.setdefault(key, t.untyped_storage().nbytes())
    return persistent


def _measured_profile(model: torch.nn.Module, inputs: StepInputs, step: TrainingStep, timing_repeats: int,
                      first: _Recorder, persistent: dict[int, str]) -> CostGraph:
    """The recorded step ``first`` with its ops' times and peaks measured, and the step's."""
    # on CPU the step that measures each op's peaks also measures the step's: one step less
    peaks = measure_op_peaks(model, inputs, step)
    peak_bytes = peaks.step_peak_bytes if peaks.step_peak_bytes is not None else \
        measure_step_peak_bytes(model, inputs, step)
    # the two steps before warmed the allocator: the timing needs no warm-up step of its own
    times_ms, step_ms = time_ops(model, inputs, step, timing_repeats, warm_up=False)
    model_ops = [r for r in first.ops if not r.in_loss]
    if len(times_ms) == len(model_ops):
        for record, ms in zip(model_ops, times_ms):
            record.time_ms = [ms]
    else:
        log.debug("the timing steps dispatched %d ops, the profiled one %d: times of the profiled step are used",
                  len(times_ms), len(model_ops))
    for record in first.ops:
        if not record.in_loss:
            record.forward_peak_bytes = peaks.forward.get(record.index, 0)
            record.backward_peak_bytes = peaks.backward.get(record.index, 0) + record.function_saved_bytes
    graph = _cost_graph(first, persistent, step, step_ms, peak_bytes)

    return calibrated(graph)


def _cost_graph(rec: _Recorder, persistent: dict[int, str], step: TrainingStep, step_ms: float,
                peak_bytes: int) -> CostGraph:
    nodes: list[CostNode] = []
    producer: dict[int, str] = {}
    for key, kind in sorted(persistent.items()):
        name = f"{kind}_{key}"
        nodes.append(CostNode(name, "placeholder" if kind == "input" else "get_attr", kind=kind, output_storages=(key,),
                              output_bytes=rec.bytes_of[key] if kind == "param" else 0, requires_grad=kind == "param"))
        producer[key] = name
    breaks = 0
    opaque = 0
    for record in rec.ops:
        fresh = [key for key in (*record.reads, *record.saved) if key not in producer and key not in record.outputs]
        if fresh:
            name = f"py{opaque}"
            opaque += 1
            breaks += not record.in_loss
            nodes.append(CostNode(name, "python", output_storages=tuple(dict.fromkeys(fresh)), recomputable=False,
                                  module=record.module))
            producer.update({key: name for key in fresh})
        breaks += record.name in BREAK_OPS and not record.in_loss
        name = f"loss{record.index}_{record.name}" if record.in_loss else f"op{record.index}_{record.name}"
        nodes.append(CostNode(
            name, record.func, input_names=tuple(dict.fromkeys(producer[k] for k in record.reads if k in producer)),
            output_storages=record.outputs, saved_storages=tuple(dict.fromkeys(record.saved)),
            output_bytes=record.output_bytes, requires_grad=record.requires_grad,
            is_alias=any(k in producer for k in record.outputs), time_ms=statistics.median(record.time_ms),
            flops=record.flops, recomputable=not record.in_loss and not _writes_persistent(record, persistent),
            is_random=record.is_random, module=record.module, forward_peak_bytes=record.forward_peak_bytes,
            backward_peak_bytes=record.backward_peak_bytes,
            after_last_save_fraction=(0.0 if record.saved_own_output or not record.saved else 1.0)))
        for key in (*record.outputs, *record.saved):
            producer.setdefault(key, name)
    loss_node = nodes[-1].name
    model_outputs = tuple(dict.fromkeys(producer[key] for key in rec.output_keys if key in producer))
    storages = tuple(Storage(key, size, key in persistent) for key, size in sorted(rec.bytes_of.items())
                     if key in producer)
    return CostGraph(tuple(nodes), storages, output_names=(*model_outputs, loss_node), loss_names=(loss_node,),
                     step_ms=step_ms, measured_peak_bytes=peak_bytes, output_held=step.output_held,
                     metadata={"capture": "graph-breaks", "subgraphs": breaks + 1, "model_ops": rec.model_ops,
                               "op_names": [r.func for r in rec.ops if not r.in_loss]})


def _writes_persistent(record: OpRecord, persistent: dict[int, str]) -> bool:
    """An op writing a parameter, buffer or input: it runs once (a replay writes a copy, but
    its output is then the copy, which the plan must not count on)."""
    return any(key in persistent for key in record.writes)
