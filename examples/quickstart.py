"""Optimize a small GPT-2 to half of its training-step memory and show before/after.

    python examples/quickstart.py [--model gpt2|residual_mlp] [--fraction 0.5]

Prints the unoptimized and optimized peak (measured at the allocator), the planner's
prediction, and the overhead in FLOPs and step time (interleaved repeats, median ratio).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from models import gpt2, residual_mlp  # noqa: E402

from planner import optimize  # noqa: E402
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes, run_step  # noqa: E402

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "residual_mlp"), default="gpt2")
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the unoptimized peak")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")

    model, example = gpt2() if args.model == "gpt2" else residual_mlp()
    inputs = StepInputs.from_example(example)
    before = measure_step_peak_bytes(model, inputs)
    budget_gb = before * args.fraction / 2**30
    print(f"unoptimized step peak: {before / MIB:.1f} MiB; planning for {budget_gb * 1024:.1f} MiB")

    opt = optimize(model, example, budget_gb=budget_gb)
    after = measure_step_peak_bytes(opt, inputs)
    extra_flops = measure_step_flops(opt, inputs) - measure_step_flops(model, inputs)
    ratios = []
    for _ in range(args.repeats):
        # gradients cleared before each step, as a training loop's zero_grad(set_to_none=True)
        # does: gradients left from the step before would make the optimized module re-plan
        # for gradient accumulation, and time another plan than the one printed below
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        run_step(model, inputs)
        t1 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        run_step(opt, inputs)
        ratios.append((time.perf_counter() - t2) / (t1 - t0))
    model.zero_grad(set_to_none=True)

    print()
    print(opt.plan.summary())
    print()
    print(f"measured peak   before {before / MIB:8.1f} MiB   after {after / MIB:8.1f} MiB "
          f"({after / before:.0%}; predicted {opt.plan.predicted_peak_bytes / MIB:.1f} MiB)")
    print(f"extra FLOPs     {extra_flops:.3e} per step (FlopCounterMode)")
    print(f"step time       {statistics.median(ratios):.2f}x the unoptimized step (median of {args.repeats})")
    if after > opt.plan.budget_bytes:
        raise SystemExit("measured peak is over the budget")


if __name__ == "__main__":
    main()
