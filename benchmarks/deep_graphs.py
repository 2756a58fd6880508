"""Plan quality on deep graphs: predicted recompute of a single finer pass against the defaults.

GPT-2-style graphs of many layers (width 256, batch 4 x 128, as in ``benchmarks/solve_time.py``)
are captured with torch.export and profiled on fake tensors (compute times from the profiler's
roofline, no real memory used). At each budget, a fraction of the simulated unoptimized peak,
the planner solves with ``finer_rounds=1, short_segments=False`` (one ILP on about twice the
first stages) and with the defaults. The figures are the
planner's predictions (recompute time over the profiled step), not measurements: the 4-layer
quality models and ``benchmarks/finer_rounds.py`` measure plans at the allocator and the clock.

A second table plans 24-, 48- and 96-layer graphs at the simulated peaks of checkpointing
every layer and every 2nd layer (the hand-placed plans of
:mod:`planner.solvers.hand_policies`), with the defaults: the planner's recompute over that
plan's, and the solve's time.

    python benchmarks/deep_graphs.py [--layers 17 34 48 94] [--fractions 0.7 0.5 0.4]
                                     [--hand-placed-layers 24 48 96] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/deep_graphs.md``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from common import ROOT, add_docs_argument, benchmark_logging, publish_table
from models import gpt2

from planner import simulate
from planner.solvers.hand_policies import hand_placed_plans
from planner.solvers.solve import solve
from profiling import profile_graph, trace_module

log = logging.getLogger("deep_graphs")

DOC = {"name": "deep_graphs", "title": "Plan quality on deep graphs (predicted)", "about": """\
## How to read it

GPT-2-style graphs (HuggingFace `GPT2LMHeadModel`, width 256, batch 4 x 128) of 17 to 94
layers, captured with `torch.export` and profiled on fake tensors: op times from the roofline,
no memory allocated. Budgets are fractions of the simulated unoptimized peak. Each cell gives
the predicted recompute time as a share of the profiled step for two configurations of
`planner.solvers.solve.solve`: "single finer pass" is `finer_rounds=1, short_segments=False`
(one finer pass on about twice the first stages); the figure after the arrow is the defaults
(finer rounds, short-segment and finest starts, see
[How the planner decides](../design.md#how-the-planner-decides)). The figures are
predictions, not measurements; [finer_rounds.md](finer_rounds.md) measures the same
comparison at the allocator and the clock. "every peak within its budget" checks each plan's
simulated peak.

In the second table the budget is the simulated peak of checkpointing every layer (every 2nd
layer), each a candidate of every solve, so a plan is always found there and never costs
more; *planner / hand-placed* is the defaults' predicted recompute over that plan's.
"""}
ONE_PASS = {"finer_rounds": 1, "short_segments": False}


def _cell(percent_one_pass: float, percent_now: float) -> str:
    return f"{percent_one_pass:.1f} % -> {percent_now:.1f} %"


def run(layer_counts: list[int], fractions: list[float]) -> str:
    started = time.perf_counter()
    header = " | ".join(f"{f:.0%} of the peak" for f in fractions)
    lines = [
        "Predicted recompute time as a share of the profiled step, single finer pass -> defaults; "
        "solve times of the defaults.\n",
        f"| layers | compute nodes | {header} | solve (defaults) | every peak within its budget |",
        "|---|---|" + "---|" * len(fractions) + "---|---|",
    ]
    for layers in layer_counts:
        model, example = gpt2(batch=4, seq_len=128, layers=layers)
        graph = profile_graph(trace_module(model, example), example, fake=True)
        unoptimized = simulate(graph).peak_bytes
        cells, solve_times, within = [], [], True
        for fraction in fractions:
            budget = int(unoptimized * fraction)
            one_pass = solve(graph, budget, **ONE_PASS)
            t0 = time.perf_counter()
            now = solve(graph, budget)
            solve_times.append(time.perf_counter() - t0)
            within = within and all(p.predicted_peak_bytes <= budget for p in (one_pass, now))
            cells.append(_cell(100 * one_pass.recompute_ms / graph.step_ms, 100 * now.recompute_ms / graph.step_ms))
            log.info("%d layers at %.0f %%: %s", layers, 100 * fraction, cells[-1])
        lines.append(f"| {layers} | {len(graph.compute_nodes)} | {' | '.join(cells)} "
                     f"| {min(solve_times):.1f} to {max(solve_times):.1f} s | {'yes' if within else 'NO'} |")
    lines.append(f"\nWall time {(time.perf_counter() - started) / 60:.1f} min (capture, fake profile and both "
                 "solves).\n")
    return "\n".join(lines) + "\n"


HAND_PLACED_POLICIES = ("every layer", "every 2nd layer")


def run_hand_placed(layer_counts: list[int]) -> str:
    """The defaults at the hand-placed plans' simulated peaks on deep graphs."""
    started = time.perf_counter()
    lines = ["\n## At checkpoint-every-layer's and every-2nd-layer's peak\n",
             "| layers | compute nodes | hand-placed plan | its peak / unoptimized | planner / hand-placed "
             "| solve (s) | within the budget |",
             "|---|---|---|---|---|---|---|"]
    for layers in layer_counts:
        model, example = gpt2(batch=4, seq_len=128, layers=layers)
        graph = profile_graph(trace_module(model, example), example, fake=True)
        unoptimized = simulate(graph).peak_bytes
        plans = {plan.name: plan for plan in hand_placed_plans(graph)}
        for policy in HAND_PLACED_POLICIES:
            hand = plans[policy]
            budget = simulate(graph, hand.segments).peak_bytes
            t0 = time.perf_counter()
            plan = solve(graph, budget)
            solve_s = time.perf_counter() - t0
            lines.append(f"| {layers} | {len(graph.compute_nodes)} | {policy} | {budget / unoptimized:.3f} "
                         f"| {plan.recompute_ms / hand.recompute_ms:.3f} | {solve_s:.1f} "
                         f"| {'yes' if plan.predicted_peak_bytes <= budget else 'NO'} |")
            log.info("%d layers at %s's peak: %s", layers, policy, lines[-1])
    lines.append(f"\nWall time {(time.perf_counter() - started) / 60:.1f} min.\n")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[17, 34, 48, 94])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.7, 0.5, 0.4])
    parser.add_argument("--hand-placed-layers", type=int, nargs="*", default=[24, 48, 96])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    table = run(args.layers, args.fractions) + run_hand_placed(args.hand_placed_layers)
    publish_table(table, args.out, "deep_graphs.md", DOC if args.docs else None)


if __name__ == "__main__":
    main()
