"""What kept outputs save, measured: one selective plan run with and without its kept nodes.

Plans the quality benchmark's GPT-2 (width 256) with ``selective=True`` at a fraction of its
measured peak, then times three modules in one process (interleaved repeats, median ratio to
the unoptimized step): the unoptimized model, the plan's segments fully recomputed (its
``kept_nodes`` dropped) and the selective plan itself. The difference between the last two is
what keeping saved; the plan predicts it as the forward time of the kept nodes.

    python benchmarks/selective_cost.py [--fraction 0.5] [--repeats 7] [--docs]

``--docs`` also writes the result to ``docs/benchmarks/selective_cost.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile

import torch

from common import GIB, add_docs_argument, benchmark_logging, publish_doc, step_time_ratios, tee_stdout
from models import gpt2

from planner import optimize
from planner.solvers.keep import policy_ms, segment_with_kept
from profiling import StepInputs, measure_step_peak_bytes, trace_module
from rewrite.apply import CheckpointedModule, apply_plan

log = logging.getLogger("selective_cost")

#: how to read the result, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

The quality benchmark's GPT-2 (width 256, see [quality.md](quality.md)) planned with
`selective=True` at a fraction of its measured peak. Three modules are timed in one process,
interleaved, each as a median ratio to the unoptimized step: the unoptimized model, the
plan's segments fully recomputed (its kept nodes dropped), and the selective plan itself. The
difference between the last two is what keeping saved. The plan predicts it as the forward
time of the kept nodes, less the selective policy's own cost (its dispatch time on every node
of a segment that keeps anything, measured by `profiling/selective_overhead.py`).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the measured peak")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    model, example = gpt2()
    inputs = StepInputs.from_example(example)
    budget_gb = measure_step_peak_bytes(model, inputs) * args.fraction / GIB
    with tempfile.TemporaryDirectory(prefix="selective-cost-") as cache_dir:
        selective = optimize(model, example, budget_gb=budget_gb, selective=True, cache_dir=cache_dir)
    plan, graph = selective.plan, selective.cost_graph
    unkept = dataclasses.replace(plan, segments=tuple(segment_with_kept(graph, s.node_names, set())
                                                      for s in plan.segments))
    recomputed = CheckpointedModule(apply_plan(trace_module(model, example), unkept), model, unkept,
                                    cost_graph=graph, example_inputs=example)
    kept_ms = sum(graph.node(name).time_ms for s in plan.segments for name in s.kept_nodes)
    policy_cost_ms = sum(policy_ms(graph, s.node_names) for s in plan.segments if s.kept_nodes)
    ratios = step_time_ratios([model, recomputed, selective], inputs, args.repeats)
    with tee_stdout() as printed:
        print(f"GPT-2 width 256 at {args.fraction:.0%} of its peak: {len(plan.segments)} segments, "
              f"{sum(len(s.kept_nodes) for s in plan.segments)} kept nodes")
        print(f"predicted: segments fully recomputed +{unkept.overhead_ratio:.1%}, selective +{plan.overhead_ratio:.1%} "
              f"(kept nodes save {kept_ms / graph.step_ms:.1%} of the step, the selective policy costs "
              f"{policy_cost_ms / graph.step_ms:.1%})")
        print(f"measured:  segments fully recomputed {ratios[1]:.3f}x, selective {ratios[2]:.3f}x "
              f"(keeping saved {ratios[1] - ratios[2]:.1%} of the step)")
    if args.docs:
        publish_doc(f"```\n{printed.getvalue()}```\n", "selective_cost", sys.argv,
                    title="What kept outputs save, measured", about=DOC_ABOUT)

if __name__ == "__main__":
    main()
