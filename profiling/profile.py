"""Run a captured graph once and record, for every node, what the planner needs.

For each FX node: the storages its outputs live in, the storages autograd saves for backward
while it runs (observed with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by
storage), its output bytes, its forward time (CUDA events on a GPU, a timer on CPU; the median over warm passes of the
whole step, :mod:`profiling.node_times`)
and its FLOPs (``FlopCounterMode``), plus whether it draws random numbers or mutates state.
The interpreter follows PyTorch's ``shape_prop.py``: failures are re-raised naming the node.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> graph = profile_graph(trace_module(model, (x,)), (x,))
    >>> graph.node("relu").output_bytes
    128
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from planner.costgraph import CostGraph, CostNode, Storage
from planner.errors import ProfileError
from profiling.measure import (
    StepInputs,
    loss_of,
    measure_step_peak_bytes,
    preserved_state,
    run_step,
    unflatten_output,
)
from profiling.node_times import (
    TIMING_SPREAD_LIMIT,
    Timer,
    cpu_timer,
    pass_spread,
    time_nodes_in_passes,
    time_nodes_on_cuda,
)
from profiling.roofline import estimate_ms
from profiling.progress import NodeProgress
from profiling.progress import log as progress_log
from profiling.selective_overhead import selective_overhead_ms_per_node
from profiling.temporaries import FakeAllocationTracker, measure_node_peaks
from profiling.trace import RUN_ONCE_OPS

__all__ = ["profile_graph", "flat_graph_inputs"]

log = logging.getLogger(__name__)


def flat_graph_inputs(gm: torch.fx.GraphModule, inputs: StepInputs) -> list[Any]:
    """The values of the graph's placeholders, in order, for ``gm(*inputs.args, **inputs.kwargs)``."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is not None:
        from torch.fx._pytree import tree_flatten_spec

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


