"""Predicted step overhead with and without offload to host memory, on the H100 profiles.

For each profile in ``tests/data/h100/`` (measured on an NVIDIA H100; its README says how) and
two budgets, checkpoint-every-layer's simulated peak and half the unoptimized simulated peak,
the table compares the predicted extra step time of:

- *recompute only*: the default ``solve`` (infeasible where no plan of segments fits);
- *with offload*: ``solve(..., offload=True)``: the solve's offload step
  (:mod:`planner.solvers.starts.offload`) compares that plan, the offload start around it (or
  around the smallest-peak plan where none fits) and every layer with every held output
  offloaded, by predicted extra step time;
- *offload all boundaries*: checkpoint every layer and offload every output the step holds
  from the forward to the backward (the layers' inputs and what the head and loss save: what
  HF/Accelerate's ``save_on_cpu`` around gradient checkpointing does), replayed with its copies.

over two host links (:data:`planner.core.offload.HOST_LINKS`): an H100 over PCIe (50 GB/s each
way) and a GH200 (400 GB/s host-to-device, 170 device-to-host). Every figure is the simulator's
prediction from the profiles' node times: nothing here ran on a GPU. Deterministic.

    python benchmarks/offload.py [--models ...] [--docs]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import H100_PROFILES  # noqa: E402
from publish import markdown_table, publish_doc  # noqa: E402

from planner.core.costgraph import CostGraph, protect_reads_before_writes  # noqa: E402
from planner.core.errors import InfeasibleBudgetError  # noqa: E402
from planner.core.offload import HOST_LINKS, OffloadSpec, offloadable_nodes, simulate_offload  # noqa: E402
from planner.core.plan import Plan  # noqa: E402
from planner.core.simulate import simulate  # noqa: E402
from planner.solvers.hand_policies import hand_placed_plans  # noqa: E402
from planner.solvers.solve import solve  # noqa: E402
from profiling.cache import load_profile  # noqa: E402

MODELS = ["gpt2_gpu", "llama_gpu", "bert_gpu", "t5_gpu", "mlp_gpu", "gpt2_24l_gpu"]
LINKS = ("h100", "gh200")
GIB = 2**30

log = logging.getLogger("benchmarks.offload")

ABOUT = """How to read it (every figure predicted by the simulator, none measured: no GPU ran it):

- *budget*: checkpoint-every-layer's simulated peak (*every layer*) or half the unoptimized
  simulated peak (*50 %*), with its share of the unoptimized peak.
- *link*: the host link the copies are priced with: `h100` is an H100 over PCIe Gen5 with a
  reused pinned pool, 50 GB/s each way; `gh200` is NVLink-C2C, 400 GB/s host-to-device and
  170 GB/s device-to-host (docs/tuning.md#host_links). A copy costs step time only where the
  compute waits for it; copies run on their own streams beside the compute.
- *recompute only*: the default solve's predicted extra step time (recompute), in ms and as a
  share of the profile's measured unoptimized step; *infeasible* where no plan of segments fits.
- *with offload*: `solve(..., offload=True)`: its offload step compares the plan of recompute,
  the offload start around it (around the smallest-peak plan where none fits) and every layer
  with every held output offloaded, by predicted extra time (recompute + copies the compute
  waits for); the bytes offloaded to pinned host memory, and the segments left; *infeasible*
  where no plan fits, with the smallest budget the solve names.
- *offload all boundaries*: every layer checkpointed and every held output offloaded (what
  HF/Accelerate's `save_on_cpu` around gradient checkpointing does): its extra time and its
  simulated peak as a share of the budget (*over* where above 1). The solve with offload never
  predicts more than it where it fits.
- *solve (s)*: this machine's seconds for the solve with offload."""


def _solved(graph: CostGraph, budget: int, **options: object) -> tuple[Plan | None, int | None]:
    """The solve's plan, or None and the smallest budget it names."""
    try:
        return solve(graph, budget, max_solve_s=60, **options), None
    except InfeasibleBudgetError as exc:
        return None, exc.min_feasible_bytes


def _ms(value: float, step_ms: float) -> str:
    return f"{value:.2f} ({value / step_ms:.1%})"


def rows(models: list[str], links: tuple[str, ...] = LINKS) -> list[list[str]]:
    table = []
    for name in models:
        graph = protect_reads_before_writes(load_profile(H100_PROFILES / f"{name}.json"))
        unoptimized = simulate(graph).peak_bytes
        every = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
        for label, budget in (("every layer", simulate(graph, every.segments).peak_bytes),
                              ("50 %", unoptimized // 2)):
            base, _ = _solved(graph, budget)
            for link in links:
                spec: OffloadSpec = HOST_LINKS[link]
                started = time.perf_counter()
                plan, smallest = _solved(graph, budget, offload=True, host_link=link)
                solve_s = time.perf_counter() - started
                everything = simulate_offload(graph, every.segments, list(offloadable_nodes(graph, every.segments)),
                                              spec)
                all_extra = every.recompute_ms + everything.exposed_ms
                over = everything.peak_bytes / budget
                table.append([
                    name, f"{label} ({budget / unoptimized:.3f})", link,
                    "infeasible" if base is None else _ms(base.extra_time_ms, graph.step_ms),
                    (f"infeasible (from {smallest / unoptimized:.3f})" if plan is None
                     else _ms(plan.extra_time_ms, graph.step_ms)),
                    "" if plan is None else f"{plan.recompute_ms:.2f} + {plan.exposed_transfer_ms:.2f}",
                    "" if plan is None else f"{plan.offloaded_bytes / GIB:.2f}",
                    "" if plan is None else str(len(plan.segments)),
                    _ms(all_extra, graph.step_ms), f"{over:.3f}" + (" over" if over > 1 else ""),
                    f"{solve_s:.1f}"])
                log.info("%s", table[-1])
    return table


def markdown(table: list[list[str]]) -> str:
    header = ["profile", "budget", "link", "recompute only: ms (of step)", "with offload: ms (of step)",
              "recompute + exposed copies (ms)", "offloaded (GiB)", "segments", "offload all boundaries: ms",
              "its peak / budget", "solve (s)"]
    return markdown_table(header, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=MODELS, default=MODELS)
    parser.add_argument("--links", nargs="*", choices=sorted(HOST_LINKS), default=list(LINKS))
    parser.add_argument("--docs", action="store_true", help="also write docs/benchmarks/offload.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("planner", "profiling"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    text = markdown(rows(args.models, tuple(args.links)))
    sys.stdout.write(text)
    if args.docs:
        publish_doc(text, "offload", sys.argv, title="Offload to host memory: predicted step overhead (H100 profiles)",
                    about=ABOUT)


if __name__ == "__main__":
    main()
