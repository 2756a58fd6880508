"""Solve time of the planner on GPT-2-style graphs of about 1,000 and 5,000 nodes.

The graphs come from HuggingFace GPT-2 configs with many layers, captured with torch.export and
profiled on fake tensors (so no real memory is used); the solve is timed alone, at 50 % of the
unoptimized peak, without and with the op-level kept outputs (``selective=True``).

    python benchmarks/solve_time.py [--layers 15 72] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/solve_time.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import gpt2  # noqa: E402
from publish import publish_doc, tee_stdout  # noqa: E402

from planner import simulate, solve  # noqa: E402
from profiling import profile_graph, trace_module  # noqa: E402


#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

GPT-2-style graphs (HuggingFace `GPT2LMHeadModel`, width 256, batch 4 x 128) captured with
`torch.export` and profiled on fake tensors (roofline op times, nothing allocated), solved at
50 % of the simulated unoptimized peak with the defaults (the chain DP on every stage model):
"solve at 50 %" is `solve` alone, segments only; "solve, selective" the same with
`selective=True` (keep options in the stage model, then the keep search); "kept outputs" how
many nodes the selective plan keeps; the last column its predicted recompute over the
segments-only plan's (1.00: keeping pays nowhere, and the segments-only plan is returned).
"stages" is the first stage model's (`max_stages`); the finer rounds and the short-segment and
finest starts run on more. "predicted peak / budget" is the plan's simulated peak over the
budget. [solve_time_budgets.md](solve_time_budgets.md) times the same graphs across budgets.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[15, 72])
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--docs", action="store_true",
                        help="also write the table to docs/benchmarks/solve_time.md (with this command line and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tee_stdout() as printed:
        table(args.layers, args.fraction)
    if args.docs:
        publish_doc(printed.getvalue(), "solve_time", sys.argv, title="Solve time at half the peak", about=DOC_ABOUT)


def table(layer_counts: list[int], fraction: float) -> None:
    """Print the table, a row per graph as it is solved."""
    print("| layers | graph nodes | capture + fake profile | solve at 50 % | stages | segments | predicted peak / budget "
          "| solve, selective | kept outputs | predicted recompute, selective / segments only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layers in layer_counts:
        model, example = gpt2(batch=4, seq_len=128, layers=layers)
        t0 = time.perf_counter()
        graph = profile_graph(trace_module(model, example), example, fake=True)
        prepared_s = time.perf_counter() - t0
        budget = int(simulate(graph).peak_bytes * fraction)
        t0 = time.perf_counter()
        plan = solve(graph, budget)
        solve_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        kept = solve(graph, budget, selective=True)
        selective_s = time.perf_counter() - t0
        print(f"| {layers} | {len(graph.nodes)} | {prepared_s:.1f} s | {solve_s:.1f} s | 32 | {len(plan.segments)} "
              f"| {plan.predicted_peak_bytes / budget:.3f} | {selective_s:.1f} s "
              f"| {sum(len(s.kept_nodes) for s in kept.segments)} | {kept.recompute_ms / plan.recompute_ms:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
