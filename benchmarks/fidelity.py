"""Profiler fidelity across the tracing matrix: predicted against measured peak, unoptimized and at 50 %.

For each model: capture, profile (measured mode, CPU), predict the unoptimized peak with the
simulator and measure it at the allocator (CPU profiler memory events); plan at 50 % of the
measured peak through ``optimize`` (the profile comes from the cache, not a second run), and
measure the optimized step; the same at checkpoint-every-layer's measured peak. Also the fake-tensor profile's unoptimized prediction (tensor sizes
only, no op temporaries) against the same measurement. With ``--xl``, a GPT-2-XL-sized model on
the meta device is planned on fake tensors for an 80 GB H100.

    python benchmarks/fidelity.py --csv benchmarks/fidelity.csv      # markdown table on stdout
    python benchmarks/fidelity.py --models gpt2 cnn_batchnorm --xl
    python benchmarks/fidelity.py --xl --docs                          # also docs/benchmarks/fidelity.md
"""

from __future__ import annotations

import argparse
import csv
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

from common import checkpoint_every_k, find_layers  # noqa: E402
from planner import simulate  # noqa: E402
from planner.core.errors import InfeasibleBudgetError  # noqa: E402
from planner.pipeline import PlanOptions, optimize, plan_for_budget  # noqa: E402
from profiling import StepInputs, measure_step_peak_bytes, profile_graph, trace_module  # noqa: E402
from publish import publish_doc, tee_stdout  # noqa: E402

MIB = 2**20
GIB = 2**30

#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

Every builder of the tracing matrix (`examples/models.py`) at the benchmark's sizes (6 layers,
width 128 for the transformers; see `MODELS` in `benchmarks/fidelity.py`), on CPU with one
intra-op thread. "unoptimized predicted" is the simulator's peak on the measured profile;
"measured (model)" the allocator's peak (CPU profiler memory events) for the user's own
module, "measured (captured graph)" for the captured graph. The budget is half the measured
unoptimized peak, planned through `optimize` (the profile read from the cache); "plan
predicted" and "measured" are the plan's simulated peak and the optimized module's peak at the
allocator. The plan at checkpoint-every-layer's measured peak (the budget HuggingFace's
`gradient_checkpointing_enable()` reaches, from the same cache) is measured the same way; a
budget the prediction refuses by at most 3 % is met on measurement where a candidate plan fits
(`planner/measured_fit.py`), marked so. The last column is the fake-tensor profile's unoptimized prediction (tensor sizes
and estimated op temporaries, nothing allocated) against the same measurement. Errors are
predicted over measured, minus 1: positive is over-predicted, the safe side.

