"""Solve time across budgets, with the first ILP's node limit and without it.

``benchmarks/solve_time.py`` times one budget (half the peak). The solve time moves a lot with
the budget: the first ILP (on 32 stages) often finds its plan at the root and then spends up to
its time limit proving it. This script solves GPT-2-style graphs at several budgets, twice each:
with the defaults (the first ILP stopped after :data:`planner.solve.FIRST_ILP_NODES`
branch-and-bound nodes) and with that limit lifted (the default before), and reports both solve
times and whether the plans are the same.

Graphs: GPT-2 (width 256, batch 4 x 128) profiled on fake tensors (``--fake-layers``, roofline
times, as in ``solve_time.py``) and GPT-2 (width 256, batch 8 x 256, as in
``finer_rounds.py``) profiled on this CPU for real (``--real-layers``: measured node times,
which make harder ILPs than roofline times). Budgets are fractions of the simulated
unoptimized peak; solves run one at a time in one process, interleaved (default, unlimited) per
budget.

    python benchmarks/solve_time_budgets.py [--fake-layers 17 94] [--real-layers 12 24]
        [--fractions 0.3 0.4 0.5 0.6 0.7 0.8] [--readme]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time

import torch

from common import add_output_arguments, benchmark_logging, publish_table
from models import gpt2

from planner import simulate
from planner.costgraph import CostGraph
from planner.errors import InfeasibleBudgetError
from planner.plan import Plan
from profiling import profile_graph, trace_module

# ``planner.solve`` the attribute is the function; the module is reached by its import name
solve_module = importlib.import_module("planner.solve")

log = logging.getLogger("solve_time_budgets")

README_MARKERS = ("<!-- benchmarks/solve_time_budgets.py --readme: begin -->",
                  "<!-- benchmarks/solve_time_budgets.py --readme: end -->")


def timed_solve(graph: CostGraph, budget_bytes: int, first_ilp_nodes: int | None) -> tuple[Plan | None, float]:
    """The plan at ``budget_bytes`` (None where the budget is infeasible) and its solve time, with
    the first ILP stopped after ``first_ilp_nodes`` nodes (None: no node limit)."""
    default = solve_module.FIRST_ILP_NODES
    solve_module.FIRST_ILP_NODES = first_ilp_nodes
    started = time.perf_counter()
    try:
        plan: Plan | None = solve_module.solve(graph, budget_bytes)
    except InfeasibleBudgetError:
        plan = None
    finally:
        solve_module.FIRST_ILP_NODES = default
    return plan, time.perf_counter() - started


def _same(a: Plan | None, b: Plan | None) -> str:
    if a is None or b is None:
        return "both infeasible" if a is b else "no"
    return "yes" if [s.node_names for s in a.segments] == [s.node_names for s in b.segments] else "no"


def graph_rows(label: str, graph: CostGraph, fractions: list[float]) -> tuple[list[str], list[float], list[float]]:
    """The table rows of one graph, and its solve times with the node limit and without."""
    unoptimized = simulate(graph).peak_bytes
    rows, limited_s, unlimited_s = [], [], []
    for fraction in fractions:
        budget = int(unoptimized * fraction)
        limited, limited_time = timed_solve(graph, budget, solve_module.FIRST_ILP_NODES)
        unlimited, unlimited_time = timed_solve(graph, budget, None)
        limited_s.append(limited_time)
        unlimited_s.append(unlimited_time)
        recompute = "infeasible" if limited is None else f"{100 * limited.recompute_ms / graph.step_ms:.1f} %"
        rows.append(f"| {label} | {len(graph.compute_nodes)} | {fraction:.0%} | {limited_time:.1f} s "
                    f"| {unlimited_time:.1f} s | {_same(limited, unlimited)} | {recompute} |")
        log.info("%s at %.0f %%: %.1f s, %.1f s without the node limit", label, 100 * fraction, limited_time,
                 unlimited_time)
    return rows, limited_s, unlimited_s


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
        f"torch {torch.__version__}: the defaults (first ILP stopped after {solve_module.FIRST_ILP_NODES} "
        "branch-and-bound nodes) against no node limit there (before); whether both give the same plan; "
        "the plan's predicted recompute as a share of the step.\n",
        "| graph | compute nodes | budget | solve | solve, no first-ILP node limit | same plan | predicted recompute |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = ["", "| graph | compute nodes | slowest solve | slowest, no first-ILP node limit | upper median "
               "| upper median, no limit |", "|---|---|---|---|---|---|"]
    for label, graph in graphs:
        rows, limited_s, unlimited_s = graph_rows(label, graph, fractions)
        lines += rows
        summary.append(f"| {label} | {len(graph.compute_nodes)} | {max(limited_s):.1f} s | {max(unlimited_s):.1f} s "
                       f"| {sorted(limited_s)[len(limited_s) // 2]:.1f} s "
                       f"| {sorted(unlimited_s)[len(unlimited_s) // 2]:.1f} s |")
    lines += summary
    lines.append(f"\nWall time {(time.perf_counter() - started) / 60:.1f} min (profiles and both solves).\n")
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
    publish_table(text, args.out, "solve_time_budgets.md", README_MARKERS if args.readme else None)


if __name__ == "__main__":
    main()
