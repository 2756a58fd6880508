"""Profile one training step of a captured graph: the ``CostGraph`` the planner solves on.

For each FX node: the storages its outputs live in, the storages autograd saves for backward
while it runs (observed with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by
storage), its output bytes, its forward time (CUDA events on a GPU, a timer on CPU; the median
over warm passes of the whole step, :mod:`profiling.node_times`) and its FLOPs
(``FlopCounterMode``), plus whether it draws random numbers or mutates state.
:func:`profile_graph` runs the graph once under :class:`profiling.interpreter.ProfilingInterpreter`,
assembles the nodes (:mod:`profiling.cost_nodes`), runs one step under the memory profiler
(per-node temporaries and the step's peak, :mod:`profiling.temporaries`), then the warm timing
passes (node times and the step's time); on fake tensors it estimates instead
(:mod:`profiling.fake_mode`).

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
import dataclasses
import logging
import statistics
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from planner.core.costgraph import CostGraph, CostNode
from profiling.cost_nodes import StorageTable, cost_nodes
from profiling.criterion import criterion_inputs, criterion_name, criterion_node, expanded_gradient_inputs, run_criterion
from profiling.device_overheads import DeviceOverheads, device_overheads_ms
from profiling.fake_mode import fake_converter, roofline_times, target_kernels, target_storages
from profiling.interpreter import ProfilingInterpreter, step_timer, tensors_of
from profiling.measure import (
    StepInputs,
    TrainingStep,
    device_of,
    flat_graph_inputs,
    measure_step_peak_bytes,
    preserved_state,
    run_step,
    unflatten_output,
)
from profiling.node_times import (
    MAX_TIMING_PASSES,
    TIMING_SPREAD_LIMIT,
    NodeTimes,
    TimedPass,
    Timer,
    pass_spread,
    time_nodes_in_passes,
    time_nodes_on_cuda,
)
from profiling.progress import NodeProgress
from profiling.progress import log as progress_log
from profiling.temporaries import FakeAllocationTracker, NodePeaks, measure_node_peaks

__all__ = ["profile_graph", "flat_graph_inputs", "measure_unoptimized_step", "UnoptimizedStep", "CPU_TIMING_PASSES",
           "CUDA_TIMING_PASSES"]

log = logging.getLogger(__name__)

#: Timed passes of a captured step where ``timing_repeats`` is None, on CPU: the memory pass alone,
#: which times every node and its share after its last save (docs/tuning.md#cpu_timing_passes).
CPU_TIMING_PASSES = 1
#: The same on CUDA, where the memory pass times nothing (the kernels run after the host's ranges).
CUDA_TIMING_PASSES = 2


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


class UnoptimizedStep(NamedTuple):
    """One measured training step of a captured graph with nothing recomputed: its peak at the
    allocator, and where the same step gives them (CPU), each node's peaks for the profile."""

    peak_bytes: int
    #: the step's per-node peaks, which :func:`profile_graph` takes as its memory pass; None on CUDA
    node_peaks: NodePeaks | None


def measure_unoptimized_step(gm: torch.fx.GraphModule, inputs: StepInputs,
                             step: TrainingStep = TrainingStep()) -> UnoptimizedStep:
    """Measure one training step of ``gm`` as ``step`` runs it. On CPU the step runs node by
    node under the memory profiler (:func:`profiling.temporaries.measure_node_peaks`), so the
    measurement that decides whether a budget needs a plan is also the profile's memory pass;
    on CUDA the peak is ``max_memory_allocated``'s and the profile measures its nodes itself.

    Example:
        >>> from profiling.trace import trace_module
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> gm = trace_module(model, (x,))
        >>> measured = measure_unoptimized_step(gm, StepInputs.from_example((x,)))
        >>> measured.peak_bytes == measure_step_peak_bytes(gm, StepInputs.from_example((x,)))
        True
        >>> profile_graph(gm, (x,), node_peaks=measured.node_peaks).measured_peak_bytes == measured.peak_bytes
        True
    """
    if device_of(gm, inputs).type != "cpu":
        return UnoptimizedStep(measure_step_peak_bytes(gm, inputs, step), None)
    peaks = measure_node_peaks(gm, inputs, step, criterion_name(n.name for n in gm.graph.nodes))
    assert peaks.step_peak_bytes is not None, "a CPU step's node peaks carry the step's peak"
    return UnoptimizedStep(peaks.step_peak_bytes, peaks)




