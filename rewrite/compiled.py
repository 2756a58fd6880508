"""Run a rewritten graph under ``torch.compile`` with its plan honoured inside one graph.

:func:`apply_plan` calls each segment through ``checkpointed_call``, which ``torch.compiler``
skips: compiled, every segment is a graph break and runs eagerly. :func:`traceable_segments`
points those calls at :func:`checkpointed_traceable` instead, the same non-reentrant
``torch.utils.checkpoint`` without the skip, so Dynamo traces each segment as its
activation-checkpoint higher-order op and AOTAutograd's partitioner recomputes exactly the
segment's ops in the backward (the checkpoint region's ops reach it tagged for recompute).
The whole step is one graph; Inductor's random ops draw the same numbers as in the compiled
model without the plan.

:func:`compile_step` compiles such a graph and runs one warm training step, counting the
graph breaks Dynamo reports (``torch._dynamo.utils.counters``) and timing the compile;
:func:`compiled_step_peak_bytes` measures the compiled step's peak at the allocator after it.
A compiled step's peak is not the eager one's (fused kernels save other tensors), so
``optimize(compile=True)`` checks each plan on that measurement (:mod:`planner.closed_loop`).

Example:
    >>> import torch
    >>> from planner.core.plan import Plan, Segment
    >>> from profiling.measure import StepInputs
    >>> from profiling.trace import trace_module
    >>> from rewrite.segments import apply_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    >>> gm = trace_module(model, (torch.randn(2, 4),))
    >>> names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    >>> plan = Plan(0, 0, 0, (Segment(tuple(names[:2]), 0.0, 0),), 0.0, 0.0, 0, "none", 0.0)
    >>> run = compile_step(apply_plan(gm, plan), StepInputs.from_example((torch.randn(2, 4),)),
    ...                    backend="aot_eager")
    >>> run.graph_breaks
    0
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.core.errors import InputError, PlannerError
from planner.core.options import COMPILE_BACKEND
from profiling.interpreter import step_timer
from profiling.measure import StepInputs, TrainingStep, device_of, measure_step_peak_bytes, preserved_state, run_step
from planner.core.matmul_ops import segment_saved_ops
from rewrite.compile_backend import uncached_backend
from rewrite.loss_split import LossSplitStep, loss_tail
from rewrite.segments import CheckpointedSegment, _enter_kept_node, _leave_kept_node, checkpointed_call

__all__ = [
    "COMPILE_BACKEND",
    "CompiledStep",
    "check_compile_available",
    "checkpointed_traceable",
    "MatmulsKeptSegment",
    "matmuls_kept_segment",
    "compile_step",
    "compiled_runner",
    "compiled_step_peak_bytes",
    "compiled_step_times_ms",
    "paired_ratio",
    "COMPILED_TIMING_ROUNDS",
    "graph_break_count",
    "traceable_segments",
]

log = logging.getLogger(__name__)

#: Interleaved rounds :func:`compiled_step_times_ms` times each compiled step in
#: (docs/tuning.md#compiled_timing_rounds).
COMPILED_TIMING_ROUNDS = 9

#: ``gm.meta`` key of the :class:`CompiledStep` a graph module was compiled into.
COMPILED_STEP = "checkpoint_planner_compiled_step"


def check_compile_available() -> None:
    """Raise :class:`InputError` (one line) where ``torch.compile`` cannot run here.

    Example:
        >>> check_compile_available()   # torch.compile runs on this platform
    """
    compile_fn = getattr(torch, "compile", None)
    dynamo = getattr(torch, "_dynamo", None)
    if compile_fn is None or dynamo is None:
        raise InputError(f"compile=True needs torch.compile, which torch {torch.__version__} does not have; "
                         f"upgrade torch or pass compile=False")
    if not dynamo.is_dynamo_supported():
        raise InputError(f"compile=True needs torch.compile, which is not supported on this platform "
                         f"(torch {torch.__version__}); pass compile=False")


class MatmulsKeptSegment:
    """A segment that keeps matmul-like outputs (the save-matmuls policy,
    :data:`planner.core.matmul_ops.SAVED_MATMUL_OPS`), in a form Dynamo traces: its graph
    without the eager policy's markers, and a policy that decides by operator, saving
    ``saved_ops`` (which AOTAutograd's partitioner receives as ``MUST_SAVE`` /
    ``PREFER_RECOMPUTE`` tags)."""

    def __init__(self, graph_module: torch.fx.GraphModule, saved_ops: frozenset[str]) -> None:
        self.graph_module = graph_module
        self.saved_ops = saved_ops
        # plain partials, not bound methods: Dynamo calls the context function while tracing
        self.context = functools.partial(create_selective_checkpoint_contexts,
                                         functools.partial(_save_by_operator, saved_ops))


def _save_by_operator(saved_ops: frozenset[str], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if str(op) in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE


def matmuls_kept_segment(segment: CheckpointedSegment) -> MatmulsKeptSegment | None:
    """``segment`` as a :class:`MatmulsKeptSegment` where it keeps only matmul-like outputs
    whose operators it never recomputes
    (:func:`planner.core.matmul_ops.segment_saved_ops`), else None: a policy by
    operator would keep other outputs than the plan."""
    nodes = list(segment.graph_module.graph.nodes)
    ops = {n.name: str(n.target) for n in nodes if n.op == "call_function"}
    saved = segment_saved_ops(ops, segment.kept_nodes)
    if saved is None:
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes[1:]:  # the first placeholder is the segment the eager markers set
        if node.op == "call_function" and node.target in (_enter_kept_node, _leave_kept_node):
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
    return MatmulsKeptSegment(torch.fx.GraphModule(segment.graph_module, graph), saved)


class OutputsKeptSegment:
    """A whole segment whose outputs the compiled step keeps from the forward, as the eager
    step does (the segment's output is held by what reads it): the ops that make them are
    ``MUST_SAVE``, every other op ``PREFER_RECOMPUTE``. Without it, AOTAutograd's partitioner
    may recompute a pointwise op after the segment (a residual add) from the segment's
    recomputed output, which pulls the segment's recompute ahead of the backward that comes
    before it."""

    def __init__(self, graph_module: torch.fx.GraphModule, kept_calls: dict[str, frozenset[int]]) -> None:
        self.graph_module = graph_module
        self.kept_calls = kept_calls
        self.context = functools.partial(_outputs_kept_contexts, kept_calls)


def _outputs_kept_contexts(kept_calls: dict[str, frozenset[int]]) -> Any:
    """A checkpoint's pair of contexts whose policy saves the ``kept_calls`` (operator -> which
    of its calls, counted from 0 in the forward and again in a recompute)."""
    calls: dict[tuple[bool, str], int] = {}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(op)
        index = calls.get((ctx.is_recompute, name), 0)
        calls[(ctx.is_recompute, name)] = index + 1
        return CheckpointPolicy.MUST_SAVE if index in kept_calls.get(name, ()) else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _view_base(node: torch.fx.Node) -> torch.fx.Node:
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
           and node.args and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def outputs_kept_segment(segment: CheckpointedSegment) -> OutputsKeptSegment | None:
    """``segment`` (one with nothing kept) as an :class:`OutputsKeptSegment`, each output's op
    named by operator and how many calls of it come before; None where an output is no op's."""
    nodes = [n for n in segment.graph_module.graph.nodes if n.op == "call_function"]
    output = next(n for n in segment.graph_module.graph.nodes if n.op == "output")
    kept: dict[str, set[int]] = {}
    for leaf in torch.utils._pytree.tree_leaves(output.args):
        if not isinstance(leaf, torch.fx.Node):
            continue
        base = _view_base(leaf)
        if base.op != "call_function":
            return None
        name = str(base.target)
        kept.setdefault(name, set()).add(sum(1 for n in nodes[:nodes.index(base)] if str(n.target) == name))
    return OutputsKeptSegment(segment.graph_module, {name: frozenset(v) for name, v in kept.items()})


