"""What the exact search buys on real models, and when the planner runs it by default.

For each model of ``benchmarks/quality.py``: the unoptimized peak and checkpoint-every-layer's
peak measured at the allocator, one profile, and at each target (every-layer's peak, and 50 %
of the unoptimized peak) three plans of whole segments by ``plan_for_budget`` (as ``optimize``
plans them, with the 1 % safety margin): ``exact=False`` (the ILP and its finer pass alone),
the default ``exact=None`` (the exact search also runs on graphs under
``planner.solvers.starts.exact_search.EXACT_BY_DEFAULT_BELOW`` compute nodes when the ILP's plan leaves more than
``EXACT_WHEN_UNUSED`` of the budget unused) and ``exact=True``. Predicted overhead (the
profile's summed node times over its profiled step), the budget the first plan left unused,
and each solve's wall time on this machine.

    python benchmarks/exact_search.py [--models gpt2 llama bert mlp gpt2_768] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/exact_search.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time

import torch

from common import GIB, MIB, benchmark_logging, checkpoint_every_k, publish_table, table_arguments
from quality import MODELS

from planner import InfeasibleBudgetError, Plan, optimize
from planner.pipeline import PlanOptions, plan_for_budget
from profiling import StepInputs, measure_step_peak_bytes

log = logging.getLogger("exact_search")

DOC = {"name": "exact_search", "title": "What the exact search buys", "about": """\
## How to read it

For each model of the quality benchmark ([quality.md](quality.md)), one fresh profile and two
targets: checkpoint-every-layer's measured peak and 50 % of the unoptimized peak. At each,
three plans of whole segments, planned as `optimize` plans them (1 % safety margin):

- `exact=False`: the stage models (chain DP), the finer rounds and the short-segment starts,
  without the exact search;
- `default` (`exact=None`): the exact search also runs on graphs under 64 compute nodes, and
  on graphs under 512 when the first plan leaves more than 1 % of the budget unused or none
  is found (`EXACT_BY_DEFAULT_BELOW`, `EXACT_WHEN_UNUSED` in
  [tuning.md](../tuning.md#exact_by_default_below));
- `exact=True`: the exact search on any graph.

Each cell gives the plan's predicted recompute time over the profiled step and the solve's wall
time; "refused" means `InfeasibleBudgetError` (the budget is below the smallest peak the
planner finds), with the time it took to say so. "unused by the ILP's plan" is the share of
the planning budget (99 % of the budget) the `exact=False` plan leaves free.
"""}
MODES = (("exact=False", False), ("default", None), ("exact=True", True))
SAFETY_MARGIN = 0.01  # optimize's default


@dataclasses.dataclass
class Solved:
    #: None: the planner refused the budget
    plan: Plan | None
    solve_s: float


@dataclasses.dataclass
class TargetRow:
    model: str
    compute_nodes: int
    target: str
    budget_bytes: int
    #: one per entry of MODES
    solved: list[Solved]


def _solve(graph, budget_bytes: int, exact: bool | None) -> Solved:
    started = time.perf_counter()
    try:
        plan = plan_for_budget(graph, budget_bytes / GIB, PlanOptions(exact=exact, safety_margin=SAFETY_MARGIN))
    except InfeasibleBudgetError:
        plan = None
    return Solved(plan, time.perf_counter() - started)


def run_model(name: str, cache_dir: str) -> list[TargetRow]:
    model, example = MODELS[name][1]()
    inputs = StepInputs.from_example(example)
    base_peak = measure_step_peak_bytes(model, inputs)
    every_peak = measure_step_peak_bytes(checkpoint_every_k(model, 1), inputs)
    graph = optimize(model, example, budget_gb=4 * base_peak / GIB, cache_dir=cache_dir).cost_graph
    rows = []
    for target, budget in (("every-layer peak", every_peak), ("50 %", base_peak // 2)):
        solved = [_solve(graph, budget, exact) for _, exact in MODES]
        rows.append(TargetRow(name, len(graph.compute_nodes), target, budget, solved))
        log.info("%s %s: %s", name, target, ", ".join(
            f"{mode} {s.plan.recompute_ms:.1f} ms in {s.solve_s:.1f} s" if s.plan else f"{mode} refused"
            for (mode, _), s in zip(MODES, solved)))
    return rows


def _cell(solved: Solved) -> str:
    if solved.plan is None:
        return f"refused ({solved.solve_s:.1f} s)"
    plan = solved.plan
    found = " (exact search's plan)" if plan.solver.endswith("+ exact") else ""
    return f"{plan.recompute_ms / plan.step_ms:+.1%}{found}, {solved.solve_s:.1f} s"


def _unused(row: TargetRow) -> str:
    first = row.solved[0].plan
    if first is None:
        return "no plan"
    planning_bytes = int(row.budget_bytes * (1 - SAFETY_MARGIN))
    return f"{1 - first.predicted_peak_bytes / planning_bytes:.1%}"


def markdown(rows: list[TargetRow], wall_s: float) -> str:
    lines = [f"CPU, torch {torch.__version__}, plans of whole segments, 1 % safety margin, wall time "
             f"{wall_s / 60:.1f} min.", "",
             "| model (compute nodes) | target | budget | unused by the ILP's plan | "
             + " | ".join(f"{mode}: overhead, solve" for mode, _ in MODES) + " |",
             "|---|---|---|---|" + "---|" * len(MODES)]
    for row in rows:
        lines.append(f"| {row.model} ({row.compute_nodes}) | {row.target} | {row.budget_bytes / MIB:.1f} MiB | "
                     f"{_unused(row)} | " + " | ".join(_cell(s) for s in row.solved) + " |")
    lines += ["", "Overhead: the plan's predicted recompute time over the profiled step. Unused: the share of "
              "the planning budget (99 % of the budget) the `exact=False` plan's predicted peak leaves free."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = table_arguments(__doc__.splitlines()[0], MODELS).parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[TargetRow] = []
    with tempfile.TemporaryDirectory(prefix="exact-profiles-") as cache_dir:
        for name in args.models:
            rows.extend(run_model(name, cache_dir))
    publish_table(markdown(rows, time.perf_counter() - started), args.out, "exact_search.md",
                  DOC if args.docs else None)


if __name__ == "__main__":
    main()