def profile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    *,
    timing_repeats: int | None = None,
    measure_peak: bool = True,
    step_repeats: int = 3,
    fake: bool = False,
    target: str = "cpu",
    progress: bool = False,
    step: TrainingStep = TrainingStep(),
    node_peaks: NodePeaks | None = None,
    overheads_path: Path | None = None,
) -> CostGraph:
    """Profile one forward plus backward of ``gm`` on ``example_inputs``, as ``step`` runs it:
    the loss ``step`` takes (a criterion outside the graph becomes one node of the profile,
    :mod:`profiling.criterion`) and the output dropped before the backward unless
    ``step.output_held`` (``CostGraph.output_held``).

    Each node's time is its median over ``timing_repeats`` training steps run node by node
    (None: :data:`CPU_TIMING_PASSES` on CPU, :data:`CUDA_TIMING_PASSES` on CUDA), the step that
    measures temporaries the first of them on CPU
    (:func:`profiling.node_times.time_nodes_in_passes`, which drops a slow first pass once; on CUDA, GPU time
    with the forward queued ahead of the GPU, :func:`profiling.node_times.time_nodes_on_cuda`);
    nodes running the same op on the same shapes (one per layer in a transformer) then get the median
    of their measured times (:func:`pool_repeated_op_times`), which damps timing noise.
    RNG state, buffers and gradients of ``gm`` are restored afterwards, so profiling leaves the
    model as it was. The step's time is the median of the passes' node times plus their
    backward (on CUDA, of ``step_repeats`` whole steps). With ``measure_peak``, the unoptimized
    step's peak is also measured at the allocator (on CPU, in the step that measures
    temporaries) and stored as ``measured_peak_bytes``.

    With ``fake=True`` nothing is allocated or run for real: the graph runs on fake tensors
    (``FakeTensorMode``), so bytes come from tensor sizes alone (the same on every machine;
    temporaries are estimated from the tensors each aten op creates, see
    :class:`profiling.temporaries.FakeAllocationTracker`), times from a FLOP and bytes roofline for ``target``
    (see :mod:`profiling.roofline`, calibrated on H100 measurements for a GPU), and nothing is
    measured. For a GPU ``target``, attention and dropout save what CUDA's kernels save, and the
    step's storages are rounded up to the CUDA caching allocator's blocks
    (:mod:`profiling.gpu_rules`). Tensors on the meta device (a
    model built under ``torch.device("meta")``) work in fake mode: nothing is ever allocated.
    The per-node cost of a selective checkpoint policy (:mod:`profiling.selective_overhead`)
    and each checkpointed segment's own cost (:mod:`profiling.segment_overhead`) are measured
    on the device; in fake mode they are unknown and taken as 0.

    ``node_peaks``: the per-node peaks of this graph's step, measured already on CPU
    (:func:`measure_unoptimized_step`); the profile then runs no memory pass of its own, and
    its ``measured_peak_bytes`` is theirs.

    ``overheads_path``: the file that keeps the device's checkpoint overheads from one process to
    the next (:func:`profiling.device_overheads.device_overheads_ms`; the profile cache names it).

    Progress goes to the ``profiling.progress`` logger at INFO (every tenth of the nodes and
    each phase); ``progress=True`` draws a tqdm bar instead when tqdm is installed.
    """
    inputs = StepInputs.from_example(example_inputs)
    flat = flat_graph_inputs(gm, inputs)
    tensors = [t for t in (*gm.parameters(), *gm.buffers(), *inputs.tensors())]
    device = tensors[0].device if tensors else torch.device("cpu")
    to_fake, fake_mode = fake_converter() if fake else (None, None)
    table = StorageTable()
    constants = [v for v in vars(gm).values() if isinstance(v, torch.Tensor)]  # lifted tensor constants
    for t in (*gm.parameters(), *gm.buffers(), *tensors_of(flat), *constants):
        table.key(to_fake(t) if to_fake else t, persistent=True)
    if to_fake:
        flat = [to_fake(v) if isinstance(v, torch.Tensor) else v for v in flat]

    node_count = len(gm.graph.nodes)
    bar = NodeProgress(node_count, f"profiling {node_count} nodes{' (fake)' if fake else ''}", bar=progress)
    tracker = FakeAllocationTracker() if fake else None
    interp = ProfilingInterpreter(gm, device, to_fake, bar, tracker)
    loss_node = criterion_name(n.name for n in gm.graph.nodes)
    with preserved_state(gm), (fake_mode if fake_mode is not None else contextlib.nullcontext()), \
            (tracker if tracker is not None else contextlib.nullcontext()):
        try:
            # on fake tensors for a GPU, ops whose CUDA kernels save other tensors run as CUDA's
            with target_kernels(target) if fake else contextlib.nullcontext():
                flat_out = interp.run(*flat, enable_io_processing=False)
        finally:
            bar.close()
        output = unflatten_output(gm, flat_out)
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        output_names = tuple(dict.fromkeys(a.name for a in tree_leaves(output_node.args) if isinstance(a, torch.fx.Node)))
        criterion = run_criterion(output, step, interp.time,
                                  *((lambda: tracker.node_started(loss_node), lambda: tracker.node_finished(loss_node))
                                    if tracker is not None else ()), detach=tracker is None)
        loss = criterion.loss
        loss_names = tuple(name for name in output_names if interp.records[name]["result"] is loss)
        if loss_names:
            criterion = None  # the graph computes the loss itself
        else:
            values = {name: interp.records[name]["result"] for name in output_names}
            reads = criterion_inputs(loss, values)
            alone = [n.name for n in gm.graph.nodes if n.name in values and all(u.op == "output" for u in n.users)]
            # one backward of the criterion alone; not under the fake tracker, whose backward
            # windows it would widen (there every output gradient counts as a new buffer)
            expanded = expanded_gradient_inputs(loss, values, reads, alone) if tracker is None else ()
            loss_names, output_names = (loss_node,), (*output_names, loss_node)
        if tracker is not None:  # measured runs take their backward facts from measure_node_peaks
            loss.backward()
        del loss, output, flat_out
    if tracker is not None:
        roofline_times(gm, interp.records, target)
        forward_peaks, backward_peaks = tracker.forward_peaks(), tracker.backward_peaks()
        nodes = cost_nodes(gm, interp.records, table, forward_peaks, backward_peaks, tracker.backward_late_scratch())
        if criterion is not None:
            nodes += (criterion_node(loss_node, criterion, reads, table, forward_peaks.get(loss_node, 0),
                                     backward_peaks.get(loss_node, 0), expanded),)
        step_ms = 3 * sum(n.time_ms for n in nodes)  # with no measured step, forward plus backward is three forwards
        measured_peak_bytes, timing = None, {}
    else:
        # nodes a recompute can stop inside: time the share after their last save
        split = {name for name, rec in interp.records.items()
                 if rec.get("after_last_save_fraction") is not None and 0.0 < rec["after_last_save_fraction"] < 1.0}
        nodes = cost_nodes(gm, interp.records, table, {}, {})  # times and temporaries measured below
        if criterion is not None:  # its temporaries are measured below with the graph's
            nodes += (criterion_node(loss_node, criterion, reads, table, expanded_inputs=expanded),)
        del criterion
        signatures = {name: rec["signature"] for name, rec in interp.records.items()}
        # the profiling run holds every value it made: passes timed beside them ran slower (a
        # GPT-2 step 20 % slower: 983 against 815 ms), so they go before anything is timed
        del interp
        table.keep.clear()
        if node_peaks is None:
            progress_log.info("profiling: measuring per-node temporaries%s",
                              " and the step's peak" if measure_peak else "")
            # a whole step with values freed as the module frees them: it also warms the
            # allocator for the timing passes, which then need no untimed step of their own
            peaks = measure_node_peaks(gm, inputs, step, loss_node)
        else:
            peaks = node_peaks
        if timing_repeats is None:
            timing_repeats = CUDA_TIMING_PASSES if device.type == "cuda" else CPU_TIMING_PASSES
        node_times, step_times = _measured_times(gm, flat, inputs, device, timing_repeats, split, step_repeats, step,
                                                 peaks.timed_pass)
        step_ms = statistics.median(step_times)
        timing = {"timing_passes": node_times.passes, "timing_spread": node_times.spread,
                  "step_time_spread": pass_spread(step_times)}
        _warn_if_noisy(timing)
        measured_peak_bytes = None
        if measure_peak:
            measured_peak_bytes = (peaks.step_peak_bytes if peaks.step_peak_bytes is not None
                                   else measure_step_peak_bytes(gm, inputs, step))
        nodes = _with_measurements(nodes, signatures, node_times, peaks)
    overheads = DeviceOverheads(0.0, 0.0) if fake else device_overheads_ms(device, overheads_path)
    graph = CostGraph(
        nodes=nodes,
        storages=target_storages(table.storages, target) if fake else tuple(table.storages),
        output_names=output_names,
        loss_names=loss_names,
        step_ms=step_ms,
        segment_overhead_bytes=_rng_state_bytes(device),
        selective_overhead_ms_per_node=overheads.selective_ms_per_node,
        segment_overhead_ms=overheads.segment_ms,
        measured_peak_bytes=measured_peak_bytes,
        output_held=step.output_held,
        metadata={"device": str(device), "mode": "fake" if fake else "measured", "target": target,
                  "step": step.describe(),
                  "computation_changes": list(gm.meta.get("computation_changes", ())), **timing},
    )
    log.info("profiled %d nodes, %d storages%s", len(nodes), len(table.storages), " (fake tensors)" if fake else "")
    return graph


