"""Planner quality against the bars: at checkpoint-every-layer's peak, and at half the peak.

For each model: the unoptimized step; checkpoint-every-layer (each repeated layer under
non-reentrant ``torch.utils.checkpoint``, what HuggingFace's ``gradient_checkpointing_enable()``
does, ``common.checkpoint_every_k``); and ``optimize`` (segments only, and ``selective=True``:
op-level kept outputs) with the budget set to (a) every-layer's measured peak, (b) on the
transformers, the measured peak of the save-matmuls policy on every layer (matmul and attention
outputs kept, the rest recomputed: ``common.checkpoint_every_k(..., save_matmuls=True)``, the
hand-written policy of torchtitan and Megatron) and (c) 50 % of the measured unoptimized peak. A budget no plan reaches is planned at the smallest feasible
budget instead (marked). Peak at the allocator, extra FLOPs from FlopCounterMode, step time as
a ratio to the unoptimized step (interleaved repeats in one process, median).

Bars: at every-layer's peak, extra step time at most 60 % of every-layer's extra time and
extra FLOPs at most 70 % of its extra FLOPs; at 50 %, extra step time at most 10 %; every
measured peak within its budget. Each plan row also gives the planner's predicted overhead
and ``planner.bounds.covering.recompute_lower_bound_ms`` for its budget, both in the profile's time
(sum of per-node forward times over the profiled step), on the graph the planner plans (reads
protected from later in-place writes): no plan, kept outputs included, can predict less than
the bound. At every-layer's peak the verdict also gives the bound as a share
of every-layer's recompute in the same time (the forward time of the layers' nodes): above 60 %
the time bar is out of reach of any plan by the simulator's account.

    python benchmarks/quality.py [--models gpt2 llama bert mlp gpt2_768] [--repeats 7] [--docs]
    python benchmarks/quality.py --device cuda [--docs]     # on a GPU: the *_gpu models, CUDA events
    python benchmarks/quality.py --exact [--models mlp]     # plans with exact=True, to quality_exact.*
    python benchmarks/quality.py --simplify-attention-masks  # also rows "planner, masks simplified"

``--docs`` also writes the table to ``docs/benchmarks/quality.md`` (``quality_cuda.md`` on a GPU,
``*_exact.md`` with ``--exact``; ``--name`` sets another file name).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common import (GIB, MIB, ROOT, add_docs_argument, benchmark_logging, checkpoint_every_k, find_layers,
                    isolated_profile_cache, publish_doc, step_time_ratios, to_device)
from models import bert, gpt2, llama, residual_mlp

from planner import InfeasibleBudgetError, optimize
from planner.bounds.covering import recompute_lower_bound_ms
from planner.core.costgraph import CostGraph, protect_reads_before_writes
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes

log = logging.getLogger("quality")

MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]] = {
    "gpt2": ("GPT2LMHeadModel, 4 layers, width 256, 4 heads, vocab 4096, batch 8 x 256", gpt2),
    "llama": ("LlamaForCausalLM, 4 layers, width 256, 4 heads, vocab 4096, batch 4 x 256", llama),
    "bert": ("BertForMaskedLM, 4 layers, width 256, 4 heads, vocab 4096, batch 8 x 256", bert),
    "mlp": ("residual MLP, 8 blocks, width 256, hidden 1024, dropout 0.1, batch 2048", residual_mlp),
    "gpt2_768": ("GPT2LMHeadModel at GPT-2 small's width: 4 layers, width 768, 12 heads, vocab 8192, batch 4 x 256",
                 lambda: gpt2(batch=4, width=768, heads=12, vocab=8192)),
}
#: GPU-sized models (``--device cuda``): big enough that kernels, not launches, set the step time.
GPU_MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]] = {
    "gpt2_gpu": ("GPT2LMHeadModel at GPT-2 small's size: 6 layers, width 768, 12 heads, vocab 50257, "
                 "batch 8 x 1024", lambda: gpt2(batch=8, seq_len=1024, layers=6, width=768, heads=12, vocab=50257)),
    "llama_gpu": ("LlamaForCausalLM, 6 layers, width 1024, 16 heads, vocab 32000, batch 4 x 1024",
                  lambda: llama(batch=4, seq_len=1024, layers=6, width=1024, heads=16, vocab=32000)),
    "bert_gpu": ("BertForMaskedLM at BERT base's width: 6 layers, width 768, 12 heads, vocab 30522, batch 8 x 512",
                 lambda: bert(batch=8, seq_len=512, layers=6, width=768, heads=12, vocab=30522)),
    "mlp_gpu": ("residual MLP, 8 blocks, width 256, hidden 1024, dropout 0.1, batch 65536",
                lambda: residual_mlp(batch=65536)),
}
ALL_MODELS = {**MODELS, **GPU_MODELS}
#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

For each model: the unoptimized step (`none`); checkpoint-every-layer (`every layer`: each
repeated layer under non-reentrant `torch.utils.checkpoint`, what HuggingFace's
`gradient_checkpointing_enable()` does); on the transformers the save-matmuls policy on every
layer (`every layer, matmuls saved`: matmul and attention outputs kept, the rest recomputed, as
torchtitan and Megatron write it); and `optimize` with segments only (`planner`) and with
`selective=True` (`planner, selective`: outputs kept op by op), with the budget at
every-layer's measured peak, at the save-matmuls policy's measured peak and at 50 % of the
unoptimized peak. A budget below every plan the
planner finds is planned at the smallest feasible budget instead, marked "smallest feasible".

- **measured peak**: peak training-step memory at the allocator (CPU: profiler memory events;
  CUDA: `max_memory_allocated`), with its fraction of the unoptimized peak in parentheses.
- **extra FLOPs**: `FlopCounterMode`, optimized step minus unoptimized step, over the
  unoptimized step.
- **step time**: ratio to the unoptimized step, interleaved repeats in one process, median
  (CUDA events on a GPU). On a shared machine differences of a few percent are noise.
- **predicted overhead**: the plan's predicted recompute time over the profiled step (the
  profile's summed node times).
- **lower bound**: the covering bound of `planner/bounds/covering.py` at that budget, in the same terms:
  no plan, kept outputs included, predicts less. [reach.md](reach.md) gives tighter bounds.
- **planner, masks simplified** (only where the page's command has `--simplify-attention-masks`):
  `optimize(..., simplify_attention_masks=True)`, segments only: attention calls take `is_causal`
  (or no mask) where the captured mask is a constant causal or all-visible one. It changes the
  kernels the step runs, so it is not the user's computation; the other rows are.
- **verdict**: the bars. At every-layer's peak, extra step time at most 60 % of every-layer's
  and extra FLOPs at most 70 % of every-layer's; at 50 %, extra step time at most 10 %. At
  every-layer's peak the verdict also gives the lower bound as a share of every-layer's own
  recompute time: above 60 %, no plan meets the time bar by the profile's account; and whether
  the plan steps no slower than every layer. At the save-matmuls policy's peak: whether the
  plan steps no slower than that policy.

The `every layer` rows stand for HuggingFace's one line: on the CPU table's GPT-2, Llama and
BERT configurations the two peak at the same byte (`tests/test_benchmark_helpers.py` checks the
peaks on small configurations).
"""


