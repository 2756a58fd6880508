"""Time every node of a graph the way a training step runs it: in whole warm passes.

Timing a node alone, or in the first run of a process, measures the allocator as much as the
op: on CPU a fresh output buffer costs page faults that a warm training step does not pay. On
a GPT-2 at width 256 the per-node times of a first run summed to 2.2x the warm forward (a
``pow`` on 8 MiB: 23 ms alone, 0.5 ms in a warm pass), which made pointwise ops look too
expensive to recompute. So the graph is run as a step (forward node by node under an
``Interpreter`` that frees values after their last use, then backward) after one untimed
warm-up step, and each node gets the median of its times over the timed passes.

For the nodes named in ``split_nodes`` the passes also time the share of the node that runs
after autograd saved its last tensor for backward (where a checkpoint recompute stops, see
``planner.core.rerun``): CPU attention saves its softmax before its last matmul, half its FLOPs but
a smaller share of its time, since the softmax, mask and dropout over the scores are slow.

Example:
    >>> import torch
    >>> from profiling.trace import trace_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> x = torch.randn(4, 8)
    >>> gm = trace_module(model, (x,))
    >>> times = time_nodes_in_passes(gm, [x], repeats=2, timer=cpu_timer, split_nodes={"relu"})
    >>> times.time_ms["relu"] > 0, 0.0 <= times.after_last_save_share["relu"] <= 1.0
    (True, True)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx

from profiling.measure import TrainingStep, preserved_state, unflatten_output

__all__ = ["NodeTimes", "TimedPass", "Timer", "cpu_timer", "time_nodes_in_passes", "time_nodes_on_cuda", "pass_spread",
           "TIMING_SPREAD_LIMIT", "MAX_TIMING_PASSES"]

#: Relative spread of the timed passes' forward times ((slowest - fastest) / median) above which
#: node times count as noisy: more passes are timed, and a spread still above it is reported.
TIMING_SPREAD_LIMIT = 0.25
#: Timed passes at most, when the passes' spread stays above :data:`TIMING_SPREAD_LIMIT`.
MAX_TIMING_PASSES = 9

#: Runs a callable once and returns how long it took, in milliseconds.
Timer = Callable[[Callable[[], Any]], float]


def cpu_timer(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn()`` in ms (``time.perf_counter``)."""
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


@dataclasses.dataclass(frozen=True)
class NodeTimes:
    """Median forward time of every node, in ms, and for the nodes asked for, the median share
    of that time spent after the node's last save for backward (0 to 1); ``passes`` timed
    passes whose forward times spread by ``spread`` (:func:`pass_spread`), and on CPU each
    pass's step time."""

    time_ms: dict[str, float]
    after_last_save_share: dict[str, float]
    passes: int = 0
    spread: float = 0.0
    #: each timed pass's whole step: its node times summed plus its backward's wall time
    step_totals_ms: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class TimedPass:
    """One training step timed node by node outside :func:`time_nodes_in_passes` (the step
    the memory profiler measures, :func:`profiling.temporaries.measure_node_peaks`): each
    node's forward wall time and the backward's, in ms. Names of nodes that pass does not time
    (placeholders, the output, a criterion outside the graph) may be among them."""

    node_times_ms: dict[str, float]
    backward_ms: float
    #: each node that saved a tensor for backward: the share of its time after its last save
    #: (:func:`after_last_save_shares`); empty where that pass did not note them
    after_last_save_share: dict[str, float] = dataclasses.field(default_factory=dict)


def pass_spread(totals_ms: list[float]) -> float:
    """``(slowest - fastest) / median`` of some timings, 0 for steady ones; from three timings
    on the slowest is left out, and from five the fastest too, so a single hiccup of the
    machine (which makes a step slower, never faster) does not count as noise of the whole
    and one more pass settles it (docs/tuning.md#timing_spread_limit).

    Example:
        >>> pass_spread([10.0, 12.0])
        0.18181818181818182
        >>> pass_spread([10.0, 10.5, 14.0]), pass_spread([10.0, 10.0, 10.0, 10.0, 30.0])
        (0.04878048780487805, 0.0)
    """
    values = sorted(totals_ms)
    if len(values) < 2:
        return 0.0
    if len(values) >= 3:
        values = values[1:-1] if len(values) >= 5 else values[:-1]
    median = statistics.median(values)
    return (values[-1] - values[0]) / median if median > 0 else 0.0