def _measured_times(gm: torch.fx.GraphModule, flat: list[Any], inputs: StepInputs, device: torch.device,
                    repeats: int, split: set[str], step_repeats: int,
                    step: TrainingStep, first_pass: TimedPass | None) -> tuple[NodeTimes, list[float]]:
    """Each node's warm forward time and the step's times, in ms.

    On CPU the step's time comes from the same passes (their node times plus their backward),
    so no step runs only to be timed, and the step the memory profiler measured node by node
    (``first_pass``) is the first of them; on CUDA, where the passes queue the forward ahead of the
    GPU, ``step_repeats`` whole steps are timed after them."""
    progress_log.info("profiling: timing nodes in %d warm passes%s", repeats,
                      " (the first the memory pass)" if first_pass is not None and device.type != "cuda" else "")
    if device.type == "cuda":
        node_times = time_nodes_on_cuda(gm, flat, repeats, split_nodes=split, step=step)
        step_times = _step_times_ms(gm, inputs, step_timer(device), step_repeats, step)
    else:
        node_times = time_nodes_in_passes(gm, flat, repeats, step_timer(device), split_nodes=split, warm_up=False,
                                          step=step, first_pass=first_pass)
        step_times = list(node_times.step_totals_ms)
    return node_times, step_times


def _with_measurements(nodes: tuple[CostNode, ...], signatures: dict[str, Any], timings: NodeTimes,
                       peaks: NodePeaks) -> tuple[CostNode, ...]:
    """``nodes`` with their measured times (twin ops pooled, :func:`pool_repeated_op_times`)
    and the peaks of their forward and backward."""
    records = {name: {"signature": signatures[name], "time_ms": time_ms,
                      "after_last_save_time_fraction": timings.after_last_save_share.get(name)}
               for name, time_ms in timings.time_ms.items()}
    pooled = pool_repeated_op_times(records)
    log.debug("profiling: %d nodes share their time with a twin op (median)", pooled)
    measured: list[CostNode] = []
    for node in nodes:
        if node.kind == "compute":
            rec = records.get(node.name, {})
            node = dataclasses.replace(
                node, time_ms=rec.get("time_ms", node.time_ms),
                after_last_save_time_fraction=rec.get("after_last_save_time_fraction"),
                forward_peak_bytes=peaks.forward.get(node.name, 0),
                backward_peak_bytes=peaks.backward.get(node.name, 0))
        measured.append(node)
    return tuple(measured)


