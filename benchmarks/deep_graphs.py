"""Plan quality on deep graphs: predicted recompute of a single finer pass against the defaults.

GPT-2-style graphs of many layers (width 256, batch 4 x 128, as in ``benchmarks/solve_time.py``)
are captured with torch.export and profiled on fake tensors (compute times from the profiler's
roofline, no real memory used). At each budget, a fraction of the simulated unoptimized peak,
the planner solves with ``finer_rounds=1, short_segments=False`` (one ILP on about twice the
first stages) and with the defaults. The figures are the
planner's predictions (recompute time over the profiled step), not measurements: the 4-layer
quality models and ``benchmarks/finer_rounds.py`` measure plans at the allocator and the clock.

    python benchmarks/deep_graphs.py [--layers 17 34 48 94] [--fractions 0.7 0.5 0.4] [--docs]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[17, 34, 48, 94])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.7, 0.5, 0.4])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    publish_table(run(args.layers, args.fractions), args.out, "deep_graphs.md", DOC if args.docs else None)


if __name__ == "__main__":
    main()