def _pass_totals(times_ms: dict[str, list[float]]) -> list[float]:
    """Each timed pass's forward time: the sum of its node times (every node runs once a pass)."""
    passes = min((len(v) for v in times_ms.values()), default=0)
    return [sum(v[k] for v in times_ms.values()) for k in range(passes)]


def _step_totals(times_ms: dict[str, list[float]], backward_ms: list[float]) -> list[float]:
    """Each timed pass's step time: its forward (:func:`_pass_totals`) plus its backward."""
    return [forward + backward for forward, backward in zip(_pass_totals(times_ms), backward_ms)]


def _slow_early_pass(step_totals_ms: list[float]) -> int | None:
    """The index of the slowest of some timed steps when it is one of the first two, else None:
    the first steps timed after profiling (or a memory pass run before it) can be the slowest
    by far, which a later pass cannot be for the same reason.

    Example:
        >>> _slow_early_pass([450.0, 300.0, 310.0]), _slow_early_pass([300.0, 450.0, 310.0])
        (0, 1)
        >>> _slow_early_pass([300.0, 310.0, 450.0]), _slow_early_pass([300.0])
        (None, None)
    """
    if len(step_totals_ms) < 2:
        return None
    slowest = step_totals_ms.index(max(step_totals_ms))
    return slowest if slowest < 2 else None


def _drop_pass(times_ms: dict[str, list[float]], shares: dict[str, list[float]], backward_ms: list[float],
               index: int) -> None:
    """Forget the timed pass at ``index``: its node times, its backward and, where it timed
    them, its shares (the first pass has none when it came from elsewhere, :class:`TimedPass`)."""
    passes = len(backward_ms)
    for values in times_ms.values():
        del values[index]
    for values in shares.values():
        offset = passes - len(values)  # passes that timed no shares come first
        if index >= offset:
            del values[index - offset]
    del backward_ms[index]


def _share(start: float, last_save: float, end: float) -> float:
    return min(1.0, max(0.0, (end - last_save) / (end - start))) if end > start else 0.0


def after_last_save_shares(marks: dict[str, list[float]]) -> dict[str, float]:
    """Per node, the share of its wall time after autograd's last save while it ran, from its
    marks ``[start, end]`` or ``[start, end, last save]`` (seconds on one clock); nodes that saved
    nothing get none.

    Example:
        >>> after_last_save_shares({"attention": [0.0, 4.0, 3.0], "view": [4.0, 4.5]})
        {'attention': 0.25}
    """
    return {name: _share(m[0], m[2], m[1]) for name, m in marks.items() if len(m) > 2}


class _NodeTimer(torch.fx.Interpreter):
    """An interpreter that adds each node's time to ``times_ms`` and, for ``split_nodes``, the
    share after its last save to ``shares``; values are freed after their last use, as in the
    module's own forward."""

    def __init__(self, gm: torch.fx.GraphModule, timer: Timer, times_ms: dict[str, list[float]] | None,
                 split_nodes: Collection[str] = (), shares: dict[str, list[float]] | None = None) -> None:
        super().__init__(gm)
        self.timer = timer
        self.times_ms = times_ms
        self.split_nodes = split_nodes
        self.shares = shares

    def run_node(self, n: torch.fx.Node) -> Any:
        result: Any = None
        marks: list[float] = []

        def run() -> None:
            nonlocal result
            marks.append(time.perf_counter())
            result = super(_NodeTimer, self).run_node(n)
            marks.append(time.perf_counter())

        if self.times_ms is None or n.op in ("placeholder", "output"):
            run()
        elif self.shares is not None and n.name in self.split_nodes:
            saves: list[float] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saves.append(time.perf_counter())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self.times_ms.setdefault(n.name, []).append(self.timer(run))
            if saves:
                self.shares.setdefault(n.name, []).append(_share(marks[0], saves[-1], marks[-1]))
        else:
            self.times_ms.setdefault(n.name, []).append(self.timer(run))
        return result