class _StorageTable:
    """Gives every distinct storage seen during the run a small integer key."""

    def __init__(self) -> None:
        self.key_of_ptr: dict[int, int] = {}
        self.storages: list[Storage] = []
        self.keep: list[torch.Tensor] = []  # no storage is freed, so no address is reused

    def key(self, t: torch.Tensor, persistent: bool = False) -> int | None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        ptr = storage._cdata  # the StorageImpl: shared by views, works for fake tensors too
        if ptr not in self.key_of_ptr:
            self.key_of_ptr[ptr] = len(self.storages)
            self.storages.append(Storage(len(self.storages), nbytes, persistent))
            self.keep.append(t)
        return self.key_of_ptr[ptr]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_mutating(node: torch.fx.Node) -> bool:
    """Whether the op's schema says it writes an argument (in-place ops; the interpreter also
    catches ops that bump an input's version counter, such as batch_norm's running stats)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    if node.op == "call_function" and node.is_impure():
        return True  # e.g. profiling.trace.update_running_stats
    if node.op == "call_module":
        return str(node.target).startswith("_guards")
    return False


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

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
        return False  # no running statistics: a pure op (see profiling.trace.split_batch_norm_updates)
    training = [a for a in node.args if isinstance(a, bool)]
    return bool(training and training[0]) or node.kwargs.get("training", False) is True


class _DispatchSpy(TorchDispatchMode):
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

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            self.writes_in_place = True
        out = func(*args, **(kwargs or {}))
        self.op_count += 1
        for t in _tensors(out):
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


def _keepable(node: torch.fx.Node, is_alias: bool, record: dict[str, Any]) -> bool:
    """Whether a selective checkpoint policy can keep the node's outputs from the forward
    instead of recomputing them (:mod:`planner.keep`): a function call that writes nothing in
    place, aliases no input and draws no random numbers (skipping a random op in the recompute
    would shift the random stream of the ops after it)."""
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return False  # a wrapped subgraph (e.g. torch.no_grad regions), not one op
    return (node.op == "call_function" and not is_alias and not record["mutating"]
            and not record["writes_in_place"] and not _is_random(node))


def _is_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return True
    name = str(node.target)
    return any(word in name for word in ("dropout", "rand", "bernoulli", "normal", "multinomial"))


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return str(node.target) if node.op == "call_module" else ""


def _timer(device: torch.device) -> Timer:
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
            tuple(describe(t) for t in _tensors(result)), repr(n.kwargs) if n.kwargs else "")


def pool_repeated_op_times(records: dict[str, dict[str, Any]]) -> int:
    """Give every node the median time of all nodes running the same op on the same shapes
    (and the median of their measured time shares after the last save).

    A transformer runs each op once per layer; timing noise on a shared machine (one mul 5x
    slower than its twin in the next layer) would otherwise steer the planner. Returns how
    many nodes share a time with another.

    Example:
        >>> records = {"a": {"signature": 1, "time_ms": 1.0}, "b": {"signature": 1, "time_ms": 9.0},
        ...            "c": {"signature": 1, "time_ms": 2.0}, "d": {"signature": 2, "time_ms": 5.0}}
        >>> pool_repeated_op_times(records), [r["time_ms"] for r in records.values()]
        (3, [2.0, 2.0, 2.0, 5.0])
    """
    groups: dict[Any, list[dict[str, Any]]] = {}
    for record in records.values():
        groups.setdefault(record["signature"], []).append(record)
    pooled = 0
    for members in groups.values():
        if len(members) > 1:
            median_ms = statistics.median(r["time_ms"] for r in members)
            shares = [r["after_last_save_time_fraction"] for r in members
                      if r.get("after_last_save_time_fraction") is not None]
            for r in members:
                r["time_ms"] = median_ms
                if shares:
                    r["after_last_save_time_fraction"] = statistics.median(shares)
            pooled += len(members)
    return pooled


class _ProfilingInterpreter(torch.fx.Interpreter):
    """Runs the graph once with autograd on, recording per-node storages, saves, FLOPs and time."""

    def __init__(self, gm: torch.fx.GraphModule,
                 device: torch.device, to_fake: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 progress: NodeProgress | None = None, tracker: FakeAllocationTracker | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.progress = progress
        self.tracker = tracker
        self.to_fake = to_fake
        self.time = _timer(device)
        self.records: dict[str, dict[str, Any]] = {}
        self.buffer_ids = {id(to_fake(b) if to_fake else b) for b in gm.buffers()}

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.to_fake is not None and isinstance(value, torch.Tensor):
            return self.to_fake(value)
        return value

    def run_node(self, n: torch.fx.Node) -> Any:
        saved: list[torch.Tensor] = []
        counter = FlopCounterMode(display=False)
        spy = _DispatchSpy({t.untyped_storage()._cdata for a in n.all_input_nodes for t in _tensors(self.env.get(a))})
        at_last_pack = (0, 0)  # (FLOPs, ops) counted when autograd saved its last tensor

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal at_last_pack
            saved.append(t)
            at_last_pack = (int(counter.get_total_flops()), spy.op_count)
            return t
        result: Any = None

        def run_once() -> None:
            nonlocal result
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter, spy:
                result = super(_ProfilingInterpreter, self).run_node(n)

        before = [(t, t._version) for a in n.all_input_nodes for t in _tensors(self.env.get(a))]
        buffers_before = [(t, t.clone()) for t, _ in before if id(t) in self.buffer_ids]
        if self.tracker is not None:
            self.tracker.node_started(n.name)
        try:
            first_run_ms = self.time(run_once)
        except Exception as exc:
            where = n.meta.get("stack_trace", "").strip().splitlines()[-1:] or [""]
            raise ProfileError(
                f"node {n.name!r} ({n.op} {n.target}) failed while profiling: {type(exc).__name__}: {exc} "
                f"{where[0].strip()}"
            ) from exc
        if self.tracker is not None:
            self.tracker.node_finished(n.name)
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


def profile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    *,
    timing_repeats: int = 3,
    measure_peak: bool = True,
    step_repeats: int = 3,
    fake: bool = False,
    target: str = "cpu",
    progress: bool = False,
) -> CostGraph:
    """Profile one forward plus backward of ``gm`` on ``example_inputs``.

    Each node's time is its median over ``timing_repeats`` warm training steps run node by node
    after an untimed one (:func:`profiling.node_times.time_nodes_in_passes`; on CUDA, GPU time
    with the forward queued ahead of the GPU, :func:`profiling.node_times.time_nodes_on_cuda`);
    nodes running the same op on the same shapes (one per layer in a transformer) then get the median
    of their measured times (:func:`pool_repeated_op_times`), which damps timing noise.
    RNG state, buffers and gradients of ``gm`` are restored afterwards, so profiling leaves the
    model as it was. With ``measure_peak``, the unoptimized step's peak is also measured at the
    allocator and stored as ``measured_peak_bytes``.

    With ``fake=True`` nothing is allocated or run for real: the graph runs on fake tensors
    (``FakeTensorMode``), so bytes come from tensor sizes alone (the same on every machine;
    temporaries are estimated from the tensors each aten op creates, see
    :class:`profiling.temporaries.FakeAllocationTracker`), times from a FLOP and bytes roofline for ``target``
    (see :mod:`profiling.roofline`), and nothing is measured. Tensors on the meta device (a
    model built under ``torch.device("meta")``) work in fake mode: nothing is ever allocated.
    The per-node cost of a selective checkpoint policy is measured on the device
    (:mod:`profiling.selective_overhead`); in fake mode it is unknown and taken as 0.

    Progress goes to the ``profiling.progress`` logger at INFO (every tenth of the nodes and
    each phase); ``progress=True`` draws a tqdm bar instead when tqdm is installed.
    """
    inputs = StepInputs.from_example(example_inputs)
    flat = flat_graph_inputs(gm, inputs)
    tensors = [t for t in (*gm.parameters(), *gm.buffers(), *inputs.tensors())]
    device = tensors[0].device if tensors else torch.device("cpu")
    to_fake, fake_mode = _fake_converter() if fake else (None, None)
    table = _StorageTable()
    constants = [v for v in vars(gm).values() if isinstance(v, torch.Tensor)]  # lifted tensor constants
    for t in (*gm.parameters(), *gm.buffers(), *_tensors(flat), *constants):
        table.key(to_fake(t) if to_fake else t, persistent=True)
    if to_fake:
        flat = [to_fake(v) if isinstance(v, torch.Tensor) else v for v in flat]

    node_count = len(gm.graph.nodes)
    bar = NodeProgress(node_count, f"profiling {node_count} nodes{' (fake)' if fake else ''}", bar=progress)
    tracker = FakeAllocationTracker() if fake else None
    interp = _ProfilingInterpreter(gm, device, to_fake, bar, tracker)
    with preserved_state(gm), (fake_mode if fake_mode is not None else contextlib.nullcontext()), \
            (tracker if tracker is not None else contextlib.nullcontext()):
        try:
            flat_out = interp.run(*flat, enable_io_processing=False)
        finally:
            bar.close()
        output = unflatten_output(gm, flat_out)
        loss = loss_of(output)
        loss.backward()
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        output_names = tuple(dict.fromkeys(a.name for a in tree_leaves(output_node.args) if isinstance(a, torch.fx.Node)))
        loss_names = tuple(name for name in output_names if interp.records[name]["result"] is loss)
        del loss, output, flat_out
    if tracker is not None:
        forward_peaks, backward_peaks = tracker.forward_peaks(), tracker.backward_peaks()
        _roofline_times(gm, interp, target)
        step_times: list[float] = []
        timing: dict[str, Any] = {}
    else:
        timer = _timer(device)
        progress_log.info("profiling: timing nodes in %d warm passes", timing_repeats)
        # nodes a recompute can stop inside: time the share after their last save
        split = {name for name, rec in interp.records.items()
                 if rec.get("after_last_save_fraction") is not None and 0.0 < rec["after_last_save_fraction"] < 1.0}
        node_times = (time_nodes_on_cuda(gm, flat, timing_repeats, split_nodes=split) if device.type == "cuda"
                      else time_nodes_in_passes(gm, flat, timing_repeats, timer, split_nodes=split))
        timing = {"timing_passes": node_times.passes, "timing_spread": node_times.spread}
        for name, time_ms in node_times.time_ms.items():
            interp.records[name]["time_ms"] = time_ms
        for name, share in node_times.after_last_save_share.items():
            interp.records[name]["after_last_save_time_fraction"] = share
        pooled = pool_repeated_op_times(interp.records)
        log.debug("profiling: %d nodes share their time with a twin op (median)", pooled)
        progress_log.info("profiling: measuring per-node temporaries")
        forward_peaks, backward_peaks = measure_node_peaks(gm, inputs)
    nodes = _cost_nodes(gm, interp, table, forward_peaks, backward_peaks)
    # every value of the profiling run is still held by the interpreter: a step timed beside
    # them ran 20 % slower than the same step afterwards (GPT-2 width 256: 983 against 815 ms)
    del interp
    if tracker is None:
        progress_log.info("profiling: timing %d steps", step_repeats)
        step_times = _step_times_ms(gm, inputs, timer, step_repeats)
        timing["step_time_spread"] = pass_spread(step_times)
        _warn_if_noisy(timing)
    graph = CostGraph(
        nodes=nodes,
        storages=tuple(table.storages),
        output_names=output_names,
        loss_names=loss_names,
        # with no measured step, forward plus backward is taken as three forwards
        step_ms=statistics.median(step_times) if step_times else 3 * sum(n.time_ms for n in nodes),
        segment_overhead_bytes=_rng_state_bytes(device),
        selective_overhead_ms_per_node=0.0 if fake else selective_overhead_ms_per_node(device),
        measured_peak_bytes=measure_step_peak_bytes(gm, inputs) if measure_peak and not fake else None,
        metadata={"device": str(device), "mode": "fake" if fake else "measured", "target": target,
                  "computation_changes": list(gm.meta.get("computation_changes", ())), **timing},
    )
    log.info("profiled %d nodes, %d storages%s", len(nodes), len(table.storages), " (fake tensors)" if fake else "")
    return graph


def _warn_if_noisy(timing: dict[str, Any]) -> None:
    """One warning when the node passes or the whole steps were timed on a machine too busy for
    their medians to be trusted: recompute costs, and so plans, may then change between runs."""
    spread = max(timing["timing_spread"], timing["step_time_spread"])
    if spread > TIMING_SPREAD_LIMIT:
        log.warning("timings varied by %.0f%% between passes (%d node passes, the step by %.0f%%): the machine is "
                    "busy, so recompute costs and the plan may change between runs; profile on a quiet machine "
                    "or raise timing_repeats", 100 * timing["timing_spread"], timing["timing_passes"],
                    100 * timing["step_time_spread"])


def _step_times_ms(gm: torch.fx.GraphModule, inputs: StepInputs, timer: Timer, repeats: int) -> list[float]:
    """Times of ``repeats`` training steps of ``gm`` after an untimed one, gradients cleared
    before each (as a loop calling ``zero_grad(set_to_none=True)`` does); the model's RNG state,
    buffers and ``.grad`` are restored afterwards."""
    times_ms: list[float] = []
    with preserved_state(gm):
        for timed in [False] + [True] * max(1, repeats):
            for p in gm.parameters():
                p.grad = None
            elapsed_ms = timer(lambda: run_step(gm, inputs))
            if timed:
                times_ms.append(elapsed_ms)
    return times_ms


def _fake_converter() -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """A FakeTensorMode and a memoised real-to-fake converter (same real tensor, same fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}
    keep: list[torch.Tensor] = []

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = mode.from_tensor(t, static_shapes=True)
            keep.append(t)  # the id stays this tensor's while the converter lives
        return made[id(t)]

    return to_fake, mode