With `--xl`, the line above the table plans a GPT-2-XL-sized model (built on the meta device)
on fake tensors for an 80 GB H100 (a budget of 80e9 bytes, 74.5 GiB; op times from the H100
roofline, 16 first stages), and reports its wall time and the process's peak resident memory.
"""

MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]] = {
    "gpt2": ("GPT2LMHeadModel, 6 layers, width 128, 4 x 128 tokens",
             lambda: models.gpt2(batch=4, seq_len=128, layers=6, width=128, vocab=1024)),
    "llama": ("LlamaForCausalLM, 6 layers, width 128, 4 x 128 tokens",
              lambda: models.llama(batch=4, seq_len=128, layers=6, width=128, vocab=1024)),
    "mistral": ("MistralForCausalLM, grouped-query attention, attention dropout 0.1, 6 layers, width 128, "
                "4 x 128 tokens", lambda: models.mistral(batch=4, seq_len=128, layers=6, width=128, vocab=1024)),
    "bert": ("BertForMaskedLM, 6 layers, width 128, 4 x 128 tokens",
             lambda: models.bert(batch=4, seq_len=128, layers=6, width=128, vocab=1024)),
    "t5": ("T5ForConditionalGeneration, 6+6 layers, width 128, 4 x 64 tokens",
           lambda: models.t5(batch=4, seq_len=64, layers=6, width=128, vocab=1024)),
    "whisper": ("WhisperForConditionalGeneration, 6+6 layers, width 128, 4 x 128 frames, 128 labels",
                lambda: models.whisper(batch=4, frames=128, layers=6, width=128, vocab=1024, target_len=128)),
    "vit": ("ViTForImageClassification, 6 layers, width 128, 32 x 64 px",
            lambda: models.vit(batch=32, image_size=64, layers=6, width=128)),
    "hf_resnet": ("ResNetForImageClassification, 12 basic blocks, width 32, 16 x 64 px",
                  lambda: models.hf_resnet(batch=16, image_size=64, widths=(32,), depth=12)),
    "nn_transformer": ("torch.nn.Transformer, 6+6 layers, width 128, 8 x 64 tokens",
                       lambda: models.nn_transformer(batch=8, seq_len=64, layers=6, width=128)),
    "cnn_batchnorm": ("CNN, 8 BatchNorm residual blocks, width 32, 16 x 32 px",
                      lambda: models.cnn(batch=16, image_size=32, widths=(32,), blocks_per_stage=8)),
    "kwargs_dict": ("kwargs in, dict out: conv + embedding towers, 8 MLP blocks, batch 1024",
                    lambda: models.two_tower(batch=1024, image_size=16, width=128, depth=8)),
}

SOLVE = {"max_stages": 16, "time_limit_s": 60.0, "timing_repeats": 1}


def _error(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def fidelity_row(name: str, fraction: float = 0.5) -> dict[str, Any]:
    """Measure one model of :data:`MODELS`; returns a row of the table (bytes, percentages)."""
    description, build = MODELS[name]
    model, example = build()
    inputs = StepInputs.from_example(example)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        roomy = optimize(model, example, budget_gb=64.0, cache_dir=cache, **SOLVE)
        profile_s = time.perf_counter() - started
        unopt_predicted = simulate(roomy.cost_graph).peak_bytes
        unopt_measured = measure_step_peak_bytes(model, inputs)
        budget_bytes = int(unopt_measured * fraction)
        started = time.perf_counter()
        opt = optimize(model, example, budget_gb=budget_bytes / GIB, cache_dir=cache, **SOLVE)
        plan_s = time.perf_counter() - started
        assert opt.cost_graph.metadata.get("cache") == "hit"
    plan_measured = measure_step_peak_bytes(opt, inputs)
    every = _at_every_layers_peak(model, example, inputs, cache)
    fake = profile_graph(trace_module(model, example), example, fake=True, target="cpu")
    fake_predicted = simulate(fake).peak_bytes
    return {
        "model": name,
        "description": description,
        "nodes": len(roomy.cost_graph.nodes),
        "unopt_predicted_bytes": unopt_predicted,
        "unopt_measured_bytes": unopt_measured,
        "unopt_error_pct": round(_error(unopt_predicted, unopt_measured), 3),
        # the captured graph's own unoptimized step at the allocator (what the profile predicts)
        "graph_unopt_measured_bytes": roomy.cost_graph.measured_peak_bytes,
        "budget_bytes": budget_bytes,
        "plan_predicted_bytes": opt.plan.predicted_peak_bytes,
        "plan_measured_bytes": plan_measured,
        "plan_error_pct": round(_error(opt.plan.predicted_peak_bytes, plan_measured), 3),
        "within_budget": plan_measured <= budget_bytes,
        **every,
        "segments": len(opt.plan.segments),
        "fake_unopt_predicted_bytes": fake_predicted,
        "fake_unopt_error_pct": round(_error(fake_predicted, unopt_measured), 3),
        "profile_s": round(profile_s, 2),
        "replan_s": round(plan_s, 2),
    }


def _at_every_layers_peak(model: torch.nn.Module, example: Any, inputs: StepInputs, cache: str) -> dict[str, Any]:
    """Plan at checkpoint-every-layer's measured peak and measure the plan: the prediction where
    the budget is tightest, and whether such a budget is met (``"refused"`` when it is not; an
    empty row for a model without a list of repeated layers)."""
    try:
        find_layers(model)
    except ValueError:
        return {"every_layer_bytes": None}
    every_bytes = measure_step_peak_bytes(checkpoint_every_k(model, 1), inputs)
    try:
        opt = optimize(model, example, budget_gb=every_bytes / GIB, cache_dir=cache, **SOLVE)
    except InfeasibleBudgetError as refusal:
        return {"every_layer_bytes": every_bytes, "every_layer_refused_floor_bytes": refusal.min_feasible_bytes}
    measured = measure_step_peak_bytes(opt, inputs)
    return {"every_layer_bytes": every_bytes, "every_layer_plan_predicted_bytes": opt.plan.predicted_peak_bytes,
            "every_layer_plan_measured_bytes": measured,
            "every_layer_plan_error_pct": round(_error(opt.plan.predicted_peak_bytes, measured), 3),
            "every_layer_met_on_measurement": opt.plan.measured_peak_bytes is not None}


def _every_layer_cell(row: dict[str, Any]) -> str:
    if row["every_layer_bytes"] is None:
        return "no repeated layers | | |"
    if "every_layer_refused_floor_bytes" in row:
        return (f"{row['every_layer_bytes'] / MIB:.1f} MiB | refused (floor "
                f"{row['every_layer_refused_floor_bytes'] / MIB:.1f} MiB) | |")
    met = " (met on measurement)" if row["every_layer_met_on_measurement"] else ""
    return (f"{row['every_layer_bytes'] / MIB:.1f} MiB | {row['every_layer_plan_predicted_bytes'] / MIB:.1f} / "
            f"{row['every_layer_plan_measured_bytes'] / MIB:.1f} MiB{met} | {row['every_layer_plan_error_pct']:+.2f}% |")


def xl_row(batch: int = 2, seq_len: int = 4096, budget_gb: float = 80e9 / GIB, target: str = "h100") -> dict[str, Any]:
    """Plan a GPT-2-XL-sized model (meta device, fake tensors) for a GPU budget; nothing allocated.

    ``max_rss_mib`` is the process's resident high-water mark afterwards: run it first."""
    started = time.perf_counter()
    model, example = models.gpt2_meta(batch=batch, seq_len=seq_len)
    graph = profile_graph(trace_module(model, example), example, fake=True, target=target)
    unoptimized = simulate(graph).peak_bytes
    plan = plan_for_budget(graph, budget_gb, PlanOptions(max_stages=16, time_limit_s=30.0))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": f"{batch} x {seq_len}",
        "nodes": len(graph.nodes),
        "unoptimized_gib": unoptimized / GIB,
        "budget_gib": plan.budget_bytes / GIB,
        "planned_gib": plan.predicted_peak_bytes / GIB,
        "segments": len(plan.segments),
        "extra_time_pct": 100 * plan.overhead_ratio,
        "step_ms": plan.step_ms,
        "wall_s": time.perf_counter() - started,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "target": target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the measured peak")
    parser.add_argument("--csv", type=Path, help="also write the rows to this CSV file")
    parser.add_argument("--xl", action="store_true", help="also plan a GPT-2-XL-sized model on fake tensors")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared machine)")
    parser.add_argument("--docs", action="store_true",
                        help="also write the table to docs/benchmarks/fidelity.md (with this command line and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tee_stdout() as printed:
        rows = table(args)
    if args.csv and rows:
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(key for row in rows for key in row)), restval="")
            writer.writeheader()
            writer.writerows(rows)
    if args.docs:
        publish_doc(printed.getvalue(), "fidelity", sys.argv,
                    title="Profiler fidelity: predicted against measured peak", about=DOC_ABOUT)


