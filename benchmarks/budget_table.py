"""Measure optimize() at 70 %, 50 % and 35 % of each example model's unoptimized peak.

For each model and budget: the optimized step's peak at the allocator (CPU: profiler memory
events), the planner's predicted peak, extra FLOPs from FlopCounterMode (optimized step minus
unoptimized step), step time as a ratio to the unoptimized step (interleaved repeats, median),
and whether loss and every gradient are bitwise equal to the unoptimized model's.

    python benchmarks/budget_table.py            # markdown table on stdout
    python benchmarks/budget_table.py --csv out.csv
    python benchmarks/budget_table.py --docs     # also docs/benchmarks/budget_table.md
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from common import (MIB, add_docs_argument, isolated_profile_cache, publish_doc, step_time_ratios,  # noqa: E402
                    tee_stdout)
from models import gpt2, residual_mlp  # noqa: E402

from planner import optimize  # noqa: E402
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes  # noqa: E402
from profiling.measure import loss_of  # noqa: E402

MODELS = {"residual_mlp": residual_mlp, "gpt2_4layer": gpt2}

#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

Models (`examples/models.py`): `residual_mlp`, an 8-block residual MLP (width 256, hidden 1024,
dropout 0.1, batch 2048), and `gpt2_4layer`, HuggingFace `GPT2LMHeadModel` from a configuration
(4 layers, width 256, 4 heads, vocab 4096, dropout on, `use_cache=False`, batch 8 x 256).
Budgets are fractions of the measured unoptimized peak; each is planned with `optimize` at its
defaults.

- **measured peak**: the optimized step's peak at the allocator (CPU profiler memory events);
  **predicted peak**: the plan's simulated peak; **error**: predicted over measured, minus 1.
- **extra FLOPs**: `FlopCounterMode`, optimized step minus unoptimized step (and its share of
  the unoptimized step). It equals the plan's predicted `recompute_flops` exactly; the
  end-to-end tests require it.
- **step time**: ratio to the unoptimized step, interleaved repeats, median. On a shared
  machine differences of a few percent are noise.
- **bitwise equal grads**: loss and every gradient bitwise equal to the unoptimized model's,
  dropout included.
"""


def grads_and_loss(module: torch.nn.Module, owner: torch.nn.Module, inputs: StepInputs, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(*inputs.args, **inputs.kwargs)
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}
    owner.zero_grad(set_to_none=True)
    return loss.detach().clone(), grads


def bitwise_equal(model: torch.nn.Module, opt: torch.nn.Module, inputs: StepInputs) -> bool:
    loss_a, grads_a = grads_and_loss(model, model, inputs, seed=1234)
    loss_b, grads_b = grads_and_loss(opt, model, inputs, seed=1234)
    return torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and all(
        torch.equal(grads_a[n], grads_b[n]) for n in grads_a
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.7, 0.5, 0.35])
    parser.add_argument("--selective", action="store_true",
                        help="let the planner keep outputs inside segments, op by op (optimize(selective=True))")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats")
    parser.add_argument("--csv", type=Path, help="also write the rows to this CSV file")
    add_docs_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    isolated_profile_cache()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name in args.models:
        model, example = MODELS[name]()
        inputs = StepInputs.from_example(example)
        base_peak = measure_step_peak_bytes(model, inputs)
        base_flops = measure_step_flops(model, inputs)
        for fraction in args.fractions:
            budget_gb = base_peak * fraction / 2**30
            t0 = time.perf_counter()
            opt = optimize(model, example, budget_gb=budget_gb, selective=args.selective)
            optimize_s = time.perf_counter() - t0
            peak = measure_step_peak_bytes(opt, inputs)
            extra_flops = measure_step_flops(opt, inputs) - base_flops
            rows.append({
                "model": name,
                "budget_fraction": fraction,
                "budget_mib": budget_gb * 1024,
                "unoptimized_peak_mib": base_peak / MIB,
                "measured_peak_mib": peak / MIB,
                "predicted_peak_mib": opt.plan.predicted_peak_bytes / MIB,
                "prediction_error": opt.plan.predicted_peak_bytes / peak - 1,
                "within_budget": peak <= opt.plan.budget_bytes,
                "extra_flops": extra_flops,
                "extra_flops_fraction": extra_flops / base_flops,
                "planned_extra_flops": opt.plan.recompute_flops,
                "step_time_ratio": step_time_ratios([model, opt], inputs, args.repeats)[1],
                "segments": len(opt.plan.segments),
                "optimize_s": optimize_s,
                "bitwise_equal": bitwise_equal(model, opt, inputs),
            })
            print(f"# {name} at {fraction:.0%}: measured {peak / MIB:.1f} MiB, "
                  f"predicted {opt.plan.predicted_peak_bytes / MIB:.1f} MiB", file=sys.stderr, flush=True)
    import pandas

    frame = pandas.DataFrame(rows)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    with tee_stdout() as printed:
        print("| model | budget | unoptimized peak | measured peak | predicted peak | error | within budget "
              "| extra FLOPs | step time | bitwise equal grads |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['budget_fraction']:.0%} = {r['budget_mib']:.1f} MiB "
                  f"| {r['unoptimized_peak_mib']:.1f} MiB | {r['measured_peak_mib']:.1f} MiB "
                  f"| {r['predicted_peak_mib']:.1f} MiB | {r['prediction_error']:+.1%} "
                  f"| {'yes' if r['within_budget'] else 'NO'} "
                  f"| {r['extra_flops']:.3g} (+{r['extra_flops_fraction']:.1%}) | {r['step_time_ratio']:.2f}x "
                  f"| {'yes' if r['bitwise_equal'] else 'NO'} |")
    if args.docs:
        publish_doc(printed.getvalue(), "budget_table", sys.argv,
                    title="optimize() at 70, 50 and 35 % of the peak", about=DOC_ABOUT)


if __name__ == "__main__":
    main()
