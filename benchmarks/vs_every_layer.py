"""This planner against HuggingFace's checkpoint-every-layer, at the same memory.

For each model: the unoptimized step, checkpoint-every-layer (each decoder/encoder layer under
non-reentrant ``torch.utils.checkpoint``, what HuggingFace's ``gradient_checkpointing_enable()``
does; ``benchmarks/common.checkpoint_every_k``), and ``optimize`` with the budget set to
every-layer's measured peak. Peak at the allocator, extra FLOPs from FlopCounterMode, step time
as a ratio to the unoptimized step (interleaved repeats, median, one process).

    python benchmarks/vs_every_layer.py [--models gpt2 llama bert] [--repeats 7]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from common import MIB, checkpoint_every_k, step_time_ratios  # noqa: E402
from models import bert, gpt2, llama  # noqa: E402

from planner import InfeasibleBudgetError, optimize  # noqa: E402
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes  # noqa: E402

MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--selective", action="store_true",
                        help="let the planner keep matmul outputs inside segments (optimize(selective=True))")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model, example = MODELS[name]()
        inputs = StepInputs.from_example(example)
        every = checkpoint_every_k(model, 1)  # what gradient_checkpointing_enable() does, without the deprecated call
        base_peak = measure_step_peak_bytes(model, inputs)
        base_flops = measure_step_flops(model, inputs)
        every_peak = measure_step_peak_bytes(every, inputs)
        every_flops = measure_step_flops(every, inputs) - base_flops
        try:
            opt = optimize(model, example, budget_gb=every_peak / 2**30, selective=args.selective)
        except InfeasibleBudgetError as exc:
            print(f"# {name}: planner cannot reach every-layer's peak: {exc}", file=sys.stderr)
            opt = optimize(model, example, budget_gb=exc.min_feasible_bytes / 2**30, selective=args.selective)
        opt_peak = measure_step_peak_bytes(opt, inputs)
        opt_flops = measure_step_flops(opt, inputs) - base_flops
        _, every_time, opt_time = step_time_ratios([model, every, opt], inputs, args.repeats)
        rows.append(dict(model=name, base=base_peak, every=every_peak, opt=opt_peak, budget=opt.plan.budget_bytes,
                         every_flops=every_flops, opt_flops=opt_flops, base_flops=base_flops,
                         every_time=every_time, opt_time=opt_time))
        print(f"# {name} done", file=sys.stderr, flush=True)
    print("| model | unoptimized peak | every-layer peak | planner budget = every-layer peak | planner measured peak "
          "| every-layer extra FLOPs | planner extra FLOPs | every-layer step time | planner step time "
          "| planner extra time / every-layer extra time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = (r["opt_time"] - 1) / (r["every_time"] - 1) if r["every_time"] > 1 else float("nan")
        print(f"| {r['model']} | {r['base'] / MIB:.1f} MiB | {r['every'] / MIB:.1f} MiB ({r['every'] / r['base']:.2f}x) "
              f"| {r['budget'] / MIB:.1f} MiB | {r['opt'] / MIB:.1f} MiB ({r['opt'] / r['base']:.2f}x) "
              f"| +{r['every_flops'] / r['base_flops']:.1%} | +{r['opt_flops'] / r['base_flops']:.1%} "
              f"| {r['every_time']:.2f}x | {r['opt_time']:.2f}x | {share:.0%} |")


if __name__ == "__main__":
    main()
