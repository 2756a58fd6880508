"""Solve time across budgets: the default solve (the chain DP for segments-only stage
models) against the same solve with HiGHS on every stage model (the ILP path, the default
before the chain DP).

``benchmarks/solve_time.py`` times one budget (half the peak); solve time moves a lot with
the budget. This script solves GPT-2-style graphs at several budgets, twice each: with the
defaults (``solver=None``: :mod:`planner.solvers.chain_dp` for the first plan, the finer rounds and the
short-segment starts) and with ``solver="HiGHS"`` (every stage model through the MILP, its
node limits and 1 % gap), and reports both solve times, both plans' predicted recompute and
whether the plans are the same; and the default solve with ``selective=True`` (kept outputs,
op by op: the chain DP on the stage models with keep options, then the keep search), its time
and its predicted recompute.

Graphs: GPT-2 (width 256, batch 4 x 128) profiled on fake tensors (``--fake-layers``, roofline
times, as in ``solve_time.py``) and GPT-2 (width 256, batch 8 x 256, as in
``finer_rounds.py``) profiled on this CPU for real (``--real-layers``: measured node times,
which make harder ILPs than roofline times). Budgets are fractions of the simulated
unoptimized peak; solves run one at a time in one process, interleaved (default, HiGHS) per
budget.

    python benchmarks/solve_time_budgets.py [--fake-layers 17 94] [--real-layers 12 24]
        [--fractions 0.3 0.4 0.5 0.6 0.7 0.8] [--docs]

``--docs`` also writes the tables to ``docs/benchmarks/solve_time_budgets.md``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from common import add_output_arguments, benchmark_logging, publish_table
from models import gpt2

from planner import simulate, solve
from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import Plan
from profiling import profile_graph, trace_module

log = logging.getLogger("solve_time_budgets")

DOC = {"name": "solve_time_budgets", "title": "Solve time across budgets", "about": """\
## How to read it

Four GPT-2 graphs (width 256): 17 and 94 layers profiled on fake tensors (batch 4 x 128,
roofline op times, as in [solve_time.md](solve_time.md)), 12 and 24 layers profiled on this
CPU (batch 8 x 256, measured node times, as in [finer_rounds.md](finer_rounds.md)). Budgets are
fractions of the simulated unoptimized peak. Each budget is solved three times in one process,
one solve at a time:

- **solve**: the defaults (`solver=None`): the chain DP on every segments-only stage model;
- **solve, HiGHS**: `solver="HiGHS"`, every stage model as a MILP with its node limits and 1 %
  gap;
- **solve, selective**: the defaults with `selective=True` (the chain DP with keep options, then
  the keep search).

"same plan" compares the segments of the first two; "predicted recompute" is each plan's
recompute time as a share of the profiled step; "infeasible" means the budget is below the
smallest peak the planner finds, and the time is that of the refusal. The second table gives
the slowest solve and the upper median over the budgets of each graph. The speed bars: under
10 s at about 1,000 nodes and under 60 s at about 5,000. Single timings on a shared machine
move by 10 to 30 % from run to run.
"""}


def timed_solve(graph: CostGraph, budget_bytes: int, solver: str | None, selective: bool = False
                ) -> tuple[Plan | None, float]:
    """The plan at ``budget_bytes`` (None where the budget is infeasible) and its solve time."""
    started = time.perf_counter()
    try:
        plan: Plan | None = solve(graph, budget_bytes, solver=solver, selective=selective)
    except InfeasibleBudgetError:
        plan = None
    return plan, time.perf_counter() - started


def _same(a: Plan | None, b: Plan | None) -> str:
    if a is None or b is None:
        return "both infeasible" if a is b else "no"
    return "yes" if [s.node_names for s in a.segments] == [s.node_names for s in b.segments] else "no"


def _share(plan: Plan | None, graph: CostGraph) -> str:
    return "infeasible" if plan is None else f"{100 * plan.recompute_ms / graph.step_ms:.1f} %"


def graph_rows(label: str, graph: CostGraph, fractions: list[float]
               ) -> tuple[list[str], list[float], list[float], list[float]]:
    """The table rows of one graph, and its solve times by default, with HiGHS and selective."""
    unoptimized = simulate(graph).peak_bytes
    rows, default_s, highs_s, selective_s = [], [], [], []
    for fraction in fractions:
        budget = int(unoptimized * fraction)
        default, default_time = timed_solve(graph, budget, None)
        highs, highs_time = timed_solve(graph, budget, "HiGHS")
        selective, selective_time = timed_solve(graph, budget, None, selective=True)
        default_s.append(default_time)
        highs_s.append(highs_time)
        selective_s.append(selective_time)
        rows.append(f"| {label} | {len(graph.compute_nodes)} | {fraction:.0%} | {default_time:.1f} s "
                    f"| {highs_time:.1f} s | {_same(default, highs)} | {_share(default, graph)} "
                    f"| {_share(highs, graph)} | {selective_time:.1f} s | {_share(selective, graph)} |")
        log.info("%s at %.0f %%: %.1f s, %.1f s with HiGHS, %.1f s selective", label, 100 * fraction,
                 default_time, highs_time, selective_time)
    return rows, default_s, highs_s, selective_s


def run(fake_layers: list[int], real_layers: list[int], fractions: list[float]) -> str:
    started = time.perf_counter()
    graphs: list[tuple[str, CostGraph]] = []
    for layers in fake_layers:
        model, example = gpt2(batch=4, seq_len=128, layers=layers)
        graphs.append((f"{layers} layers, fake profile", profile_graph(trace_module(model, example), example,
                                                                       fake=True)))
    for layers in real_layers:
        model, example = gpt2(layers=layers)
        graphs.append((f"{layers} layers, CPU profile", profile_graph(trace_module(model, example), example)))
    lines = [
        f"Solve time at each budget (a fraction of the simulated unoptimized peak), this 2-core machine, "
        f"torch {torch.__version__}: the defaults (chain DP) against HiGHS on every stage model (the ILP "
        "path, the default before); whether both give the same plan; each plan's predicted recompute as a "
        "share of the step; and the default solve with `selective=True` (kept outputs).\n",
        "| graph | compute nodes | budget | solve | solve, HiGHS | same plan | predicted recompute "
        "| predicted recompute, HiGHS | solve, selective | predicted recompute, selective |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = ["", "| graph | compute nodes | slowest solve | slowest, HiGHS | slowest, selective | upper median "
               "| upper median, HiGHS | upper median, selective |", "|---|---|---|---|---|---|---|---|"]

    def upper_median(times: list[float]) -> str:
        return f"{sorted(times)[len(times) // 2]:.1f} s"

    for label, graph in graphs:
        rows, default_s, highs_s, selective_s = graph_rows(label, graph, fractions)
        lines += rows
        summary.append(f"| {label} | {len(graph.compute_nodes)} | {max(default_s):.1f} s | {max(highs_s):.1f} s "
                       f"| {max(selective_s):.1f} s | {upper_median(default_s)} | {upper_median(highs_s)} "
                       f"| {upper_median(selective_s)} |")
    lines += summary
    lines.append(f"\nWall time {(time.perf_counter() - started) / 60:.1f} min (profiles and the three solves).\n")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-layers", type=int, nargs="*", default=[17, 94])
    parser.add_argument("--real-layers", type=int, nargs="*", default=[12, 24])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    add_output_arguments(parser)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    text = run(args.fake_layers, args.real_layers, args.fractions)
    publish_table(text, args.out, "solve_time_budgets.md", DOC if args.docs else None)


if __name__ == "__main__":
    main()