def checkpointed_traceable(segment: CheckpointedSegment | MatmulsKeptSegment | OutputsKeptSegment, *args: Any) -> Any:
    """``segment`` under non-reentrant checkpoint, traceable by Dynamo (no ``compiler.disable``):
    compiled, its ops are recomputed in the backward inside the one graph, except the outputs a
    :class:`MatmulsKeptSegment` keeps."""
    if not torch.is_grad_enabled():
        return segment.graph_module(*args)
    policy = {"context_fn": segment.context} if isinstance(segment, (MatmulsKeptSegment, OutputsKeptSegment)) else {}
    return torch.utils.checkpoint.checkpoint(segment.graph_module, *args, use_reentrant=False,
                                             preserve_rng_state=True, **policy)


def traceable_segments(gm: torch.fx.GraphModule, keep_outputs: bool = True) -> torch.fx.GraphModule:
    """Point ``gm``'s checkpointed segment calls at :func:`checkpointed_traceable`, in place;
    returns ``gm``. A segment that keeps matmul outputs runs under a policy by operator where
    one can keep them (:class:`MatmulsKeptSegment`); one that keeps other outputs raises
    :class:`PlannerError`: its policy reads markers the graph sets as it runs, which a compiled
    graph does not run. A whole segment keeps the ops that make its outputs
    (:class:`OutputsKeptSegment`) unless ``keep_outputs`` is False (plain checkpoint tags)."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is checkpointed_call:
            attr = str(node.args[0].target)
            segment = getattr(gm, attr)
            if segment.kept_nodes:
                kept_by_op = matmuls_kept_segment(segment)
                if kept_by_op is None:
                    raise PlannerError(f"segment {attr} keeps outputs under a selective policy, which "
                                       f"compile=True does not trace; plan with selective=False")
                setattr(gm, attr, kept_by_op)
            elif keep_outputs and (outputs_kept := outputs_kept_segment(segment)) is not None:
                setattr(gm, attr, outputs_kept)
            node.target = checkpointed_traceable
            changed += 1
    if changed:
        gm.recompile()
    return gm


def graph_break_count() -> int:
    """Graph breaks Dynamo has counted in this process so far (all reasons)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