def _medians(values: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in values.items() if v}


def time_nodes_in_passes(gm: torch.fx.GraphModule, flat_inputs: list[Any], repeats: int,
                         timer: Timer, split_nodes: Collection[str] = (), warm_up: bool = True,
                         step: TrainingStep = TrainingStep(), first_pass: TimedPass | None = None) -> NodeTimes:
    """Median forward time (ms) of every node of ``gm`` over ``repeats`` warm training steps on
    CPU, and of each of ``split_nodes`` the share after its last save (wall clock at the last
    pack of a saved tensor; a node that saves nothing gets none).

    ``flat_inputs`` are the graph's placeholders in order; ``timer`` measures one call
    (:func:`cpu_timer`); it also times each pass's backward as a whole, so the passes give the
    step's time too (``NodeTimes.step_totals_ms``). One untimed step runs first unless
    ``warm_up`` is False (the caller has just run a step of ``gm`` itself). While the timed
    passes' forward or step times spread by more than :data:`TIMING_SPREAD_LIMIT` (a busy
    machine), more passes are timed, up to :data:`MAX_TIMING_PASSES`, so the medians do not
    follow the noise; the first time that happens with one of the first two passes the slowest,
    that pass is dropped and one more timed instead. RNG state, buffers and ``.grad`` of ``gm`` are restored afterwards.

    ``first_pass``: a step of ``gm`` already timed node by node (the memory profiler's), counted
    as the first of the ``repeats`` passes, shares and all where it noted every one of
    ``split_nodes`` (else one pass at least is timed here for them); a pass that misses a node
    this one times is not counted.
    """
    times_ms: dict[str, list[float]] = {}
    shares: dict[str, list[float]] = {}
    backward_ms: list[float] = []
    repeats = max(1, repeats)
    passes = 0
    timed = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if first_pass is not None and all(name in first_pass.node_times_ms for name in timed):
        times_ms = {name: [first_pass.node_times_ms[name]] for name in timed}
        backward_ms.append(first_pass.backward_ms)
        passes = 1
        if all(name in first_pass.after_last_save_share for name in split_nodes):
            shares = {name: [first_pass.after_last_save_share[name]] for name in split_nodes}
    # the pass timed elsewhere, while it is kept, where it timed no shares
    borrowed = passes if split_nodes and not shares else 0

    def spread() -> float:
        return max(pass_spread(_pass_totals(times_ms)), pass_spread(_step_totals(times_ms, backward_ms)))

    with preserved_state(gm):
        dropped = False
        # where the borrowed pass timed no shares, at least one pass of its own is kept
        while (warm_up or passes < repeats or (borrowed and passes == borrowed)
               or (passes < MAX_TIMING_PASSES and spread() > TIMING_SPREAD_LIMIT)):
            slow = _slow_early_pass(_step_totals(times_ms, backward_ms)) if passes >= max(2, repeats) else None
            if not dropped and slow is not None:
                # the first steps timed after profiling are often the slowest by far (docs/tuning.md,
                # MAX_TIMING_PASSES): the slowest of them dropped once and one more timed, rather than more passes
                _drop_pass(times_ms, shares, backward_ms, slow)
                passes -= 1
                borrowed = 0 if slow == 0 else borrowed
                dropped = True
                continue
            interpreter = _NodeTimer(gm, timer, None if warm_up else times_ms, split_nodes, shares)
            flat_out = interpreter.run(*flat_inputs, enable_io_processing=False)
            loss = step.loss(unflatten_output(gm, flat_out))
            if not step.output_held:
                del flat_out
                flat_out = None
            if warm_up:
                loss.backward()
            else:
                backward_ms.append(timer(loss.backward))
            del loss, flat_out
            for p in gm.parameters():
                p.grad = None
            passes += not warm_up
            warm_up = False
    totals = _pass_totals(times_ms)
    return NodeTimes(_medians(times_ms), _medians(shares), len(totals), pass_spread(totals),
                     tuple(_step_totals(times_ms, backward_ms)))


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _EventRecorder(torch.fx.Interpreter):
    """An interpreter that records a CUDA event before and after each node, without waiting,
    and for ``split_nodes`` one when autograd saves each tensor for backward."""

    def __init__(self, gm: torch.fx.GraphModule, split_nodes: Collection[str] = ()) -> None:
        super().__init__(gm)
        self.split_nodes = split_nodes
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.last_saves: dict[str, torch.cuda.Event] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        saves: list[torch.cuda.Event] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saves.append(_timing_event())
            return t

        start = _timing_event()
        if n.name in self.split_nodes:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = super().run_node(n)
        else:
            result = super().run_node(n)
        end = _timing_event()
        self.events.append((n.name, start, end))
        if saves:
            self.last_saves[n.name] = saves[-1]
        return result


