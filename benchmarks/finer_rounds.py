"""Finer rounds on a deeper model: a single finer pass against the default, measured.

A 12-layer GPT-2 (width 256, 4 heads, vocab 4096, batch 8 x 256; about 550 compute nodes) is
profiled once. At each budget (a fraction of the measured unoptimized peak) the planner solves
with ``finer_rounds=1, short_segments=False`` (one ILP on about twice the first stages)
and with the defaults (:data:`planner.core.options.FINER_PASS_ROUNDS` rounds, and the
short-segments start), as ``optimize`` plans (1 % safety margin). Each plan is run: peak at the allocator, extra FLOPs (FlopCounterMode) and step time
as a ratio to the unoptimized step (interleaved repeats of all three modules, median, one
process).

    python benchmarks/finer_rounds.py [--layers 12] [--fractions 0.7 0.5 0.3] [--repeats 5] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/finer_rounds.md``. With ``--layers`` other
than 12 the table goes to ``finer_rounds_<layers>.md`` in both places (``--layers 24``: about
1,000 compute nodes, where short segments also start from more stages,
:func:`planner.solvers.solve.short_segment_shapes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
import time

import torch

from common import add_output_arguments, GIB, MIB, benchmark_logging, publish_table, step_time_ratios
from models import gpt2

from planner import optimize
from planner.core.costgraph import CostGraph, protect_reads_before_writes
from planner.core.plan import Plan
from planner.core.options import FINER_PASS_ROUNDS
from planner.solvers.solve import solve
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes, trace_module
from rewrite.apply import CheckpointedModule, apply_plan

log = logging.getLogger("finer_rounds")

#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

A GPT-2 (width 256, 4 heads, vocab 4096, batch 8 x 256) profiled once on this CPU. At each
budget, a fraction of the measured unoptimized peak, two plans as `optimize` makes them (1 %
safety margin): "one round" is `solve(..., finer_rounds=1, short_segments=False)`, a single
finer pass on about twice the first stages; "2 rounds, short segments (default)" is the
default solve (finer rounds, short-segment and finest starts, see
[How the planner decides](../design.md#how-the-planner-decides)). Each plan is run: measured
peak at the allocator, extra FLOPs (`FlopCounterMode`) over the unoptimized step, and step time
as a ratio to the unoptimized step (interleaved repeats of the three modules in one process,
median). "predicted overhead" is the plan's recompute time over the profiled step; "solve" the
wall time of `solve` alone.
"""


def doc_name(layers: int) -> str:
    """The table's file name, without ``.md`` (the 12-layer default has its own)."""
    return "finer_rounds" if layers == 12 else f"finer_rounds_{layers}"

SAFETY_MARGIN = 0.01


@dataclasses.dataclass
class Measured:
    plan: Plan
    module: torch.nn.Module
    solve_s: float
    peak_bytes: int
    extra_flops: int
    step_time: float = float("nan")


def planned(graph: CostGraph, budget_bytes: int, one_pass: bool) -> tuple[Plan, float]:
    """The plan ``optimize`` would make at ``budget_bytes`` (no reserve, one rank), with the
    single finer pass or the defaults, and its solve time."""
    started = time.perf_counter()
    options = {"finer_rounds": 1, "short_segments": False} if one_pass else {}
    plan = solve(protect_reads_before_writes(graph), int(budget_bytes * (1 - SAFETY_MARGIN)), **options)
    return dataclasses.replace(plan, budget_bytes=budget_bytes), time.perf_counter() - started


def run(layers: int, fractions: list[float], repeats: int) -> str:
    started = time.perf_counter()
    model, example = gpt2(layers=layers)
    inputs = StepInputs.from_example(example)
    base_peak = measure_step_peak_bytes(model, inputs)
    base_flops = measure_step_flops(model, inputs)
    with tempfile.TemporaryDirectory(prefix="finer-rounds-") as cache_dir:
        graph = optimize(model, example, budget_gb=4 * base_peak / GIB, cache_dir=cache_dir).cost_graph
    lines = [
        f"CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}, GPT-2 with {layers} layers "
        f"({len(graph.compute_nodes)} compute nodes), unoptimized peak {base_peak / MIB:.1f} MiB, "
        f"{repeats} interleaved timing repeats.\n",
        "| budget | finer passes | solve | segments | predicted overhead | measured peak | extra FLOPs | step time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fraction in fractions:
        budget = int(base_peak * fraction)
        rows: list[tuple[str, Measured]] = []
        for one_pass in (True, False):
            rounds = "one round" if one_pass else f"{FINER_PASS_ROUNDS} rounds, short segments (default)"
            plan, solve_s = planned(graph, budget, one_pass)
            module = CheckpointedModule(apply_plan(trace_module(model, example), plan), model, plan,
                                        cost_graph=graph, example_inputs=example)
            peak = measure_step_peak_bytes(module, inputs)
            if peak > budget:
                log.warning("%s at %.0f %%: measured peak %d over the budget %d", rounds, 100 * fraction,
                            peak, budget)
            rows.append((rounds, Measured(plan, module, solve_s, peak, measure_step_flops(module, inputs) - base_flops)))
        ratios = step_time_ratios([model, *(m.module for _, m in rows)], inputs, repeats)
        for (rounds, measured), ratio in zip(rows, ratios[1:]):
            measured.step_time = ratio
            lines.append(
                f"| {fraction:.0%} = {budget / MIB:.1f} MiB | {rounds} "
                f"| {measured.solve_s:.1f} s | {len(measured.plan.segments)} | +{measured.plan.overhead_ratio:.1%} "
                f"| {measured.peak_bytes / MIB:.1f} MiB | +{measured.extra_flops / base_flops:.1%} | {ratio:.2f}x |")
        log.info("%.0f %% done", 100 * fraction)
    lines.append(f"\nWall time {(time.perf_counter() - started) / 60:.1f} min. Predicted overhead: the plan's "
                 "recompute time over the profiled step.\n")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.7, 0.5, 0.3])
    parser.add_argument("--repeats", type=int, default=5)
    add_output_arguments(parser)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    text = run(args.layers, args.fractions, args.repeats)
    name = doc_name(args.layers)
    doc = {"name": name, "title": f"Finer rounds, measured on a {args.layers}-layer GPT-2", "about": DOC_ABOUT}
    publish_table(text, args.out, f"{name}.md", doc if args.docs else None)


if __name__ == "__main__":
    main()
