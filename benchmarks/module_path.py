"""Graph path against module path against checkpoint-every-layer, measured on CPU.

For each model, at checkpoint-every-layer's measured peak (what HuggingFace's
``gradient_checkpointing_enable()`` reaches) and at half the unoptimized peak: the plan of the
graph path (``optimize``, the captured graph), the plan of the module path
(``optimize(..., trace_method="modules")``, what a model that cannot be captured gets) and every
layer checkpointed. Each is measured: peak at the allocator, extra FLOPs over the unoptimized
step, and step time as a ratio to the unoptimized step (interleaved repeats in one process,
median). A budget a path cannot meet is planned at the smallest budget it names (marked ``*``).

    python benchmarks/module_path.py --docs
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (GIB, MIB, benchmark_logging, checkpoint_every_k, publish_table,  # noqa: E402
                    step_time_ratios, table_arguments)

import models as example_models  # noqa: E402
from planner import optimize  # noqa: E402
from planner.core.errors import InfeasibleBudgetError  # noqa: E402
from profiling import StepInputs  # noqa: E402
from profiling.measure import measure_step_flops, measure_step_peak_bytes  # noqa: E402

log = logging.getLogger("benchmarks.module_path")

MODELS = {
    "gpt2": ("GPT-2, 4 layers, width 256", lambda: example_models.gpt2()),
    "llama": ("Llama, 4 layers", lambda: example_models.llama()),
    "mlp": ("residual MLP, 8 blocks", lambda: example_models.residual_mlp()),
}

DOC_ABOUT = """\
How to read it:

- "budget" is the target: every-layer's own measured peak, or half the unoptimized peak. A path
  that cannot meet it is planned at the smallest budget it names (`*`); every measured peak is
  within the budget its plan was made for.
- The module path checkpoints whole submodule calls (for these models, the repeated layers and
  the modules beside them), so it cannot recompute part of a layer the way the graph path can:
  at the same budget it recomputes as many FLOPs as the graph path or more (GPT-2 at half the
  peak: +19.4 % against +1.9 %), and its floor is the lowest peak of a plan of whole units (on
  these models, about every-layer's peak).
- Step times are medians of interleaved repeats on a shared 2-core machine; differences of 10 to
  20 points are noise there (every-layer's own column moves from 1.40x to 1.54x between the two
  GPT-2 rows, where it runs the same plan). Compare FLOPs for the cost of a plan.
"""


@dataclasses.dataclass
class Row:
    model: str
    target: str
    budget_bytes: int
    cells: dict[str, tuple[int, float, float, bool]]  # method -> (peak bytes, extra FLOPs ratio, step ratio, at min)


def _plan(model: torch.nn.Module, example: Any, budget_bytes: int, method: str) -> tuple[torch.nn.Module, bool]:
    try:
        return optimize(model, example, budget_gb=budget_bytes / GIB, trace_method=method), False
    except InfeasibleBudgetError as exc:
        log.info("%s: %d bytes infeasible, planning at %d", method, budget_bytes, exc.min_feasible_bytes)
        return optimize(model, example, budget_gb=exc.min_feasible_bytes / GIB, trace_method=method), True


def run_model(name: str, repeats: int) -> tuple[int, list[Row]]:
    label, build = MODELS[name]
    model, example = build()
    inputs = StepInputs.from_example(example)
    every = checkpoint_every_k(model, 1)
    base_peak = measure_step_peak_bytes(model, inputs)
    base_flops = measure_step_flops(model, inputs)
    every_peak = measure_step_peak_bytes(every, inputs)
    every_flops = measure_step_flops(every, inputs) / base_flops - 1
    rows = []
    for target, budget in (("every-layer peak", every_peak), ("50 %", base_peak // 2)):
        planned = {method: _plan(model, example, budget, method) for method in ("export", "modules")}
        modules = [model, every, *(opt for opt, _ in planned.values())]
        ratios = step_time_ratios(modules, inputs, repeats)
        cells = {"every layer": (every_peak, every_flops, ratios[1], False)}
        for (method, (opt, at_min)), ratio in zip(planned.items(), ratios[2:]):
            assert opt.plan.capture == ("graph" if method == "export" else "modules")
            cells[method] = (measure_step_peak_bytes(opt, inputs), measure_step_flops(opt, inputs) / base_flops - 1,
                             ratio, at_min)
        rows.append(Row(label, target, budget, cells))
        log.info("%s at %s: done", name, target)
    return base_peak, rows


def markdown(results: list[tuple[int, list[Row]]], repeats: int) -> str:
    lines = ["| model | unoptimized peak | budget | every layer: peak / FLOPs / step | graph path: peak / FLOPs / "
             "step | module path: peak / FLOPs / step |", "|---|---|---|---|---|---|"]
    for base_peak, rows in results:
        for row in rows:
            cells = []
            for method in ("every layer", "export", "modules"):
                peak, flops, step, at_min = row.cells[method]
                cells.append(f"{peak / MIB:.1f} MiB{'*' if at_min else ''} / +{flops:.1%} / {step:.2f}x")
            lines.append(f"| {row.model} | {base_peak / MIB:.1f} MiB | {row.target} ({row.budget_bytes / MIB:.1f} MiB) | "
                         + " | ".join(cells) + " |")
    lines += ["", f"CPU, torch {torch.__version__}, {repeats} interleaved repeats, median step-time ratio to the "
                  f"unoptimized step. `*`: planned at the smallest budget that path names."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser: argparse.ArgumentParser = table_arguments(__doc__.splitlines()[0], list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    results = [run_model(name, args.repeats) for name in args.models]
    doc = {"name": "module_path", "title": "Graph path, module path and every layer", "about": DOC_ABOUT}
    publish_table(markdown(results, args.repeats), args.out, "module_path.md", doc if args.docs else None)


if __name__ == "__main__":
    main()
