"""The planner against hand-placed plans on the H100 profiles, in the planner's own model.

For each profile in ``tests/data/h100/`` (measured on an NVIDIA H100; its README says
how) and each hand-placed plan (checkpoint every layer, every 2nd layer; the repeated blocks
come from the profile's module paths, :mod:`planner.solvers.hand_policies`), the budget is that
plan's simulated peak. The table gives the default solve's predicted recompute as a share of
the hand-placed plan's, the covering lower bound as the same share (over every plan, and over
plans of whole segments), the solve time, and the same with ``max_stages=128`` (the slower
fine-grained search), and where in the step the hand-placed plan's peak falls: in the
repeated layers, or outside them (the output head and loss). Deterministic: it runs no model.

    python benchmarks/hand_placed.py [--docs]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import H100_PROFILES  # noqa: E402
from publish import ROOT, markdown_table, publish_doc  # noqa: E402

from planner.bounds.covering import covering_bound  # noqa: E402
from planner.core.costgraph import protect_reads_before_writes  # noqa: E402
from planner.core.errors import InfeasibleBudgetError  # noqa: E402
from planner.core.simulate import simulate  # noqa: E402
from planner.solvers.hand_policies import hand_placed_plans, repeated_blocks  # noqa: E402
from planner.solvers.solve import solve  # noqa: E402
from profiling.cache import load_profile  # noqa: E402

PROFILES = H100_PROFILES
MODELS = ["gpt2_gpu", "llama_gpu", "bert_gpu", "t5_gpu", "mlp_gpu", "gpt2_24l_gpu"]
POLICIES = ("every layer", "every 2nd layer")
MIB = 2**20

ABOUT = """How to read it:

- *hand-placed peak*: the simulated peak of the hand-placed plan, as a share of the unoptimized
  peak; it is the budget of the row. On these profiles every-layer's simulated peak is within
  4 MiB of the peak measured on the H100 for the transformers (the profiles' README).
- *planner / hand-placed*: the default `solve`'s predicted recompute time over the hand-placed
  plan's at that budget. At most 1.00 by construction: the hand-placed plans are candidates of
  every solve. *128 stages*: the same with `max_stages=128`.
- *covering bound*: the least recompute any plan fitting the budget needs, by the covering
  bound (`planner.bounds.covering`, kept outputs included; HiGHS's dual bound after at most
  30 s), over the hand-placed plan's recompute. The best plan lies between the bound and the
  planner's column. *whole segments bound*: the same over plans of whole segments
  (`kept_outputs=False`), the plans the default solve returns.
  [bound_gap.md](bound_gap.md) says what lies between the bounds and the plans.
- *its peak at*: the moment of the hand-placed plan's simulated peak (forward or backward of
  which node), and whether that node is inside the repeated layers. Where it is outside them
  (the output head and loss), every plan that fits must hold at that moment no more than the
  hand-placed plan holds there, which is what keeps the bounds high.
- Times are this machine's wall-clock seconds of each solve."""


def _ratio(value: float | None, reference: float) -> str:
    return "none" if value is None else f"{value / reference:.3f}"


def _peak_at(graph, segments) -> str:
    """Where ``segments``' simulated peak falls, and whether inside the repeated layers."""
    result = simulate(graph, segments)
    layers = {name for stack in repeated_blocks(graph) for block in stack for name in block}
    where = "in the layers" if result.peak_node in layers else "outside the layers"
    return f"{result.peak_phase} {result.peak_node} ({where})"


def _solve_ms(graph, budget: int, **options) -> tuple[float | None, float]:
    started = time.perf_counter()
    try:
        ms: float | None = solve(graph, budget, **options).recompute_ms
    except InfeasibleBudgetError:
        ms = None
    return ms, time.perf_counter() - started


def rows(models: list[str]) -> list[list[str]]:
    table = []
    for name in models:
        graph = protect_reads_before_writes(load_profile(PROFILES / f"{name}.json"))
        unoptimized = simulate(graph).peak_bytes
        plans = {plan.name: plan for plan in hand_placed_plans(graph)}
        for policy in POLICIES:
            hand = plans[policy]
            budget = simulate(graph, hand.segments).peak_bytes
            planned, planned_s = _solve_ms(graph, budget)
            fine, fine_s = _solve_ms(graph, budget, max_stages=128)
            bound = covering_bound(graph, budget).value
            segments_bound = covering_bound(graph, budget, kept_outputs=False).value
            table.append([name, policy, f"{budget / unoptimized:.3f}", f"{hand.recompute_ms:.1f}",
                          _ratio(planned, hand.recompute_ms), f"{planned_s:.1f}", _ratio(fine, hand.recompute_ms),
                          f"{fine_s:.1f}", _ratio(bound, hand.recompute_ms), _ratio(segments_bound, hand.recompute_ms),
                          _peak_at(graph, hand.segments)])
            logging.info("%s %s: %s", name, policy, table[-1])
    return table


def markdown(table: list[list[str]]) -> str:
    header = ["profile", "hand-placed plan", "hand-placed peak", "its recompute (ms)", "planner / hand-placed",
              "solve (s)", "128 stages / hand-placed", "solve (s)", "covering bound / hand-placed",
              "whole segments bound / hand-placed", "its peak at"]
    return markdown_table(header, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=MODELS, default=MODELS)
    parser.add_argument("--docs", action="store_true", help="also write docs/benchmarks/hand_placed.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("planner", "profiling"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    text = markdown(rows(args.models))
    sys.stdout.write(text)
    if args.docs:
        publish_doc(text, "hand_placed", sys.argv, title="The planner against hand-placed plans (H100 profiles)",
                    about=ABOUT)


if __name__ == "__main__":
    main()