def table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print the XL line (with ``--xl``) and the table; return the table's rows."""
    if args.xl:  # first, so that the process's resident high-water mark is its own
        xl = xl_row()
        print(f"GPT-2-XL-sized ({xl['parameters'] / 1e9:.2f}e9 parameters, {xl['tokens']} tokens, {xl['nodes']} "
              f"nodes) on fake tensors for {xl['target']}: unoptimized {xl['unoptimized_gib']:.1f} GiB, budget "
              f"{xl['budget_gib']:.1f} GiB, planned {xl['planned_gib']:.1f} GiB in {xl['segments']} segments, "
              f"+{xl['extra_time_pct']:.1f}% time (roofline step {xl['step_ms']:.0f} ms); {xl['wall_s']:.1f} s, "
              f"process peak resident memory {xl['max_rss_mib']:.0f} MiB\n", flush=True)
    rows = []
    print(f"| model | unoptimized predicted | measured (model) | error | measured (captured graph) "
          f"| {args.fraction:.0%} budget | plan predicted | measured | error | every-layer's peak (budget) "
          f"| plan predicted / measured | error | fake-tensor unoptimized (error) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        row = fidelity_row(name, args.fraction)
        rows.append(row)
        print(f"| {name} | {row['unopt_predicted_bytes'] / MIB:.1f} MiB | {row['unopt_measured_bytes'] / MIB:.1f} MiB "
              f"| {row['unopt_error_pct']:+.2f}% | {row['graph_unopt_measured_bytes'] / MIB:.1f} MiB "
              f"| {row['budget_bytes'] / MIB:.1f} MiB "
              f"| {row['plan_predicted_bytes'] / MIB:.1f} MiB | {row['plan_measured_bytes'] / MIB:.1f} MiB "
              f"| {row['plan_error_pct']:+.2f}% | {_every_layer_cell(row)} {row['fake_unopt_predicted_bytes'] / MIB:.1f} MiB "
              f"({row['fake_unopt_error_pct']:+.1f}%) |", flush=True)
    return rows


if __name__ == "__main__":
    main()
