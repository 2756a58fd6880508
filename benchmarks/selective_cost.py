"""What kept outputs save, measured: one selective plan run with and without its kept nodes.

Plans the quality benchmark's GPT-2 (width 256) with ``selective=True`` at a fraction of its
measured peak, then times three modules in one process (interleaved repeats, median ratio to
the unoptimized step): the unoptimized model, the plan's segments fully recomputed (its
``kept_nodes`` dropped) and the selective plan itself. The difference between the last two is
what keeping saved; the plan predicts it as the forward time of the kept nodes.

    python benchmarks/selective_cost.py [--fraction 0.5] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile

import torch

from common import GIB, benchmark_logging, step_time_ratios
from models import gpt2

from planner import optimize
from planner.keep import policy_ms, segment_with_kept
from profiling import StepInputs, measure_step_peak_bytes, trace_module
from rewrite.apply import CheckpointedModule, apply_plan

log = logging.getLogger("selective_cost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the measured peak")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
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
    print(f"GPT-2 width 256 at {args.fraction:.0%} of its peak: {len(plan.segments)} segments, "
          f"{sum(len(s.kept_nodes) for s in plan.segments)} kept nodes")
    print(f"predicted: segments fully recomputed +{unkept.overhead_ratio:.1%}, selective +{plan.overhead_ratio:.1%} "
          f"(kept nodes save {kept_ms / graph.step_ms:.1%} of the step, the selective policy costs "
          f"{policy_cost_ms / graph.step_ms:.1%})")
    print(f"measured:  segments fully recomputed {ratios[1]:.3f}x, selective {ratios[2]:.3f}x "
          f"(keeping saved {ratios[1] - ratios[2]:.1%} of the step)")


if __name__ == "__main__":
    main()