@dataclasses.dataclass
class PlanRow:
    model: str
    target: str  # "every-layer peak" or "50 %"
    method: str  # "planner", "planner, selective" or "planner, masks simplified"
    budget_bytes: int
    planned_at_minimum: bool
    peak_bytes: int
    extra_flops: int
    predicted_overhead: float
    lower_bound_overhead: float
    lower_bound_ms: float
    solve_s: float
    step_time: float = float("nan")


@dataclasses.dataclass
class ModelResult:
    name: str
    base_peak_bytes: int
    base_flops: int
    every_peak_bytes: int
    every_extra_flops: int
    #: every-layer's recompute in the profile's time: the forward time of the layers' nodes
    every_recompute_ms: float = float("nan")
    every_step_time: float = float("nan")
    #: the save-matmuls policy on every layer (transformers only)
    save_matmuls_peak_bytes: int | None = None
    save_matmuls_extra_flops: int = 0
    save_matmuls_step_time: float = float("nan")
    rows: list[PlanRow] = dataclasses.field(default_factory=list)


def _planned(model: torch.nn.Module, example: Any, budget_bytes: int, selective: bool,
             cache_dir: str, exact: bool | None = None,
             simplify_attention_masks: bool = False) -> tuple[torch.nn.Module, bool]:
    options = dict(selective=selective, cache_dir=cache_dir, exact=exact,
                   simplify_attention_masks=simplify_attention_masks)
    try:
        return optimize(model, example, budget_gb=budget_bytes / GIB, **options), False
    except InfeasibleBudgetError as exc:
        log.info("%d bytes infeasible; planning at the smallest feasible budget %d", budget_bytes,
                 exc.min_feasible_bytes)
        return optimize(model, example, budget_gb=exc.min_feasible_bytes / GIB, **options), True


#: the method label of each (selective, simplify_attention_masks) planning
METHODS = {(False, False): "planner", (True, False): "planner, selective",
           (False, True): "planner, masks simplified"}