def _warn_if_noisy(timing: dict[str, Any]) -> None:
    """One warning when the node passes or the whole steps were timed on a machine too busy for
    their medians to be trusted: recompute costs, and so plans, may then change between runs."""
    spread = max(timing["timing_spread"], timing["step_time_spread"])
    if spread > TIMING_SPREAD_LIMIT:
        log.warning("timings varied by %.0f%% between passes (%d node passes, the step by %.0f%%): the machine is "
                    "busy, so recompute costs and the plan may change between runs; profile on a quiet machine "
                    "or raise timing_repeats", 100 * timing["timing_spread"], timing["timing_passes"],
                    100 * timing["step_time_spread"])


def _step_times_ms(gm: torch.fx.GraphModule, inputs: StepInputs, timer: Timer, repeats: int,
                   step: TrainingStep) -> list[float]:
    """Times of ``repeats`` training steps of ``gm`` after an untimed one, gradients cleared
    before each (as a loop calling ``zero_grad(set_to_none=True)`` does), and more, up to
    :data:`MAX_TIMING_PASSES`, while they spread by more than :data:`TIMING_SPREAD_LIMIT`, as
    the node passes do; the model's RNG state, buffers and ``.grad`` are restored afterwards."""
    times_ms: list[float] = []
    repeats = max(1, repeats)
    with preserved_state(gm):
        warm_up = True
        while warm_up or len(times_ms) < repeats or (len(times_ms) < MAX_TIMING_PASSES
                                                     and pass_spread(times_ms) > TIMING_SPREAD_LIMIT):
            for p in gm.parameters():
                p.grad = None
            elapsed_ms = timer(lambda: run_step(gm, inputs, step))
            if not warm_up:
                times_ms.append(elapsed_ms)
            warm_up = False
    return times_ms


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes a checkpointed segment keeps to replay random ops: the saved RNG state(s)."""
    size = torch.get_rng_state().nbytes
    if device.type == "cuda":
        size += torch.cuda.get_rng_state(device).nbytes
    return int(size)
