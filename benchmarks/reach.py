"""Which quality bars any plan could meet: proven lower bounds at the quality targets.

For each model of ``benchmarks/quality.py``: the unoptimized peak and checkpoint-every-layer's
peak measured at the allocator, one profile, and at each target (every-layer's peak, and 50 %
of the unoptimized peak) the planner's plans (``plan_for_budget``, as ``optimize`` plans, with
and without ``selective``) and ``planner.bounds.reach.recompute_bound``: the least recompute any plan
fitting the budget needs by the profile's account, kept outputs included (time, and at
every-layer's peak FLOPs too), the largest of the covering bound, the segment covering bound
and HiGHS's bound on the optimistic account over every compute node; and the same over plans
of whole segments only (the planner's default), where the segment covering bound without kept
outputs, which knows each node between a storage's maker and its savers must rerun, proves
more. Bars in the profile's terms:

* 50 %: the bound over the profiled step must not exceed 10 %;
* every-layer's peak: the time bound must not exceed 60 % of every-layer's own recompute time,
  and the FLOP bound 70 % of its recomputed FLOPs (both priced by ``planner.core.rerun`` on the
  same profile; every-layer's segments are the layers' recomputable nodes).

A bound above the bar means no plan the planner can emit meets it by the profile's account:
the node times, which the recompute benchmark matches within a few percent, and the
simulator's memory, which matches the allocator within 2 % (docs/memory.md); a bound over whole
segments above it, that no plan of the default (``selective=False``) does. ``--segments-only``
makes the second bound cover plans of whole segments alone too.

    python benchmarks/reach.py [--models gpt2 llama bert mlp gpt2_768] [--time-limit-s 90] [--no-presolve]
                               [--segments-only] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/reach.md`` (``reach_segments_only.md``
with ``--segments-only``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time

import torch

from common import GIB, MIB, benchmark_logging, checkpoint_every_k, find_layers, publish_table, table_arguments
from quality import MODELS

from planner import InfeasibleBudgetError, optimize
from planner.bounds.covering import LowerBound
from planner.core.costgraph import CostGraph, protect_reads_before_writes
from planner.pipeline import PlanOptions, plan_for_budget
from planner.bounds.reach import RecomputeBound, recompute_bound
from planner.bounds.segment_covering import segment_covering_bound
from planner.core.rerun import rerun_cost
from profiling import StepInputs, measure_step_peak_bytes

log = logging.getLogger("reach")

#: how to read the tables, below them on their page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

For each model of the quality benchmark ([quality.md](quality.md)): one fresh profile, the
budgets measured at the allocator (checkpoint-every-layer's peak, and half the unoptimized
peak), the planner's plans at them and proven lower bounds on the recompute of every plan that
fits, all in the profile's terms (summed node times over the profiled step; FLOPs as
`FlopCounterMode` counts them). Every-layer's own recompute is priced on the same profile
(`planner.core.rerun`, its layers' nodes as segments).

A bound is the largest of three, each at most the recompute of the cheapest plan that fits:

- **the covering bound** (`planner/bounds/covering.py`): one binary per node ("runs again in a
  recompute") and one covering constraint per moment over the budget; seconds at most;
- **the segment covering bound** (`planner/bounds/segment_covering.py`): the covering bound plus
  segment breaks, so it knows that a recompute restores what its segment saved while its
  backward runs; tighter over plans of whole segments, at minutes of HiGHS;
- **the account** (`planner/bounds/reach.py`): the exact search's optimistic memory account with every
  compute node as its own stage, and by default a keep decision per node
  (`planner/bounds/kept_account.py`); HiGHS's best bound within the time limit, or CBC's LP
  relaxation. An infeasible account proves that no plan fits.

"bound, whole segments" covers plans of whole segments (the default, `selective=False`); "bound,
any plan" covers kept outputs too (`selective=True`); with `--segments-only` the one "bound"
column is the account over plans of whole segments alone. "plan / its bound" brackets how far the
default plan can be from the cheapest one. A bar is **out of reach** when the bound exceeds it:
then no plan meets it by the profile's account, whose node times match measured recompute
within a few percent ([recompute_time.md](recompute_time.md)) and whose memory matches the
allocator ([fidelity.md](fidelity.md)). "not excluded" means the bound does not rule the bar
out; it does not mean a plan meets it. "how the time bounds were proven" names, for each of the
two bounds, which bound decided and how its solve ended.
"""