def _ms_per_sleep_cycle() -> float:
    """GPU milliseconds one cycle of ``torch.cuda._sleep`` takes on the current device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10**7
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end), 1e-3) / cycles


def time_nodes_on_cuda(gm: torch.fx.GraphModule, flat_inputs: list[Any], repeats: int,
                       max_hold_ms: float = 2000.0, split_nodes: Collection[str] = (),
                       step: TrainingStep = TrainingStep()) -> NodeTimes:
    """Median GPU time (ms) of every node of ``gm`` over ``repeats`` warm training steps.

    Running a graph node by node from Python launches kernels more slowly than a compiled
    module's forward, so a GPU timed per node (or one waiting on every launch) mostly measures
    launch gaps. Here the GPU is held by a spin kernel (``torch.cuda._sleep``) for longer than
    the forward takes to launch, so the whole forward is queued before it runs and each node's
    events time its kernels back to back. One untimed step runs first (and sizes the hold). RNG
    state, buffers and ``.grad`` of ``gm`` are restored afterwards. ``split_nodes`` get the GPU
    time share after their last save, as in :func:`time_nodes_in_passes`.
    """
    times_ms: dict[str, list[float]] = {}
    shares: dict[str, list[float]] = {}
    ms_per_cycle = _ms_per_sleep_cycle()
    launch_ms = max_hold_ms
    with preserved_state(gm):
        for timed in [False] + [True] * max(1, repeats):
            torch.cuda.synchronize()
            if timed:
                torch.cuda._sleep(int(min(max_hold_ms, 1.5 * launch_ms) / ms_per_cycle))
            recorder = _EventRecorder(gm, split_nodes)
            launched = time.perf_counter()
            flat_out = recorder.run(*flat_inputs, enable_io_processing=False)
            if not timed:
                launch_ms = (time.perf_counter() - launched) * 1e3
            loss = step.loss(unflatten_output(gm, flat_out))
            if not step.output_held:
                del flat_out
                flat_out = None
            loss.backward()
            del loss
            del flat_out
            torch.cuda.synchronize()
            for p in gm.parameters():
                p.grad = None
            if timed:
                for name, start, end in recorder.events:
                    times_ms.setdefault(name, []).append(start.elapsed_time(end))
                    if name in recorder.last_saves:
                        total_ms = start.elapsed_time(end)
                        after_ms = recorder.last_saves[name].elapsed_time(end)
                        shares.setdefault(name, []).append(_share(0.0, total_ms - after_ms, total_ms))
    totals = _pass_totals(times_ms)
    return NodeTimes(_medians(times_ms), _medians(shares), len(totals), pass_spread(totals))