def _roofline_times(gm: torch.fx.GraphModule, interp: "_ProfilingInterpreter", target: str) -> None:
    """Replace the (meaningless) fake-tensor timings by roofline estimates for ``target``."""
    for n in gm.graph.nodes:
        rec = interp.records.get(n.name)
        if rec is None or n.op not in ("call_function", "call_method", "call_module"):
            continue
        moved = sum(t.numel() * t.element_size() for t in _tensors(rec["result"]))
        for a in n.all_input_nodes:
            moved += sum(t.numel() * t.element_size() for t in _tensors(interp.records[a.name]["result"]))
        rec["time_ms"] = estimate_ms(rec["flops"], moved, target)


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes a checkpointed segment keeps to replay random ops: the saved RNG state(s)."""
    size = torch.get_rng_state().nbytes
    if device.type == "cuda":
        size += torch.cuda.get_rng_state(device).nbytes
    return int(size)


def _cost_nodes(
    gm: torch.fx.GraphModule,
    interp: _ProfilingInterpreter,
    table: _StorageTable,
    forward_peaks: dict[str, int],
    backward_peaks: dict[str, int],
) -> tuple[CostNode, ...]:
    nodes: list[CostNode] = []
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        rec = interp.records[n.name]
        outs = _tensors(rec["result"])
        if n.op == "placeholder":
            kind = "input"
        elif n.op == "get_attr":
            kind = "param" if n.target in params else ("buffer" if n.target in buffers else "constant")
        else:
            kind = "compute"
        inputs = tuple(dict.fromkeys(a.name for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)))
        input_ptrs = {
            t.untyped_storage()._cdata
            for name in inputs
            for t in _tensors(interp.records[name]["result"])
        }
        out_keys = [k for t in outs if (k := table.key(t, persistent=kind != "compute")) is not None]
        saved_keys = [k for t in rec["saved"] if (k := table.key(t)) is not None]
        is_alias = kind == "compute" and bool(outs) and all(
            t.untyped_storage()._cdata in input_ptrs for t in outs
        )
        nodes.append(
            CostNode(
                name=n.name,
                op=str(n.target) if n.op != "placeholder" else "placeholder",
                kind=kind,
                input_names=inputs,
                output_storages=tuple(dict.fromkeys(out_keys)),
                saved_storages=tuple(dict.fromkeys(saved_keys)),
                output_bytes=sum(t.numel() * t.element_size() for t in outs if t.is_floating_point() or t.is_complex()),
                requires_grad=any(t.requires_grad for t in outs),
                is_alias=is_alias,
                time_ms=rec["time_ms"] if kind == "compute" else 0.0,
                flops=rec["flops"] if kind == "compute" else 0,
                # run-once buffer updates skip themselves on recompute (profiling.trace)
                recomputable=kind == "compute" and (not rec["mutating"] or rec["run_once"]),
                is_random=kind == "compute" and _is_random(n),
                module=_module_of(n),
                forward_peak_bytes=forward_peaks.get(n.name, 0) if kind == "compute" else 0,
                backward_peak_bytes=backward_peaks.get(n.name, 0) if kind == "compute" else 0,
                selective_save=kind == "compute" and _keepable(n, is_alias, rec),
                after_last_save_fraction=rec["after_last_save_fraction"] if kind == "compute" else None,
                after_last_save_time_fraction=rec.get("after_last_save_time_fraction") if kind == "compute" else None,
                viewed_storages=tuple(dict.fromkeys(
                    k for t in rec["input_views"] if (k := table.key(t)) is not None)) if kind == "compute" else (),
            )
        )
    return tuple(nodes)