def doc(segments_only: bool) -> dict[str, str]:
    """The page the tables go to with ``--docs``."""
    if segments_only:
        return {"name": "reach_segments_only", "about": DOC_ABOUT,
                "title": "Which bars any plan of whole segments can meet: the account over whole segments"}
    return {"name": "reach", "title": "Which bars any plan can meet: proven lower bounds", "about": DOC_ABOUT}


@dataclasses.dataclass
class TargetRow:
    model: str
    target: str
    budget_bytes: int
    step_ms: float
    #: the planner's plan, segments only (None: it found none at this budget)
    plan_ms: float | None
    plan_flops: int | None
    #: the planner's plan with kept outputs (``selective=True``)
    selective_ms: float | None
    #: over every plan, kept outputs included
    time_bound: RecomputeBound
    flops_bound: RecomputeBound | None
    every_ms: float
    every_flops: int
    #: over plans of whole segments only (what the planner emits by default)
    segments_time_bound: LowerBound
    segments_flops_bound: LowerBound | None


def every_layer_segments(graph: CostGraph, layers_name: str) -> list[list[str]]:
    """Checkpoint-every-layer as a plan: each layer's recomputable nodes, in order."""
    layers: dict[str, list[str]] = {}
    prefix = f"{layers_name}."
    for node in graph.compute_nodes:
        if node.module.startswith(prefix) and node.recomputable:
            layers.setdefault(node.module[len(prefix):].split(".")[0], []).append(node.name)
    return list(layers.values())


def whole_segments_bound(graph: CostGraph, budget_bytes: int, objective: str, time_limit_s: float,
                         any_plan: RecomputeBound) -> LowerBound:
    """The larger of ``any_plan`` (a bound over every plan, so over plans of whole segments too)
    and the segment covering bound over plans of whole segments."""
    if any_plan.proven_infeasible:
        return LowerBound(math.inf, any_plan.method)
    found = segment_covering_bound(graph, budget_bytes, objective=objective, kept_outputs=False,
                                   time_limit_s=time_limit_s)
    return found if found.value > any_plan.bound else LowerBound(any_plan.bound, any_plan.method)


def _plan_ms(graph: CostGraph, budget_bytes: int, selective: bool) -> tuple[float | None, int | None]:
    try:
        plan = plan_for_budget(graph, budget_bytes / GIB, PlanOptions(selective=selective))
    except InfeasibleBudgetError:
        return None, None
    return plan.recompute_ms, plan.recompute_flops


