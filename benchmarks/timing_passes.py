"""Plans from one timed pass against plans from two: does a second pass buy a better plan?

For each corpus family (batch x 32, as `optimize_time.py --corpus` runs them), ``--runs`` fresh
processes each do what ``optimize``'s first call does on CPU: capture the model (no eager step
before), measure the unoptimized step under the memory profiler (the memory pass, which also
times every node), then profile it twice on that pass: with ``timing_repeats=1`` (the memory pass
alone) and with ``timing_repeats=2`` (one timed pass more, more while they disagree). Every
profile is planned at 70 % and 50 % of the measured peak (at the smallest feasible budget where
that is below it), and each plan is priced on the median node times of all the family's profiles:
the table gives each setting's plans as a multiple of the cheapest.

    python benchmarks/timing_passes.py                      # 10 families, 4 runs each (about 8 min)
    python benchmarks/timing_passes.py --families gpt2 t5 --runs 6
    python benchmarks/timing_passes.py --docs               # also docs/benchmarks/timing_passes.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_output_arguments, benchmark_logging, publish_table  # noqa: E402
from corpus_models import FAMILIES  # noqa: E402
from plan_stability import plan_cost_ms  # noqa: E402
from publish import markdown_table  # noqa: E402

from planner.budget_plan import plan_for_budget  # noqa: E402
from planner.core.costgraph import CostGraph  # noqa: E402
from planner.core.errors import InfeasibleBudgetError  # noqa: E402
from planner.core.options import PlanOptions  # noqa: E402

log = logging.getLogger("timing_passes")

DEFAULT_FAMILIES = ("gpt2", "llama", "bert", "t5", "vit", "convnext", "mixtral", "bart", "resnet", "gemma2")
FRACTIONS = (0.7, 0.5)
SETTINGS = (1, 2)
BATCH_SCALE = 32

DOC_ABOUT = """\
How to read it: per family and budget, each setting's plans (one per fresh process), priced on
the median node times of all the family's profiles (both settings, every run), as a multiple of
the cheapest of them; *worst* is the dearest plan of the setting. *profile (s)*: the median
time of the profile after the memory pass (the profiling forward and the timing passes), per
setting. Timings are wall clock on a shared 2-core machine, one thread.
"""


def profile_once(name: str, out: Path) -> None:
    """In this (fresh) process: capture, the memory pass, and a profile per setting on it."""
    from profiling import StepInputs, TrainingStep, profile_graph, trace_module
    from profiling.profile import measure_unoptimized_step

    family = FAMILIES[name]
    model, example = family.build(BATCH_SCALE)
    step = TrainingStep(loss_fn=family.loss_fn)
    gm = trace_module(model, example)
    measured = measure_unoptimized_step(gm, StepInputs.from_example(example), step)
    profiles: dict[int, CostGraph] = {}
    took_s: dict[int, float] = {}
    for repeats in SETTINGS:
        started = time.perf_counter()
        profiles[repeats] = profile_graph(gm, example, step=step, node_peaks=measured.node_peaks,
                                          timing_repeats=repeats)
        took_s[repeats] = time.perf_counter() - started
    out.write_bytes(pickle.dumps({"profiles": profiles, "took_s": took_s}))


def _median_times(graphs: list[CostGraph]) -> CostGraph:
    """The first graph with every node's time the median over ``graphs``."""
    base = graphs[0]
    return dataclasses.replace(base, nodes=tuple(
        dataclasses.replace(n, time_ms=statistics.median(g.node(n.name).time_ms for g in graphs)) for n in base.nodes))


def _plan_cost_ms(graph: CostGraph, budget_bytes: int, priced_on: CostGraph) -> float:
    try:
        plan = plan_for_budget(graph, budget_bytes / 2**30, PlanOptions())
    except InfeasibleBudgetError as refusal:
        plan = plan_for_budget(graph, refusal.min_feasible_bytes / 2**30, PlanOptions())
    return plan_cost_ms(priced_on, plan)


def family_rows(name: str, runs: list[dict[str, Any]]) -> list[list[str]]:
    """One row per budget: each setting's plans as multiples of the cheapest, and profile times."""
    graphs = [run["profiles"][s] for run in runs for s in SETTINGS]
    reference = _median_times(graphs)
    peak_bytes = reference.measured_peak_bytes or 0
    rows = []
    for fraction in FRACTIONS:
        costs = {s: [_plan_cost_ms(run["profiles"][s], int(fraction * peak_bytes), reference) for run in runs]
                 for s in SETTINGS}
        cheapest = min(c for values in costs.values() for c in values) or 1.0
        cells = []
        for s in SETTINGS:
            ratios = [c / cheapest if cheapest else 1.0 for c in costs[s]]
            cells += [", ".join(f"{r:.3f}" for r in ratios), f"{max(ratios):.3f}"]
        took = [f"{statistics.median(run['took_s'][s] for run in runs):.2f}" for s in SETTINGS]
        rows.append([name, f"{fraction:.0%}", *cells, *took])
    return rows


def main() -> None:
    parser = add_output_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--families", nargs="*", choices=sorted(FAMILIES), default=list(DEFAULT_FAMILIES))
    parser.add_argument("--runs", type=int, default=4, help="fresh processes per family (default 4)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        logging.basicConfig(level=logging.ERROR)
        profile_once(args.one[0], Path(args.one[1]))
        return
    benchmark_logging()
    rows = []
    with tempfile.TemporaryDirectory(prefix="timing-passes-") as folder:
        for name in args.families:
            runs = []
            for k in range(args.runs):
                out = Path(folder) / f"{name}_{k}.pkl"
                command = [sys.executable, __file__, "--one", name, str(out), "--threads", str(args.threads)]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{name}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
                runs.append(pickle.loads(out.read_bytes()))
            rows += family_rows(name, runs)
            log.info("%s: %s", name, rows[-2:])
    header = ["family", "budget", "1 pass: plans", "1 pass: worst", "2 passes: plans", "2 passes: worst",
              "profile, 1 pass (s)", "profile, 2 passes (s)"]
    worst = {s: max(float(r[3 if s == 1 else 5]) for r in rows) for s in SETTINGS}
    text = markdown_table(header, rows) + (f"\nWorst plan, {len(args.families)} families x {len(FRACTIONS)} budgets x "
                                           f"{args.runs} runs: {worst[1]:.3f}x the cheapest with 1 pass, "
                                           f"{worst[2]:.3f}x with 2.\n")
    publish_table(text, args.out, "timing_passes.md",
                  {"name": "timing_passes", "title": "One timed pass or two", "about": DOC_ABOUT} if args.docs else None)


if __name__ == "__main__":
    main()
