"""What lies between the planner's plan and the covering bound, on the H100 profiles.

For each profile in ``tests/data/h100/`` the budget is checkpoint-every-layer's
simulated peak (as in ``benchmarks/hand_placed.py``). Every figure is a share of every-layer's
recompute time at that budget, in the planner's own model (deterministic up to solver time
limits: it runs no model):

* plans: the default ``solve``, ``solve(selective=True)`` (kept outputs inside segments) and,
  with ``--stages``, ``solve(max_stages=...)`` (cut points the first 32 stages do not offer);
* bounds (:mod:`planner.bounds.covering`): the covering model with every transient released
  in the backward (each maker kept for free: the model without backward holds), the bound
  over every plan (kept outputs included), the bound over plans of whole segments, and, on
  graphs of at most ``--segment-covering-nodes`` compute nodes, the segment covering bound
  over whole segments after ``--segment-covering-s`` seconds of HiGHS
  (:mod:`planner.bounds.segment_covering`);
* at every-layer's peak moment: the bytes to free there, and the bytes of transients the
  released model's cheapest reruns would leave held there (a segment keeps its inputs until
  its backward), which that model counts as free;
* at checkpoint-every-2nd-layer's peak, on the same graphs as the segment covering bound: the
  planner and the two bounds over whole segments.

    python benchmarks/bound_gap.py [--models ...] [--stages 256] [--docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from common import H100_PROFILES, ROOT, add_docs_argument, benchmark_logging, publish_table

from planner.bounds.backward_holds import held_transient_bytes
from planner.bounds.covering import covering_bound
from planner.bounds.segment_covering import segment_covering_bound
from planner.core.costgraph import CostGraph, protect_reads_before_writes
from planner.core.errors import InfeasibleBudgetError
from planner.core.simulate import simulate
from planner.solvers.hand_policies import hand_placed_plans
from planner.solvers.solve import solve
from profiling.cache import load_profile

log = logging.getLogger("bound_gap")

PROFILES = H100_PROFILES
MODELS = ["gpt2_gpu", "llama_gpu", "bert_gpu", "t5_gpu", "mlp_gpu", "gpt2_24l_gpu"]
MIB = 2**20
#: HiGHS's time limit for the covering bounds (its dual bound at the limit is still a bound)
COVERING_S = 10.0

DOC = {"name": "bound_gap", "title": "Between the best plan and the covering bound (H100 profiles)", "about": """\
## How to read it

Budgets are checkpoint-every-layer's simulated peak on each H100 profile; every share is of
every-layer's recompute time there, in the planner's own model (profile costs, simulator
memory). A plan's share is what it recomputes; a bound's share is the least any plan of its
class can recompute.

- *planner*, *selective*, *N stages*: `solve` with the defaults, with `selective=True` (the
  number of kept outputs in brackets) and with `max_stages=N`.