def run_model(name: str, time_limit_s: float, cache_dir: str, presolve: bool = True,
              kept_outputs: bool = True) -> list[TargetRow]:
    model, example = MODELS[name][1]()
    inputs = StepInputs.from_example(example)
    layers_name, _ = find_layers(model)
    base_peak = measure_step_peak_bytes(model, inputs)
    every_peak = measure_step_peak_bytes(checkpoint_every_k(model, 1), inputs)
    graph = optimize(model, example, budget_gb=4 * base_peak / GIB, cache_dir=cache_dir).cost_graph
    protected = protect_reads_before_writes(graph)
    every = [rerun_cost(graph, seg) for seg in every_layer_segments(graph, layers_name)]
    every_ms, every_flops = sum(ms for ms, _ in every), sum(flops for _, flops in every)
    rows = []
    for target, budget in (("every-layer peak", every_peak), ("50 %", base_peak // 2)):
        plan_ms, plan_flops = _plan_ms(graph, budget, selective=False)
        selective_ms, _ = _plan_ms(graph, budget, selective=True)
        time_bound = recompute_bound(protected, budget, time_limit_s=time_limit_s, presolve=presolve,
                                     kept_outputs=kept_outputs)
        flops_bound = (recompute_bound(protected, budget, objective="flops", time_limit_s=time_limit_s,
                                       presolve=presolve, kept_outputs=kept_outputs)
                       if target == "every-layer peak" else None)
        segments_time = whole_segments_bound(protected, budget, "time", time_limit_s, time_bound)
        segments_flops = (whole_segments_bound(protected, budget, "flops", time_limit_s, flops_bound)
                          if flops_bound is not None else None)
        rows.append(TargetRow(name, target, budget, graph.step_ms, plan_ms, plan_flops, selective_ms, time_bound,
                              flops_bound, every_ms, every_flops, segments_time, segments_flops))
        log.info("%s %s: plan %s ms, selective %s ms, bound %.1f ms (%s, %.0f s), whole segments %.1f ms (%s)",
                 name, target, plan_ms, selective_ms, time_bound.bound, time_bound.method, time_bound.solve_s,
                 segments_time.value, segments_time.method)
    return rows


def _share(value: float | None, of: float) -> str:
    if value is None:
        return "no plan"
    return "infeasible" if math.isinf(value) else f"{value / of:.1%}"


def verdicts(row: TargetRow) -> str:
    """Whether each bar is out of reach by the profile's account: of plans of whole segments
    (the planner's default), and of every plan (kept outputs included)."""
    def said(segments: float, any_plan: float, limit: float) -> str:
        if any_plan > limit:
            return "out of reach"
        return "out of reach for whole segments" if segments > limit else "not excluded"

    if row.time_bound.proven_infeasible:
        return "no plan fits the budget"
    if row.target == "50 %":
        return f"time: {said(row.segments_time_bound.value, row.time_bound.bound, 0.10 * row.step_ms)}"
    assert row.flops_bound is not None and row.segments_flops_bound is not None
    return (f"time: {said(row.segments_time_bound.value, row.time_bound.bound, 0.6 * row.every_ms)}; "
            f"FLOPs: {said(row.segments_flops_bound.value, row.flops_bound.bound, 0.7 * row.every_flops)}")


def markdown(rows: list[TargetRow], time_limit_s: float, wall_s: float, presolve: bool = True,
             kept_outputs: bool = True) -> str:
    covers = "every plan, kept outputs included" if kept_outputs else "plans of whole segments only"
    lines = [
        f"CPU, torch {torch.__version__}, HiGHS time limit {time_limit_s:g} s per bound"
        f"{'' if presolve else ', presolve off'}, second bound over {covers}, wall time {wall_s / 60:.1f} min.",
        "",
        "| model | target | budget | plan: time / step | selective plan: time / step "
        "| bound, whole segments: time / step | bound, any plan: time / step | plan / its bound "
        "| bounds / every-layer's time (bar 60 %) | bounds / every-layer's FLOPs (bar 70 %) "
        "| how the time bounds were proven | bars |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        segments, bound = r.segments_time_bound.value, r.time_bound.bound
        ratio = f"{r.plan_ms / segments:.2f}" if r.plan_ms is not None and 0 < segments < math.inf else "-"
        every_time = (f"{_share(segments, r.every_ms)} / {_share(bound, r.every_ms)}"
                      if r.target != "50 %" else "-")
        every_flops = "-"
        if r.flops_bound is not None and r.segments_flops_bound is not None:
            every_flops = (f"{_share(r.segments_flops_bound.value, r.every_flops)} / "
                           f"{_share(r.flops_bound.bound, r.every_flops)}")
        lines.append(
            f"| {r.model} | {r.target} | {r.budget_bytes / MIB:.1f} MiB | {_share(r.plan_ms, r.step_ms)} "
            f"| {_share(r.selective_ms, r.step_ms)} | {_share(segments, r.step_ms)} | {_share(bound, r.step_ms)} "
            f"| {ratio} | {every_time} | {every_flops} | {r.segments_time_bound.method}; {r.time_bound.method} "
            f"| {verdicts(r)} |")
    lines.append("")
    lines.append("Models as in the quality table. Times in the profile's terms (summed node times over the "
                 "profiled step); the plan is the planner's default (segments only), the selective plan "
                 "`selective=True` (kept outputs), both with the 1 % safety margin. The bound over whole "
                 "segments is the larger of the bound over any plan and the segment covering bound without "
                 "kept outputs; \"bounds / every-layer's\" gives both, whole segments first.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = table_arguments(__doc__.splitlines()[0], MODELS)
    parser.add_argument("--time-limit-s", type=float, default=90.0, help="HiGHS time limit of each bound")
    parser.add_argument("--no-presolve", action="store_true",
                        help="HiGHS without presolve (Llama's account got no bound in 300 s with it)")
    parser.add_argument("--segments-only", action="store_true",
                        help="bound plans of whole segments only (no kept outputs): a smaller model")
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[TargetRow] = []
    with tempfile.TemporaryDirectory(prefix="reach-profiles-") as cache_dir:
        for name in args.models:
            rows.extend(run_model(name, args.time_limit_s, cache_dir, presolve=not args.no_presolve,
                                  kept_outputs=not args.segments_only))
            log.info("%s done at %.0f s", name, time.perf_counter() - started)
    text = markdown(rows, args.time_limit_s, time.perf_counter() - started, presolve=not args.no_presolve,
                    kept_outputs=not args.segments_only)
    publish_table(text, args.out, "reach_segments_only.md" if args.segments_only else "reach.md",
                  doc(args.segments_only) if args.docs else None)


if __name__ == "__main__":
    main()