@dataclass
class CompiledStep:
    """A graph module compiled for training: the compiled module, the graph breaks counted while
    compiling its first step, that step's wall time in seconds (compile included), and whether
    the step compiled as two graphs, split before its loss (:mod:`rewrite.loss_split`)."""

    module: torch.nn.Module
    graph_breaks: int
    compile_s: float
    split_before_loss: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of the graph module compiles its own on first use

    def __reduce__(self) -> Any:
        return (type(None), ())


def compile_step(gm: torch.fx.GraphModule, inputs: StepInputs, step: TrainingStep = TrainingStep(), *,
                 backend: str = COMPILE_BACKEND, keep_outputs: bool = True) -> CompiledStep:
    """``gm`` (its segments made traceable, :func:`traceable_segments` with ``keep_outputs``) under
    ``torch.compile(backend=backend)``, compiled by one training step run on ``inputs`` (RNG,
    buffers and ``.grad`` restored after), and kept in ``gm.meta`` for :func:`compiled_runner`.
    Where the graph computes the loss ``step`` takes beside other outputs, it compiles as two
    graphs run in a row, split before the loss (:class:`rewrite.loss_split.LossSplitStep`): no
    graph break."""
    check_compile_available()
    traceable_segments(gm, keep_outputs)
    compiled, split = _compiled(gm, backend, step)
    breaks_before = graph_break_count()
    started = time.perf_counter()
    with preserved_state(gm):
        output = run_step(compiled, inputs, step)
        del output
    run = CompiledStep(compiled, graph_break_count() - breaks_before, time.perf_counter() - started, split)
    log.info("compiled the planned step (%s): %d graph breaks%s, %.1f s", backend, run.graph_breaks,
             ", split before its loss" if split else "", run.compile_s)
    gm.meta[COMPILED_STEP] = run
    return run


