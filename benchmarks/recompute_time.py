"""Predicted against measured recompute time, segment by segment, inside a real backward.

For each model: ``optimize`` at a fraction of the measured unoptimized peak (segments only by
default), then training steps of the optimized module with every checkpointed segment's calls
timed (wall clock around each call of its graph: the forward call, and the recompute call that
non-reentrant checkpoint makes inside the backward, which stops early at the segment's last
save). Reported per segment: the median measured forward and recompute times against the
profile's (the summed node times, and ``Segment.recompute_ms``), then the totals and the
step-time ratio to the unoptimized model (interleaved repeats, median). CPU only.

    python benchmarks/recompute_time.py [--models gpt2 mlp] [--fraction 0.5] [--selective] [--repeats 7] [--docs]

``--docs`` also writes the tables to ``docs/benchmarks/recompute_time.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from common import GIB, add_docs_argument, benchmark_logging, publish_doc, tee_stdout
from planner import optimize
from profiling import StepInputs, measure_step_peak_bytes, run_step
from quality import MODELS
from rewrite.apply import CheckpointedSegment

#: how to read the tables, below them on their page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

Each model of the quality benchmark ([quality.md](quality.md)) planned at a fraction of its
measured unoptimized peak (segments only unless `--selective`), then trained for a few steps
with every checkpointed segment's calls timed by the wall clock: the forward call, and the
recompute that non-reentrant checkpoint makes inside the backward (which stops at the
segment's last saved tensor, see [Recompute cost](../design.md#recompute-cost)). Each segment's
median is set against the profile's prediction (its summed node times, and
`Segment.recompute_ms`, which includes each segment's own cost, `segment_overhead_ms`:
[tuning.md](../tuning.md#segment_overhead_ms)). The totals give the measured recompute against the predicted one, and
the step time as a ratio to the unoptimized model (interleaved repeats, median, one thread).
The step's extra time beyond the measured recompute is checkpoint's own cost (saving RNG
state, hooks, allocations) and noise.
"""

#: (segment, "forward" or "recompute", seconds) of every timed segment call
Calls = list[tuple[CheckpointedSegment, str, float]]


@contextlib.contextmanager
def timed_segments() -> Iterator[Calls]:
    """Time every call of every checkpointed segment while the block runs. A call made while
    autograd runs a backward is the recompute."""
    calls: Calls = []
    original = CheckpointedSegment.__call__

    def timed(self: CheckpointedSegment, *args: Any) -> Any:
        phase = "recompute" if torch._C._current_graph_task_id() >= 0 else "forward"
        started = time.perf_counter()
        try:
            return original(self, *args)
        finally:  # early stop ends the recompute with an exception inside checkpoint
            calls.append((self, phase, time.perf_counter() - started))

    CheckpointedSegment.__call__ = timed  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        CheckpointedSegment.__call__ = original  # type: ignore[method-assign]


def step_s(module: torch.nn.Module, inputs: StepInputs) -> float:
    module.zero_grad(set_to_none=True)
    started = time.perf_counter()
    output = run_step(module, inputs)
    elapsed = time.perf_counter() - started
    del output
    module.zero_grad(set_to_none=True)
    return elapsed


def run_model(name: str, fraction: float, selective: bool, repeats: int, cache_dir: str) -> str:
    model, example = MODELS[name][1]()
    inputs = StepInputs.from_example(example)
    budget_bytes = int(measure_step_peak_bytes(model, inputs) * fraction)
    opt = optimize(model, example, budget_gb=budget_bytes / GIB, selective=selective, cache_dir=cache_dir)
    plan, graph = opt.plan, opt.cost_graph
    for _ in range(2):
        step_s(model, inputs), step_s(opt, inputs)
    base_s, opt_s = [], []
    with timed_segments() as calls:
        for _ in range(repeats):
            base_s.append(step_s(model, inputs))
            opt_s.append(step_s(opt, inputs))
    # segment objects in the order of their first forward call, matched to the plan's segments
    order = list(dict.fromkeys(seg for seg, phase, _ in calls if phase == "forward"))
    lines = [f"### {name}: {fraction:.0%} of the unoptimized peak, {'selective' if selective else 'segments only'}",
             "", "| segment | nodes | forward measured | forward profile | recompute measured | recompute predicted | ratio |",
             "|---|---|---|---|---|---|---|"]
    measured_total = predicted_total = 0.0
    for seg_obj, seg in zip(order, plan.segments):
        forward_ms = statistics.median(t for s, p, t in calls if s is seg_obj and p == "forward") * 1e3
        rec = [t for s, p, t in calls if s is seg_obj and p == "recompute"]
        recompute_ms = statistics.median(rec) * 1e3 if rec else 0.0
        profile_ms = sum(graph.node(n).time_ms for n in seg.node_names)
        measured_total += recompute_ms
        predicted_total += seg.recompute_ms
        ratio = f"{recompute_ms / seg.recompute_ms:.2f}" if seg.recompute_ms > 0 else "-"
        lines.append(f"| `{seg.node_names[0]}` .. `{seg.node_names[-1]}` | {len(seg.node_names)} | "
                     f"{forward_ms:.1f} ms | {profile_ms:.1f} ms | {recompute_ms:.1f} ms | {seg.recompute_ms:.1f} ms | {ratio} |")
    ratio = statistics.median(o / b for o, b in zip(opt_s, base_s))
    base_ms = statistics.median(base_s) * 1e3
    lines += ["", f"Recompute: {measured_total:.1f} ms measured, {predicted_total:.1f} ms predicted "
              f"({measured_total / predicted_total:.2f}x). Step: {ratio:.3f}x the unoptimized "
              f"{base_ms:.0f} ms (measured recompute alone: +{measured_total / base_ms:.1%}; the plan "
              f"predicts +{plan.overhead_ratio:.1%} of the profile's {graph.step_ms:.0f} ms step).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=["gpt2", "mlp"])
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the unoptimized peak")
    parser.add_argument("--selective", action="store_true", help="plan with selective=True")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recompute-time-") as cache_dir:
        texts = [run_model(name, args.fraction, args.selective, args.repeats, cache_dir) for name in args.models]
    with tee_stdout() as printed:
        print(f"CPU, {args.threads} thread(s), torch {torch.__version__}, {args.repeats} interleaved repeats, "
              f"wall time {time.perf_counter() - started:.0f} s.\n")
        print("\n".join(texts))
    if args.docs:
        publish_doc(printed.getvalue(), "recompute_time", sys.argv, title="Recompute time, segment by segment",
                    about=DOC_ABOUT)


if __name__ == "__main__":
    main()
