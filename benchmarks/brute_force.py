"""The planner against brute force on seeded random DAGs of up to 14 nodes (no torch).

Brute force replays every set of disjoint runs of consecutive compute nodes (every plan made of
segments: 1,597 for 8 nodes, 514,229 for 14) in the simulator once per graph, then answers each
budget: the least recompute time of a plan that fits. Budgets lie at 5, 35 and 70 % of the way
from the smallest feasible peak (brute force's) to the unoptimized peak. The
planner's plan (segments only, no kept outputs, so that both search the same plans) matches when
its cost is within the solver's relative gap of brute force's. The test suite checks 8-node
graphs (``tests/test_solver_reliability.py``); this script covers the larger ones, which take
about a minute per 14-node graph.

    python benchmarks/brute_force.py [--nodes 10 12 14] [--seeds 5] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/brute_force.md``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from graphs import random_dag  # noqa: E402

from planner import InfeasibleBudgetError, simulate, solve  # noqa: E402
from planner.core.costgraph import CostGraph  # noqa: E402
from planner.core.rerun import rerun_cost  # noqa: E402
from publish import publish_doc, tee_stdout  # noqa: E402

#: budgets between the smallest feasible peak (0) and the unoptimized peak (1)
FRACTIONS = (0.05, 0.35, 0.7)

#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

Seeded random DAGs (`tests/graphs.py`'s `random_dag`, where some nodes save only their inputs
and some run part of their forward after their last save). Brute force replays every set of
disjoint runs of consecutive compute nodes (every plan made of segments: 1,597 for 8 nodes,
514,229 for 14) in the simulator, each priced where checkpoint's recompute stops, as the
planner prices it. Budgets lie at 5, 35 and 70 % of the way from brute force's smallest
feasible peak to the unoptimized peak; a "case" is a graph and a budget. The planner's plan
(`solve` at its defaults, segments only) matches when its cost is within the MIP gap (1 %) of
brute force's least cost; "refuses a feasible budget" counts `InfeasibleBudgetError` where a
plan fits; "worst cost ratio" is the planner's cost over brute force's. The test suite checks
8-node graphs the same way (`tests/test_solver_reliability.py`).
"""


def run_sets(n: int, start: int = 0) -> Iterator[list[tuple[int, int]]]:
    """Every set of disjoint runs ``(first, last)`` of consecutive positions in ``start..n-1``."""
    if start >= n:
        yield []
        return
    yield from run_sets(n, start + 1)
    for last in range(start, n):
        for rest in run_sets(n, last + 1):
            yield [(start, last), *rest]


def every_plan(graph: CostGraph) -> list[tuple[int, float]]:
    """``(simulated peak, recompute ms)`` of every plan made of segments."""
    compute = list(graph.compute_nodes)
    out = []
    for runs in run_sets(len(compute)):
        segments = [[n.name for n in compute[a : b + 1]] for a, b in runs]
        cost = sum(rerun_cost(graph, segment)[0] for segment in segments)
        out.append((simulate(graph, segments).peak_bytes, cost))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[10, 12, 14])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--docs", action="store_true",
                        help="also write the table to docs/benchmarks/brute_force.md (with this command line and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tee_stdout() as printed:
        table(args.nodes, args.seeds)
    if args.docs:
        publish_doc(printed.getvalue(), "brute_force", sys.argv, title="The planner against brute force",
                    about=DOC_ABOUT)


def table(node_counts: list[int], seeds: int) -> None:
    """Print the table, a row per graph size as it is done."""
    gap = importlib.import_module("planner.solvers.solve").MIP_GAP
    print("| nodes | cases | planner matches brute force (within the gap) | planner refuses a feasible budget "
          "| worst cost ratio | brute force per graph | planner per solve (median) |")
    print("|---|---|---|---|---|---|---|")
    for n in node_counts:
        cases = matches = refusals = 0
        worst = 1.0
        brute_s: list[float] = []
        solve_s: list[float] = []
        for seed in range(seeds):
            graph = random_dag(seed, n)
            t0 = time.perf_counter()
            plans = every_plan(graph)
            brute_s.append(time.perf_counter() - t0)
            unoptimized = simulate(graph).peak_bytes
            smallest = min(peak for peak, _ in plans)
            for fraction in FRACTIONS:
                budget = int(smallest + (unoptimized - smallest) * fraction)
                costs = [cost for peak, cost in plans if peak <= budget]
                if not costs:
                    continue
                best = min(costs)
                cases += 1
                t0 = time.perf_counter()
                try:
                    plan = solve(graph, budget)
                except InfeasibleBudgetError:
                    refusals += 1
                    continue
                finally:
                    solve_s.append(time.perf_counter() - t0)
                ratio = plan.recompute_ms / best if best > 0 else 1.0
                worst = max(worst, ratio)
                matches += plan.recompute_ms <= best * (1 + gap) + 1e-9
        solve_s.sort()
        print(f"| {n} | {cases} | {matches} | {refusals} | {worst:.2f} | {sum(brute_s) / len(brute_s):.1f} s "
              f"| {solve_s[len(solve_s) // 2]:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