def _compiled(gm: torch.fx.GraphModule, backend: str, step: TrainingStep) -> tuple[torch.nn.Module, bool]:
    """``gm`` under ``torch.compile``: as two graphs, split before its loss, where
    :func:`rewrite.loss_split.loss_tail` finds ops only the loss needs; and whether it split."""
    tail = loss_tail(gm, step)
    compiler = uncached_backend(backend)  # a warm AOTAutograd cache can rebuild outputs wrongly
    if not tail:
        return torch.compile(gm, backend=compiler), False
    log.debug("compiled step split before its loss: %d ops in the loss's graph", len(tail))
    return LossSplitStep(gm, tail).compiled(compiler), True


def compiled_step_peak_bytes(gm: torch.fx.GraphModule, inputs: StepInputs, step: TrainingStep = TrainingStep(), *,
                             backend: str = COMPILE_BACKEND, keep_outputs: bool = True) -> tuple[CompiledStep, int]:
    """``gm`` compiled (:func:`compile_step`) and the peak bytes of its compiled training step,
    measured at the allocator after the compiling step (``measure_step_peak_bytes``)."""
    run = compile_step(gm, inputs, step, backend=backend, keep_outputs=keep_outputs)
    return run, measure_step_peak_bytes(run.module, inputs, step)


def compiled_runner(gm: torch.fx.GraphModule, backend: str = COMPILE_BACKEND,
                    step: TrainingStep = TrainingStep()) -> torch.nn.Module:
    """What runs ``gm`` compiled: the module :func:`compile_step` made for it, else ``gm``
    compiled now for ``step`` (its segments made traceable, split before its loss), kept in
    ``gm.meta``."""
    run = gm.meta.get(COMPILED_STEP)
    if run is None:
        traceable_segments(gm)
        module, split = _compiled(gm, backend, step)
        run = CompiledStep(module, 0, 0.0, split)
        gm.meta[COMPILED_STEP] = run
    return run.module


def compiled_step_times_ms(modules: Sequence[torch.fx.GraphModule], inputs: StepInputs,
                           step: TrainingStep = TrainingStep(), *, rounds: int = COMPILED_TIMING_ROUNDS
                           ) -> list[list[float]]:
    """Each module's compiled training step (:func:`compiled_runner`) timed once per round, in
    ``rounds`` interleaved rounds, each round starting at the next module (a step inherits its
    predecessor's freed memory and cold caches): per module, its milliseconds round by round.
    The modules share the user's parameters and buffers: ``.grad``, buffers and RNG are restored
    after, as for one measurement."""
    runners = [compiled_runner(m, step=step) for m in modules]
    timer = step_timer(device_of(modules[0], inputs))
    params = list(modules[0].parameters())
    times_ms: list[list[float]] = [[] for _ in runners]
    with preserved_state(modules[0]):
        for r in range(rounds):
            for k in range(len(runners)):
                i = (r + k) % len(runners)
                for p in params:
                    p.grad = None
                times_ms[i].append(timer(lambda i=i: run_step(runners[i], inputs, step)))
        for p in params:
            p.grad = None
    return times_ms


def paired_ratio(times_ms: Sequence[float], reference_ms: Sequence[float]) -> float:
    """The median over rounds of one step's time over another's in the same round: a slow
    phase of a shared machine slows both steps of a round alike, so the ratio moves less than
    either time (docs/tuning.md#compiled_timing_rounds).

    Example:
        >>> paired_ratio([9.0, 18.0, 10.0], [10.0, 20.0, 10.0])   # a slow second round hit both
        0.9
    """
    return statistics.median(t / r for t, r in zip(times_ms, reference_ms))
