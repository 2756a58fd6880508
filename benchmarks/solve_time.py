"""Solve time of the planner on GPT-2-style graphs of about 1,000 and 5,000 nodes.

The graphs come from HuggingFace GPT-2 configs with many layers, captured with torch.export and
profiled on fake tensors (so no real memory is used); the solve is timed alone, at 50 % of the
unoptimized peak, without and with the op-level kept outputs (``selective=True``).

    python benchmarks/solve_time.py [--layers 15 72]
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

from planner import simulate, solve  # noqa: E402
from profiling import profile_graph, trace_module  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[15, 72])
    parser.add_argument("--fraction", type=float, default=0.5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print("| layers | graph nodes | capture + fake profile | solve at 50 % | stages | segments | predicted peak / budget "
          "| solve, selective | kept outputs | predicted recompute, selective / segments only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        model, example = gpt2(batch=4, seq_len=128, layers=layers)
        t0 = time.perf_counter()
        graph = profile_graph(trace_module(model, example), example, fake=True)
        prepared_s = time.perf_counter() - t0
        budget = int(simulate(graph).peak_bytes * args.fraction)
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
