"""The floor the chunked output head and loss (``chunk_loss=True``) reaches on language models
whose loss sets the peak, on CPU.

For each model (HuggingFace GPT-2 and Llama from configs, vocabularies of 50,257 and 32,000):
the measured unoptimized peak; the smallest feasible budget without and with loss chunks (as
a share of that peak); the plan at the chunked floor, its measured peak against the budget; at the
plain floor, the plans without and with ``chunk_loss=True``, their measured peaks, and their
step times as ratios to the unoptimized step (interleaved repeats in one process, median);
and the largest relative difference of the loss and gradients of the chunked plan from the
unoptimized model's.

    python benchmarks/chunked_loss.py [--models gpt2 llama] [--repeats 5] [--docs]

``--docs`` also writes the table to ``docs/benchmarks/chunked_loss.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from common import GIB, MIB, add_docs_argument, benchmark_logging, publish_doc, step_time_ratios, tee_stdout
from models import gpt2, llama
from planner import optimize
from planner.core.errors import InfeasibleBudgetError
from planner.core.options import PlanOptions
from planner.pipeline import plan_for_budget
from profiling import StepInputs, measure_step_peak_bytes
from profiling.cache import cached_profile_graph
from profiling.measure import loss_of
from profiling.trace import trace_module
from rewrite.chunked_loss import LOSS_CHUNKS, chunk_loss

#: the models: builders of ``examples/models.py`` with a vocabulary large enough for the loss to set the peak
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, dict[str, Any]]]] = {
    "gpt2": lambda: gpt2(batch=4, seq_len=512, layers=2, width=128, heads=4, vocab=50257),
    "llama": lambda: llama(batch=4, seq_len=512, layers=2, width=128, heads=4, vocab=32000),
}

DOC_ABOUT = f"""\
## How to read it

Each model's head and loss run in `LOSS_CHUNKS` = {LOSS_CHUNKS} row chunks when chunked
(see [tuning.md](../tuning.md#loss_chunks)). Budgets and peaks are in MiB, measured at the CPU
allocator (`profiling.measure_step_peak_bytes`); shares are of the measured unoptimized peak.
"plain floor" is the smallest feasible budget without chunking, "chunked floor" with it. The step
times are ratios to the unoptimized step, median of interleaved repeats in one process (the
four modules of a row run in turn); "chunk-loss / plain" divides the two at the plain floor.
At the plain floor the planner with `chunk_loss=True` takes the chunks only where they cost
less than the plain plan's recompute; where it keeps the plain plan the two modules are the
same plan, and their ratio shows the timing noise. The last column is the largest relative
difference of the loss and of any gradient (max abs difference over max abs value) of the
chunked plan at the chunked floor from the unoptimized model's: within the rtol 1e-5 the tests
allow. The model returns its logits too, so one full logits tensor
stays in the step (the output holds it); chunking removes the other three (log-softmax,
and the two gradients) and the temporaries of the loss.
"""


def _floor_bytes(graph: Any) -> int:
    try:
        plan_for_budget(graph, 2**-20, PlanOptions())
    except InfeasibleBudgetError as exc:
        return exc.min_feasible_bytes
    raise AssertionError("a 1 KiB budget was feasible")


def _grads(module: torch.nn.Module, owner: torch.nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = loss_of(module(**inputs))
    loss.backward()
    out = [loss.detach()] + [p.grad.clone() for p in owner.parameters() if p.grad is not None]
    owner.zero_grad(set_to_none=True)
    return out


def _largest_relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(b, a))


def run(name: str, repeats: int, cache_dir: str) -> list[str]:
    model, inputs = MODELS[name]()
    step = StepInputs.from_example(inputs)
    unoptimized = measure_step_peak_bytes(model, step)
    plain_graph = cached_profile_graph(trace_module(model, inputs), inputs, cache_dir)
    chunked = trace_module(model, inputs)
    chunk_loss(chunked)
    plain_floor, chunked_floor = _floor_bytes(plain_graph), _floor_bytes(cached_profile_graph(chunked, inputs, cache_dir))
    at_chunked_floor = optimize(model, inputs, budget_gb=chunked_floor / GIB, chunk_loss=True, cache_dir=cache_dir)
    chunked_floor_peak = measure_step_peak_bytes(at_chunked_floor, step)
    plain = optimize(model, inputs, budget_gb=plain_floor / GIB, cache_dir=cache_dir)
    with_chunks = optimize(model, inputs, budget_gb=plain_floor / GIB, chunk_loss=True, cache_dir=cache_dir)
    peaks = [measure_step_peak_bytes(m, step) for m in (plain, with_chunks)]
    ratios = step_time_ratios([model, plain, with_chunks, at_chunked_floor], step, repeats)
    difference = _largest_relative_difference(_grads(model, model, inputs), _grads(at_chunked_floor, model, inputs))
    used = "chunks used" if with_chunks.plan.computation_changes else "chunks not used: the plain plan"
    return [name, f"{unoptimized / MIB:,.0f}",
            f"{plain_floor / MIB:,.0f} ({plain_floor / unoptimized:.2f})",
            f"{chunked_floor / MIB:,.0f} ({chunked_floor / unoptimized:.2f})",
            f"{chunked_floor_peak / MIB:,.0f} / {at_chunked_floor.plan.budget_bytes / MIB:,.0f}, {ratios[3]:.2f}x",
            f"{peaks[0] / MIB:,.0f}, {ratios[1]:.2f}x", f"{peaks[1] / MIB:,.0f}, {ratios[2]:.2f}x ({used})",
            f"{ratios[2] / ratios[1]:.2f}", f"{difference:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    header = ["model", "unoptimized peak", "plain floor (share)", "chunked floor (share)",
              "chunked floor, --chunk-loss: measured / budget, step", "plain floor, plain: peak, step",
              "plain floor, --chunk-loss: peak, step", "chunk-loss / plain step at plain floor",
              "loss, grads rel. diff at chunked floor"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunked-loss-") as cache_dir:
        for name in args.models:
            rows.append(run(name, args.repeats, cache_dir))
    with tee_stdout() as out:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print(f"\n{len(rows)} models in {time.perf_counter() - started:.0f} s, {args.threads} thread(s), "
              f"torch {torch.__version__}.")
    if args.docs:
        publish_doc(out.getvalue(), "chunked_loss", sys.argv,
                    title="The floor with the output head and loss in row chunks (CPU)", about=DOC_ABOUT)


if __name__ == "__main__":
    main()