def layers_forward_ms(graph: CostGraph, layers_name: str) -> float:
    """Forward time of the nodes inside the repeated layers ``layers_name`` (what
    checkpoint-every-layer recomputes), in the profile's time."""
    return sum(n.time_ms for n in graph.compute_nodes if n.module.startswith(f"{layers_name}."))


def run_model(name: str, repeats: int, cache_dir: str, device: torch.device, exact: bool | None = None,
              simplify_attention_masks: bool = False) -> ModelResult:
    model, example = to_device(*ALL_MODELS[name][1](), device)
    inputs = StepInputs.from_example(example)
    every = checkpoint_every_k(model, 1)
    save_matmuls = checkpoint_every_k(model, 1, save_matmuls=True) if _is_transformer(name) else None
    layers_name, _ = find_layers(model)
    base_peak = measure_step_peak_bytes(model, inputs)
    base_flops = measure_step_flops(model, inputs)
    result = ModelResult(name, base_peak, base_flops, measure_step_peak_bytes(every, inputs),
                         measure_step_flops(every, inputs) - base_flops)
    modules: list[torch.nn.Module] = [model, every]
    targets = [("every-layer peak", result.every_peak_bytes), ("50 %", base_peak // 2)]
    if save_matmuls is not None:
        result.save_matmuls_peak_bytes = measure_step_peak_bytes(save_matmuls, inputs)
        result.save_matmuls_extra_flops = measure_step_flops(save_matmuls, inputs) - base_flops
        modules.append(save_matmuls)
        targets.insert(1, ("save-matmuls peak", result.save_matmuls_peak_bytes))
    methods = [(False, False), (True, False)]
    if simplify_attention_masks and _is_transformer(name):
        methods.append((False, True))
    for target, budget in targets:
        for selective, simplified in methods:
            started = time.perf_counter()
            opt, at_minimum = _planned(model, example, budget, selective, cache_dir, exact, simplified)
            plan, graph = opt.plan, opt.cost_graph
            if not simplified:  # every layer recomputes the user's computation
                result.every_recompute_ms = layers_forward_ms(graph, layers_name)
            bound_ms = recompute_lower_bound_ms(protect_reads_before_writes(graph), int(plan.budget_bytes * 0.99))
            result.rows.append(PlanRow(
                model=name, target=target, method=METHODS[(selective, simplified)],
                budget_bytes=plan.budget_bytes, planned_at_minimum=at_minimum,
                peak_bytes=measure_step_peak_bytes(opt, inputs),
                extra_flops=measure_step_flops(opt, inputs) - base_flops,
                predicted_overhead=plan.overhead_ratio, lower_bound_overhead=bound_ms / graph.step_ms,
                lower_bound_ms=bound_ms,
                solve_s=time.perf_counter() - started))
            modules.append(opt)
            log.info("%s %s %s: planned", name, target, METHODS[(selective, simplified)])
    ratios = step_time_ratios(modules, inputs, repeats, device)
    result.every_step_time = ratios[1]
    anchors = 2
    if save_matmuls is not None:
        result.save_matmuls_step_time = ratios[2]
        anchors = 3
    for row, ratio in zip(result.rows, ratios[anchors:]):
        row.step_time = ratio
    return result


def _is_transformer(name: str) -> bool:
    """Whether the save-matmuls policy is an anchor of the model (its layers have attention)."""
    return not name.startswith("mlp")


def _verdicts(result: ModelResult, row: PlanRow) -> list[str]:
    out = [] if row.peak_bytes <= row.budget_bytes else ["OVER BUDGET"]
    if row.target == "save-matmuls peak":
        anchor = result.save_matmuls_step_time
        out.append(f"time {row.step_time:.2f}x against the policy's {anchor:.2f}x: "
                   f"{'no slower' if row.step_time <= anchor else 'slower'}")
        return out
    if row.target == "50 %":
        extra = row.step_time - 1
        out.append(f"time +{extra:.1%} {'<=' if extra <= 0.10 else '>'} 10 %: {'met' if extra <= 0.10 else 'missed'}")
        return out
    every_time, every_flops = result.every_step_time - 1, result.every_extra_flops
    time_share = (row.step_time - 1) / every_time if every_time > 0 else float("nan")
    flop_share = row.extra_flops / every_flops if every_flops > 0 else float("nan")
    bound_share = row.lower_bound_ms / result.every_recompute_ms if result.every_recompute_ms > 0 else float("nan")
    out.append(f"time {time_share:.0%} of every-layer's (bar 60 %; lower bound {bound_share:.0%}): "
               f"{'met' if time_share <= 0.6 else 'missed'}")
    out.append(f"FLOPs {flop_share:.0%} (bar 70 %): {'met' if flop_share <= 0.7 else 'missed'}")
    out.append(f"{'no slower' if row.step_time <= result.every_step_time else 'slower'} than every layer")
    return out


def markdown(results: list[ModelResult], repeats: int, where: str, wall_s: float) -> str:
    lines = [
        f"{where}, torch {torch.__version__}, {repeats} interleaved timing repeats, "
        f"wall time {wall_s / 60:.1f} min.",
        "",
        "| model | target | method | budget | measured peak | extra FLOPs | step time | predicted overhead "
        "| lower bound | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.name} | - | none | - | {r.base_peak_bytes / MIB:.1f} MiB | 0 | 1.00x | - | - | - |")
        lines.append(f"| {r.name} | - | every layer | - | {r.every_peak_bytes / MIB:.1f} MiB "
                     f"({r.every_peak_bytes / r.base_peak_bytes:.2f}) | +{r.every_extra_flops / r.base_flops:.1%} "
                     f"| {r.every_step_time:.2f}x | - | - | - |")
        if r.save_matmuls_peak_bytes is not None:
            lines.append(f"| {r.name} | - | every layer, matmuls saved | - | {r.save_matmuls_peak_bytes / MIB:.1f} MiB "
                         f"({r.save_matmuls_peak_bytes / r.base_peak_bytes:.2f}) "
                         f"| +{r.save_matmuls_extra_flops / r.base_flops:.1%} | {r.save_matmuls_step_time:.2f}x "
                         f"| - | - | - |")
        for row in r.rows:
            budget = f"{row.budget_bytes / MIB:.1f} MiB" + (" (smallest feasible)" if row.planned_at_minimum else "")
            lines.append(
                f"| {r.name} | {row.target} | {row.method} | {budget} | {row.peak_bytes / MIB:.1f} MiB "
                f"({row.peak_bytes / r.base_peak_bytes:.2f}) | +{row.extra_flops / r.base_flops:.1%} "
                f"| {row.step_time:.2f}x | +{row.predicted_overhead:.1%} | +{row.lower_bound_overhead:.1%} "
                f"| {'; '.join(_verdicts(r, row))} |")
    lines.append("")
    lines.append("Models: " + "; ".join(f"**{r.name}**: {ALL_MODELS[r.name][0]}" for r in results) + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(ALL_MODELS),
                        help="default: the CPU models, or the *_gpu ones with --device cuda")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1: steadier timings)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    parser.add_argument("--exact", action="store_true",
                        help="plan with optimize(..., exact=True); written to quality[_cuda]_exact.*")
    parser.add_argument("--simplify-attention-masks", action="store_true",
                        help="on the transformers, also plan with optimize(..., simplify_attention_masks=True): "
                             "rows labelled 'planner, masks simplified'")
    parser.add_argument("--name", default=None,
                        help="file name (no suffix) of the results and the docs page "
                             "(default quality, quality_cuda, with _exact after --exact)")
    args = parser.parse_args()
    benchmark_logging()
    isolated_profile_cache()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    models = args.models or list(GPU_MODELS if device.type == "cuda" else MODELS)
    where = (f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"CPU, {args.threads} thread(s)")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results: list[ModelResult] = []
    with tempfile.TemporaryDirectory(prefix="quality-profiles-") as cache_dir:
        for name in models:
            results.append(run_model(name, args.repeats, cache_dir, device, exact=True if args.exact else None,
                                     simplify_attention_masks=args.simplify_attention_masks))
            log.info("%s done at %.0f s", name, time.perf_counter() - started)
    import pandas

    rows = [{**dataclasses.asdict(row), "every_step_time": r.every_step_time, "every_peak_bytes": r.every_peak_bytes,
             "every_extra_flops": r.every_extra_flops, "base_peak_bytes": r.base_peak_bytes,
             "base_flops": r.base_flops} for r in results for row in r.rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("quality" if device.type == "cpu" else "quality_cuda") + ("_exact" if args.exact else "")
    pandas.DataFrame(rows).to_csv(args.out / f"{stem}.csv", index=False)
    text = markdown(results, args.repeats, where + (", exact=True" if args.exact else ""), time.perf_counter() - started)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    if args.docs:
        title = ("Quality on CPU" if device.type == "cpu" else "Quality on a GPU") + (
            ", exact=True" if args.exact else "") + ": at checkpoint-every-layer's peak, at the save-matmuls policy's and at half the peak"
        publish_doc(text, stem, sys.argv, title=title, about=DOC_ABOUT)


if __name__ == "__main__":
    main()