- *released*: the covering model that lets every transient a recomputed node reads go in the
  backward, as if each maker could be kept for free. *all plans*: the covering bound
  (`covering_bound`, kept outputs included: a kept maker releases its transient only where its
  segment, paying the selective policy on every node, reaches the moment's recompute).
  *whole segments*: `covering_bound(kept_outputs=False)`, every transient held from its
  recomputed reader's backward on. *segment covering*: `segment_covering_bound(kept_outputs=False)`
  after the time limit shown (HiGHS's dual bound; *no bound* where it proved none in that
  time), then the LP relaxation's where larger, on graphs of at most 400 compute nodes by
  default (`--segment-covering-nodes`: on T5's 754 nodes building the model and its LP
  relaxation take minutes). A time-limited bound depends on the machine's speed and load: a
  longer limit proves more.
  The covering bounds get 10 s of HiGHS each and, where it stops before closing the gap, the
  larger of its bound and the LP relaxation's (`covering_bound`).
- Decomposition: *held inputs* = whole segments - released (what the released model freed
  that segment inputs hold); *kept room* = whole segments - all plans (recompute only plans
  with kept outputs could still save, by the bound); *segment rules* = segment covering -
  whole segments, where it proves more; *finer cuts* = planner - N stages; *open* = the best
  plan found - the best bound over whole segments (a plan the solver misses, or a bound still
  loose).
- *At every-2nd-layer's peak*: the same at checkpoint-every-2nd-layer's simulated peak (a
  higher budget), on the graphs the segment covering bound runs on.
- *peak moment*: where every-layer peaks; *to free*: the unoptimized step's live bytes there
  less the budget; *held by released reruns*: the transients the released model's cheapest
  reruns leave held there."""}


def _share(value: float | None, reference: float) -> str:
    return "none" if value is None else f"{value / reference:.3f}"


def _solve(graph: CostGraph, budget: int, **options) -> tuple[float | None, int, float]:
    started = time.perf_counter()
    try:
        plan = solve(graph, budget, **options)
    except InfeasibleBudgetError:
        return None, 0, time.perf_counter() - started
    return plan.recompute_ms, sum(len(s.kept_nodes) for s in plan.segments), time.perf_counter() - started


def released(graph: CostGraph) -> CostGraph:
    """``graph`` with every compute node keepable at no policy cost: its covering bound lets
    every transient go in the backward."""
    nodes = tuple(dataclasses.replace(n, selective_save=True) if n.kind == "compute" else n for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes, selective_overhead_ms_per_node=0.0)


def profile_row(name: str, stages: int, segment_s: float, segment_nodes: int) -> dict[str, object]:
    graph = protect_reads_before_writes(load_profile(PROFILES / f"{name}.json"))
    hand = {plan.name: plan for plan in hand_placed_plans(graph)}["every layer"]
    every = simulate(graph, hand.segments)
    budget = every.peak_bytes
    row: dict[str, object] = {"name": name, "nodes": len(graph.compute_nodes), "every_ms": hand.recompute_ms}
    row["planner"], _, row["planner_s"] = _solve(graph, budget)
    row["selective"], row["kept"], row["selective_s"] = _solve(graph, budget, selective=True)
    row["finer"] = _solve(graph, budget, max_stages=stages)[0] if stages else None
    started = time.perf_counter()
    free = covering_bound(released(graph), budget, time_limit_s=COVERING_S)
    row["released"] = free.value
    row["all"] = covering_bound(graph, budget, time_limit_s=COVERING_S).value
    row["segments"] = covering_bound(graph, budget, kept_outputs=False, time_limit_s=COVERING_S).value
    row["bounds_s"] = time.perf_counter() - started
    row["segment_covering"] = None
    if segment_s and row["nodes"] <= segment_nodes:
        row["segment_covering"] = segment_covering_bound(graph, budget, kept_outputs=False,
                                                         time_limit_s=segment_s).value
    unoptimized = dict(((phase, node), live) for phase, node, live in simulate(graph).timeline)
    row["moment"] = f"{every.peak_phase} {every.peak_node}"
    row["to_free"] = (unoptimized[(every.peak_phase, every.peak_node)] - budget) / MIB
    row["held"] = (held_transient_bytes(graph, set(free.reruns), every.peak_node) / MIB
                   if every.peak_phase == "backward" else None)
    row["every_2nd"] = every_2nd_row(graph, segment_s) if segment_s and row["nodes"] <= segment_nodes else None
    log.info("%s: %s", name, row)
    return row


def every_2nd_row(graph: CostGraph, segment_s: float) -> dict[str, float | None]:
    """At checkpoint-every-2nd-layer's peak: its recompute, the planner's, and the bounds over
    plans of whole segments (a higher budget, where the segment rules close sooner)."""
    hand = {plan.name: plan for plan in hand_placed_plans(graph)}["every 2nd layer"]
    budget = simulate(graph, hand.segments).peak_bytes
    return {"every_ms": hand.recompute_ms, "planner": _solve(graph, budget)[0],
            "segments": covering_bound(graph, budget, kept_outputs=False, time_limit_s=COVERING_S).value,
            "segment_covering": segment_covering_bound(graph, budget, kept_outputs=False,
                                                       time_limit_s=segment_s).value}


def _difference(a: object, b: object, reference: float) -> str:
    if a is None or b is None:
        return "-"
    return f"{(float(a) - float(b)) / reference:+.3f}"  # type: ignore[arg-type]


def _segment_cell(value: object, reference: float) -> str:
    if value is None:
        return "-"
    return "no bound" if float(value) <= 0 else _share(float(value), reference)  # type: ignore[arg-type]


def _best(a: object, b: object) -> object:
    return None if a is None else max(float(a), float(b))  # type: ignore[arg-type]


def markdown(rows: list[dict[str, object]], stages: int, segment_s: float) -> str:
    finer = f"{stages} stages" if stages else "finer stages"
    header = ["profile", "compute nodes", "every-layer recompute (ms)", "planner", "selective (kept)", finer,
              "released", "all plans", "whole segments", f"segment covering ({segment_s:g} s)"]
    lines = ["## Plans and bounds at every-layer's peak", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ref = float(r["every_ms"])  # type: ignore[arg-type]
        lines.append("| " + " | ".join([
            str(r["name"]), str(r["nodes"]), f"{ref:.1f}", _share(r["planner"], ref),  # type: ignore[arg-type]
            f"{_share(r['selective'], ref)} ({r['kept']})", _share(r["finer"], ref),  # type: ignore[arg-type]
            _share(r["released"], ref), _share(r["all"], ref), _share(r["segments"], ref),  # type: ignore[arg-type]
            _segment_cell(r["segment_covering"], ref)]) + " |")
    header = ["profile", "held inputs", "kept room", "segment rules", "finer cuts", "open"]
    lines += ["", "## The gap, decomposed (shares of every-layer's recompute)", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ref = float(r["every_ms"])  # type: ignore[arg-type]
        plans = [float(v) for v in (r["planner"], r["selective"], r["finer"]) if v is not None]  # type: ignore[arg-type]
        bounds = [float(v) for v in (r["segments"], r["segment_covering"]) if v is not None]  # type: ignore[arg-type]
        lines.append("| " + " | ".join([
            str(r["name"]), _difference(r["segments"], r["released"], ref), _difference(r["segments"], r["all"], ref),
            _difference(_best(r["segment_covering"], r["segments"]), r["segments"], ref),
            _difference(r["planner"], r["finer"], ref),
            _difference(min(plans), max(bounds), ref) if plans and bounds else "-"]) + " |")
    header = ["profile", "peak moment", "to free (MiB)", "held by released reruns (MiB)"]
    lines += ["", "## At every-layer's peak moment", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        held = "-" if r["held"] is None else f"{float(r['held']):.0f}"  # type: ignore[arg-type]
        lines.append(f"| {r['name']} | {r['moment']} | {float(r['to_free']):.0f} | {held} |")  # type: ignore[arg-type]
    header = ["profile", "every-2nd recompute (ms)", "planner", "whole segments", f"segment covering ({segment_s:g} s)"]
    lines += ["", "## At every-2nd-layer's peak", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        second = r["every_2nd"]
        if isinstance(second, dict):
            ref = float(second["every_ms"])
            lines.append(f"| {r['name']} | {ref:.1f} | {_share(second['planner'], ref)} | "
                         f"{_share(second['segments'], ref)} | {_segment_cell(second['segment_covering'], ref)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=MODELS, default=MODELS)
    parser.add_argument("--stages", type=int, default=256, help="max_stages of the finer solve (0: none)")
    parser.add_argument("--segment-covering-s", type=float, default=15.0,
                        help="HiGHS time limit of the segment covering bound (0: none)")
    parser.add_argument("--segment-covering-nodes", type=int, default=400,
                        help="the largest graph (compute nodes) the segment covering bound runs on")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    started = time.perf_counter()
    rows = [profile_row(name, args.stages, args.segment_covering_s, args.segment_covering_nodes)
            for name in args.models]
    text = markdown(rows, args.stages, args.segment_covering_s)
    text += f"\nWall time {(time.perf_counter() - started) / 60:.1f} min on this machine.\n"
    publish_table(text, args.out, "bound_gap.md", DOC if args.docs else None)


if __name__ == "__main__":
    main()
