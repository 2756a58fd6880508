"""Models with graph breaks planned through them, measured on CPU.

For each model of ``benchmarks/graph_break_models.py`` (``torch.export`` cannot capture any of
them), ``optimize`` at 70 % and 50 % of the measured unoptimized peak and at the peak of every
layer checkpointed by hand (``torch.utils.checkpoint`` around the layer's body): the plan's
capture, its measured peak at the allocator, its extra FLOPs over the unoptimized step
(``FlopCounterMode``, forward plus backward) and whether its loss and every gradient equal the
unoptimized model's bit for bit (same seed: dropout, branches and NumPy calls alike). Then
HuggingFace GPT-2 at 50 %, planned on the captured graph and forced through the graph-break path
(``trace_method="graph-breaks"``): their extra FLOPs.

    python benchmarks/graph_breaks.py --docs
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GIB, MIB, benchmark_logging, publish_table, table_arguments  # noqa: E402
from graph_break_models import MODELS, build  # noqa: E402

import models as example_models  # noqa: E402
from planner import optimize  # noqa: E402
from profiling import StepInputs  # noqa: E402
from profiling.measure import loss_of, measure_step_flops, measure_step_peak_bytes  # noqa: E402

log = logging.getLogger("benchmarks.graph_breaks")

DOC_ABOUT = """\
How to read it:

- Every model breaks `torch.export` (the cause is in the second column); `optimize` then plans
  over the ATen ops its eager step dispatches (`plan.capture == "graph-breaks"`, with the
  number of stretches between breaks). A plan's segment may span a break: its recompute replays
  the recorded ops, not the Python between them.
- "every layer" is each layer's body under `torch.utils.checkpoint`, written by hand: its peak is
  the third budget of each model, its extra FLOPs the bar the plan must not exceed there.
- "bit for bit": the loss and every parameter gradient of one step equal the unoptimized
  model's (`torch.equal`), the same seed for both.
- GPT-2: the same model planned on its captured graph and forced through the graph-break path
  at half its peak; the two plans' extra FLOPs, measured. Both paths choose segments by measured
  node times, not FLOPs, so on a busy machine either figure moves by a few points of the step's
  FLOPs from run to run.
"""


@dataclasses.dataclass
class Row:
    model: str
    cause: str
    capture: str
    base_peak: int
    target: str
    budget_bytes: int
    peak_bytes: int
    extra_flops: float
    every_flops: float
    exact: bool


def _step_result(module: torch.nn.Module, example: Any, params: list[torch.nn.Parameter],
                 seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    inputs = StepInputs.from_example(example)
    loss = loss_of(module(*inputs.args, **inputs.kwargs))
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


def bit_for_bit(reference: torch.nn.Module, planned: torch.nn.Module, example: Any) -> bool:
    """Whether one step of ``planned`` gives ``reference``'s loss and gradients exactly (they
    share parameters: each step starts from no gradients, the same seed)."""
    params = list(reference.parameters())
    loss0, grads0 = _step_result(reference, example, params)
    loss1, grads1 = _step_result(planned, example, params)
    for p in params:
        p.grad = None
    return torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def run_model(name: str) -> list[Row]:
    model, example = build(name)
    inputs = StepInputs.from_example(example)
    base_peak = measure_step_peak_bytes(model, inputs)
    base_flops = measure_step_flops(model, inputs)
    every = copy.deepcopy(model)
    every.checkpoint_layers = True
    every_peak = measure_step_peak_bytes(every, inputs)
    every_flops = measure_step_flops(every, inputs) / base_flops - 1
    rows = []
    for target, budget in (("70 %", int(0.7 * base_peak)), ("50 %", base_peak // 2),
                           ("every-layer peak", every_peak)):
        opt = optimize(model, example, budget_gb=budget / GIB, timing_repeats=1)
        capture = f"{opt.plan.capture} ({opt.plan.subgraphs} subgraphs)" if opt.plan.capture == "graph-breaks" \
            else opt.plan.capture
        rows.append(Row(name, MODELS[name][1], capture, base_peak, target, budget,
                        measure_step_peak_bytes(opt, inputs), measure_step_flops(opt, inputs) / base_flops - 1,
                        every_flops, bit_for_bit(model, opt, example)))
        log.info("%s at %s: done", name, target)
    return rows


def run_gpt2() -> tuple[int, dict[str, tuple[str, int, float, bool]]]:
    """GPT-2 at half its peak on the graph path and forced through the graph-break path."""
    model, example = example_models.gpt2(batch=4, seq_len=128)
    inputs = StepInputs.from_example(example)
    base_peak = measure_step_peak_bytes(model, inputs)
    base_flops = measure_step_flops(model, inputs)
    out = {}
    for method in ("export", "graph-breaks"):
        opt = optimize(model, example, budget_gb=base_peak / 2 / GIB, trace_method=method)
        out[method] = (opt.plan.capture, measure_step_peak_bytes(opt, inputs),
                       measure_step_flops(opt, inputs) / base_flops - 1, bit_for_bit(model, opt, example))
        log.info("gpt2 %s: done", method)
    return base_peak, out


def markdown(rows: list[Row], gpt2: tuple[int, dict[str, tuple[str, int, float, bool]]] | None) -> str:
    lines = ["| model | breaks on | capture | unoptimized peak | budget | measured peak | extra FLOPs "
             "| every layer's extra FLOPs | bit for bit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "" if r.peak_bytes <= r.budget_bytes else " (OVER)"
        lines.append(f"| {r.model} | {r.cause} | {r.capture} | {r.base_peak / MIB:.1f} MiB | {r.target} "
                     f"({r.budget_bytes / MIB:.2f} MiB) | {r.peak_bytes / MIB:.2f} MiB{fits} | +{r.extra_flops:.1%} "
                     f"| +{r.every_flops:.1%} | {'yes' if r.exact else 'NO'} |")
    if gpt2 is not None:
        base_peak, out = gpt2
        lines += ["", "| GPT-2 (4 layers, width 256, batch 4 x 128), budget 50 % of "
                      f"{base_peak / MIB:.1f} MiB | capture | measured peak | extra FLOPs | bit for bit |",
                  "|---|---|---|---|---|"]
        for method, (capture, peak, flops, exact) in out.items():
            lines.append(f"| trace_method={method!r} | {capture} | {peak / MIB:.1f} MiB | +{flops:.2%} | "
                         f"{'yes' if exact else 'NO'} |")
        graph, breaks = out["export"][2], out["graph-breaks"][2]
        lines += ["", f"Graph-break path against graph path at 50 %: {breaks - graph:+.2%} of the step's FLOPs "
                      f"({(breaks - graph) / graph:+.1%} of the graph path's extra FLOPs)." if graph else ""]
    lines += ["", f"CPU, torch {torch.__version__}; peaks measured at the allocator, FLOPs with FlopCounterMode."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser: argparse.ArgumentParser = table_arguments(__doc__.splitlines()[0], list(MODELS))
    parser.add_argument("--no-gpt2", action="store_true", help="leave out the GPT-2 comparison")
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    rows = [row for name in args.models for row in run_model(name)]
    gpt2 = None if args.no_gpt2 else run_gpt2()
    doc = {"name": "graph_breaks", "title": "Planning through graph breaks", "about": DOC_ABOUT}
    publish_table(markdown(rows, gpt2), args.out, "graph_breaks.md", doc if args.docs else None)


if __name__ == "__main__":
    main()
