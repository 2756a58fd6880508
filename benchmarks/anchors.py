"""This planner against the anchors: none, checkpoint every (k-th) layer, torch.compile's memory budget.

For each model and method: the training step's peak memory at the allocator (CPU: profiler memory
events; CUDA: ``max_memory_allocated``), extra FLOPs over the unoptimized step (FlopCounterMode's
formulas), step time as a ratio to the unoptimized eager step (interleaved repeats, median, one
process; CUDA events on a GPU) and, for this planner, its solve time. Methods:

- ``none``: the model as it is (eager);
- ``every k``: ``torch.utils.checkpoint`` (non-reentrant) around every k-th repeated layer
  (decoder/encoder layers, MLP or CNN blocks; ``k=1`` is HuggingFace's checkpoint-every-layer);
- ``compile b``: ``torch.compile`` (inductor) with ``torch._functorch.config.activation_memory_budget
  = b``, ``b = 1.0`` (compile's default, its own reference) and the memory fractions; compile time is
  outside the measurements. Its FLOPs are those of the forward and backward graphs inductor
  receives after partitioning (the recomputed ops included), counted with FlopCounterMode's
  formulas; a failing compile is recorded, not raised;
- ``planner = X``: ``optimize`` with the budget set to anchor X's measured peak (one profile per
  model, read from a cache for every budget); where no plan reaches that peak it plans at its
  smallest feasible budget and says so;
- ``planner sweep``: ``planner.sweep`` over budgets from the smallest feasible peak to the
  unoptimized one (plans that recompute nothing are left out).

Writes ``anchors.csv`` (one row per model and method), ``anchors_<model>.png`` (peak memory against
extra FLOPs and against step time) and ``anchors.md`` (the summary table and, per model and
anchor, whether the planner at that anchor's peak dominates it) under ``--out`` (default
``benchmarks/results``; ``benchmarks/results/quick`` with ``--quick``); ``--docs`` also writes
``anchors.md`` to ``docs/benchmarks/anchors.md``, its plots linked from there.

    python benchmarks/anchors.py --quick             # 2 models, compile at 1.0 only, 3 repeats: < 3 min
    python benchmarks/anchors.py --docs              # 6 models, 3 fractions, 7 repeats: < 30 min
    python benchmarks/anchors.py --device cuda       # the same on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from common import (DOCS_DIR, GIB, MIB, ROOT, add_docs_argument, checkpoint_every_k, find_layers,  # noqa: E402
                    publish_doc, step_time_ratios, to_device, benchmark_logging)
from models import ResidualMLP, bert, cnn, gpt2, llama, vit  # noqa: E402

from planner import InfeasibleBudgetError, optimize  # noqa: E402
from planner.core.costgraph import protect_reads_before_writes  # noqa: E402
from planner.core.plan import Plan  # noqa: E402
from planner.sweep import sweep  # noqa: E402
from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes, run_step  # noqa: E402
from profiling.cache import cached_profile_graph  # noqa: E402
from profiling.trace import trace_module  # noqa: E402
from rewrite.apply import CheckpointedModule, apply_plan  # noqa: E402

Builder = Callable[[], tuple[torch.nn.Module, Any]]

def small_mlp(batch: int = 512, seed: int = 0) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The residual MLP of ``examples/models.py`` at width 128, hidden 512."""
    torch.manual_seed(seed)
    return ResidualMLP(width=128, hidden=512).train(), (torch.randn(batch, 128),)


#: Sized for a 2-core, 24 GiB CPU machine: each unoptimized step takes about 0.1 s on one thread.
MODELS: dict[str, tuple[Builder, str]] = {
    "mlp": (small_mlp, "residual MLP, 8 blocks, width 128, hidden 512, batch 512"),
    "cnn": (functools.partial(cnn, batch=16, image_size=32, widths=(16, 32, 64)),
            "ResNet-style CNN with BatchNorm, widths 16/32/64, 6 blocks, batch 16 x 32x32"),
    "gpt2": (functools.partial(gpt2, batch=4, seq_len=128, layers=4, width=128, vocab=2048),
             "GPT2LMHeadModel, 4 layers, width 128, vocab 2048, batch 4 x 128"),
    "llama": (functools.partial(llama, batch=4, seq_len=128, layers=4, width=128, vocab=2048),
              "LlamaForCausalLM, 4 layers, width 128, vocab 2048, batch 4 x 128"),
    "bert": (functools.partial(bert, batch=4, seq_len=128, layers=4, width=128, vocab=2048),
             "BertForMaskedLM, 4 layers, width 128, vocab 2048, batch 4 x 128"),
    "vit": (functools.partial(vit, batch=8, image_size=64, layers=4, width=128),
            "ViTForImageClassification, 4 layers, width 128, patch 8, batch 8 x 64x64"),
}
QUICK_MODELS = ["mlp", "gpt2"]

FULL = {"fractions": [0.7, 0.5, 0.35], "repeats": 7, "sweep_points": 6}
QUICK = {"fractions": [], "repeats": 3, "sweep_points": 4}
EVERY_K = [1, 2]
COMPILE_DEFAULT_BUDGET = 1.0

#: how to read the table, below it on its page under docs/benchmarks/
DOC_ABOUT = """\
## How to read it

Six small models built in `benchmarks/anchors.py` (the residual MLP, a BatchNorm CNN, and
HuggingFace GPT-2, Llama, BERT and ViT from configurations; each step takes about 0.1 s on one
CPU thread), every method measured the same way: peak training-step memory at the allocator
(CPU: profiler memory events; CUDA: `max_memory_allocated`), extra FLOPs over the unoptimized
step (`FlopCounterMode`'s formulas), step time as a ratio to the unoptimized eager step
(interleaved repeats in one process, median; CUDA events on a GPU). The anchors:

- `every 1`, `every 2`: every (second) repeated layer under non-reentrant
  `torch.utils.checkpoint`; `every 1` is HuggingFace's `gradient_checkpointing_enable()`.
  Checkpointing a BatchNorm block this way (the CNN) updates its running statistics twice per
  step; the planner's plans update them once.
- `compile b`: `torch.compile` (inductor) with
  `torch._functorch.config.activation_memory_budget = b`, 1.0 being compile's default;
  compile time is outside the measurement, and its FLOPs are those of the forward and backward
  graphs inductor compiles after partitioning. Its step time is also given against compile 1.0.

For each anchor the planner runs with the budget set to the anchor's measured peak ("planner
peak (budget = anchor peak)"); where no plan reaches it, at its smallest feasible budget
(marked). A sweep adds plans from the smallest feasible peak to the unoptimized one. The
planner dominates an anchor when its peak is lower or equal, its extra FLOPs lower or equal
and its extra step time lower; the notes under the table give the reason where it does not.
The script also writes `benchmarks/results/anchors.csv` (every row, solve and compile times,
time-limit flags).
"""

log = logging.getLogger("anchors")


@dataclasses.dataclass
class Row:
    """One method on one model: what the CSV holds."""

    model: str
    method: str                     # none | every_k | compile | planner | planner_sweep
    label: str                      # e.g. "every 2", "compile 0.5", "planner = every 1", "sweep 2/4"
    status: str = "ok"              # ok | infeasible | failed: ...
    anchor: str = ""                # planner rows: the anchor whose peak is the budget
    peak_bytes: int | None = None
    extra_flops: int | None = None
    flops_fraction: float | None = None
    time_ratio: float | None = None          # step time / unoptimized eager step time
    own_time_ratio: float | None = None      # compile: / compile 1.0's step time; others: = time_ratio
    budget_bytes: int | None = None
    within_budget: bool | None = None
    predicted_peak_bytes: int | None = None
    segments: int | None = None
    solve_s: float | None = None
    hit_time_limit: bool | None = None
    optimality_gap: float | None = None
    compile_s: float | None = None
    unoptimized_peak_bytes: int | None = None
    device: str = "cpu"

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "infeasible")


# ---------------------------------------------------------------- torch.compile with a memory budget

def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of one run of an ATen graph, from FlopCounterMode's formulas and the nodes' fake values."""
    from torch.utils.flop_counter import flop_registry

    total = 0
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
        if packet not in flop_registry:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        total += int(flop_registry[packet](*args, **kwargs, out_val=node.meta["val"]))
    return total


def compiled_with_budget(model: torch.nn.Module, budget: float, flops: list[int]) -> torch.nn.Module:
    """``torch.compile(model)`` (inductor) partitioned with ``activation_memory_budget=budget``;
    ``flops`` receives the FLOPs of every forward and backward graph inductor compiles."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        flops.append(graph_flops(gm))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        # the AOT autograd cache would skip inner_compile (and so the FLOP count) on a hit
        with functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    return torch.compile(model, backend=backend)


# ---------------------------------------------------------------- measuring

def measure(row: Row, module: torch.nn.Module, inputs: StepInputs, base_flops: int,
            flops: int | None = None) -> None:
    """Fill ``row``'s peak and extra FLOPs (``flops``: the step's count when not measurable eagerly)."""
    row.peak_bytes = measure_step_peak_bytes(module, inputs)
    total = measure_step_flops(module, inputs) if flops is None else flops
    row.extra_flops = total - base_flops
    row.flops_fraction = row.extra_flops / base_flops if base_flops else math.nan
    if row.budget_bytes is not None:
        row.within_budget = row.peak_bytes <= row.budget_bytes


def short_error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"failed: {type(exc).__name__}: {first[:160]}"


def record_plan(row: Row, plan: Plan) -> None:
    row.predicted_peak_bytes = plan.predicted_peak_bytes
    row.segments = len(plan.segments)
    row.solve_s = plan.solve_s
    row.hit_time_limit = plan.hit_time_limit
    row.optimality_gap = plan.optimality_gap


def planned_module(model: torch.nn.Module, example: Any, budget_bytes: int, cache_dir: str, time_limit_s: float,
                   row: Row) -> torch.nn.Module:
    """``optimize`` at ``budget_bytes``; at its smallest feasible budget when that is infeasible."""
    row.budget_bytes = budget_bytes
    try:
        opt = optimize(model, example, budget_gb=budget_bytes / GIB, cache_dir=cache_dir, time_limit_s=time_limit_s)
    except InfeasibleBudgetError as exc:
        row.status = "infeasible"
        opt = optimize(model, example, budget_gb=exc.min_feasible_bytes / GIB, cache_dir=cache_dir,
                       time_limit_s=time_limit_s)
    record_plan(row, opt.plan)
    return opt


def run_model(name: str, device: torch.device, fractions: Sequence[float], repeats: int, sweep_points: int,
              cache_dir: str, time_limit_s: float) -> tuple[list[Row], dict[str, Any]]:
    builder, _ = MODELS[name]
    model, example = builder()
    model, example = to_device(model, example, device)
    inputs = StepInputs.from_example(example)
    info: dict[str, Any] = {"layers": f"{find_layers(model)[0]} ({len(find_layers(model)[1])})"}
    rows: list[Row] = []
    modules: list[tuple[Row, torch.nn.Module]] = []

    def new(method: str, label: str, **fields: Any) -> Row:
        row = Row(model=name, method=method, label=label, device=device.type, **fields)
        rows.append(row)
        return row

    none = new("none", "none")
    base_flops = measure_step_flops(model, inputs)
    measure(none, model, inputs, base_flops, flops=base_flops)
    base_peak = none.peak_bytes
    assert base_peak is not None
    modules.append((none, model))
    log.info("%s: unoptimized peak %.1f MiB, %.3g FLOPs", name, base_peak / MIB, base_flops)

    for k in EVERY_K:
        row = new("every_k", f"every {k}")
        every = checkpoint_every_k(model, k)
        measure(row, every, inputs, base_flops)
        modules.append((row, every))

    compile_budgets = [COMPILE_DEFAULT_BUDGET, *fractions]
    for budget in compile_budgets:
        row = new("compile", f"compile {budget:g}")
        flops: list[int] = []
        try:
            compiled = compiled_with_budget(model, budget, flops)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                t0 = time.perf_counter()
                run_step(compiled, inputs)  # compiles forward and backward
                row.compile_s = time.perf_counter() - t0
                model.zero_grad(set_to_none=True)
                step_flops, graphs = sum(flops), len(flops)
                run_step(compiled, inputs)  # a second step must not compile again
                model.zero_grad(set_to_none=True)
            measure(row, compiled, inputs, base_flops, flops=step_flops)
            if len(flops) != graphs:
                log.warning("%s: compile %g compiled again after its first step", name, budget)
            modules.append((row, compiled))
            log.info("%s: compile %g: %.1f MiB, compiled in %.0f s", name, budget, row.peak_bytes / MIB, row.compile_s)
        except Exception as exc:  # noqa: BLE001 - any compile failure is a result to record
            row.status = short_error(exc)
            log.warning("%s: compile %g failed:\n%s", name, budget, traceback.format_exc(limit=3))
        model.zero_grad(set_to_none=True)

    # the planner: one profile, then a plan per anchor's peak and a sweep
    t0 = time.perf_counter()
    graph = cached_profile_graph(trace_module(model, example), example, cache_dir)
    info["profile_s"] = time.perf_counter() - t0
    for anchor in [r for r in rows if r.method in ("every_k", "compile") and r.status == "ok"]:
        assert anchor.peak_bytes is not None
        row = new("planner", f"planner = {anchor.label}", anchor=anchor.label)
        opt = planned_module(model, example, anchor.peak_bytes, cache_dir, time_limit_s, row)
        measure(row, opt, inputs, base_flops)
        modules.append((row, opt))
    t0 = time.perf_counter()
    swept = sweep(protect_reads_before_writes(graph), points=sweep_points, time_limit_s=time_limit_s)
    info["sweep_s"] = time.perf_counter() - t0
    log.info("%s: sweep budgets %s MiB, segments %s", name, [round(p.budget_bytes / MIB, 2) for p in swept],
             [len(p.segments) for p in swept])
    plans = [p for p in swept if p.segments]
    for i, plan in enumerate(plans, start=1):
        row = new("planner_sweep", f"sweep {i}/{len(plans)}", budget_bytes=plan.budget_bytes)
        record_plan(row, plan)
        gm = apply_plan(trace_module(model, example), plan)
        opt = CheckpointedModule(gm, model, plan, cost_graph=graph, example_inputs=example)
        measure(row, opt, inputs, base_flops)
        modules.append((row, opt))
    log.info("%s: %d modules measured; timing %d interleaved repeats", name, len(modules), repeats)

    ratios = step_time_ratios([m for _, m in modules], inputs, repeats, device=device)
    for (row, _), ratio in zip(modules, ratios):
        row.time_ratio = ratio
        row.own_time_ratio = ratio
    compile_ref = next((r for r in rows if r.label == f"compile {COMPILE_DEFAULT_BUDGET:g}" and r.time_ratio), None)
    for row in rows:
        row.unoptimized_peak_bytes = base_peak
        if row.method == "compile":
            # against compile 1.0's step; against the eager step when compile 1.0 did not run
            row.own_time_ratio = (row.time_ratio / compile_ref.time_ratio
                                  if compile_ref is not None and row.time_ratio is not None else row.time_ratio)
    info["base_flops"] = base_flops
    del modules
    torch._dynamo.reset()
    return rows, info


# ---------------------------------------------------------------- verdicts, tables, plots

def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:+.1%}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def dominates(planner: Row, anchor: Row) -> tuple[bool, list[str]]:
    """Whether ``planner`` dominates ``anchor``: peak lower or equal, extra FLOPs lower or equal and
    extra step time lower (each against its own unoptimized step: eager for the planner and the
    checkpointing anchors, compile 1.0 for compile). Also the reasons it does not."""
    assert planner.peak_bytes is not None and anchor.peak_bytes is not None
    reasons = []
    if planner.status == "infeasible":
        reasons.append("no plan reaches its peak")
    if planner.peak_bytes > anchor.peak_bytes:
        reasons.append(f"peak {_mib(planner.peak_bytes)} > {_mib(anchor.peak_bytes)}")
    if (planner.extra_flops or 0) > (anchor.extra_flops or 0):
        reasons.append(f"extra FLOPs {_pct(planner.flops_fraction)} > {_pct(anchor.flops_fraction)}")
    p_time, a_time = (planner.own_time_ratio or math.inf), (anchor.own_time_ratio or math.inf)
    if p_time - 1 >= a_time - 1:
        reasons.append(f"extra time {_pct(p_time - 1)} >= {_pct(a_time - 1)}")
    return not reasons, reasons


def markdown(rows: list[Row], infos: dict[str, dict[str, Any]], device: torch.device, mode: str,
             fractions: Sequence[float], repeats: int, wall_s: float, image_dir: str = "") -> str:
    """The summary: a table of every anchor against the planner at its peak, a note per model, the plots
    (``image_dir``: where the PNGs are, relative to the markdown file)."""
    threads = torch.get_num_threads()
    where = (f"CPU, {threads} thread{'s' if threads != 1 else ''}" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    lines = [
        f"Device: {where}; mode: {mode}; torch {torch.__version__}; compile memory budgets "
        f"{', '.join(f'{f:g}' for f in [COMPILE_DEFAULT_BUDGET, *fractions])}; {repeats} interleaved timing repeats; "
        f"wall time {wall_s / 60:.1f} min.",
        "",
        "| model | anchor | anchor peak | planner peak (budget = anchor peak) | anchor extra FLOPs "
        "| planner extra FLOPs | anchor step time | planner step time | planner solve | planner dominates |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        none = next(r for r in mine if r.method == "none")
        lines.append(f"| {model} | none | {_mib(none.peak_bytes)} | - | 0 | - | 1.00x | - | - | - |")
        verdicts: list[str] = []
        for anchor in [r for r in mine if r.method in ("every_k", "compile")]:
            if not anchor.ok:
                lines.append(f"| {model} | {anchor.label} | {anchor.status} | - | - | - | - | - | - | - |")
                verdicts.append(f"{anchor.label}: not measured ({anchor.status})")
                continue
            planner = next(r for r in mine if r.method == "planner" and r.anchor == anchor.label)
            wins, reasons = dominates(planner, anchor)
            time_cell = _ratio(anchor.time_ratio)
            if anchor.method == "compile":
                time_cell += f" ({_ratio(anchor.own_time_ratio)} of compile 1.0)"
            infeasible = " (infeasible: planned at its minimum)" if planner.status == "infeasible" else ""
            lines.append(
                f"| {model} | {anchor.label} | {_mib(anchor.peak_bytes)} ({anchor.peak_bytes / none.peak_bytes:.2f}) "
                f"| {_mib(planner.peak_bytes)} ({planner.peak_bytes / none.peak_bytes:.2f}){infeasible} "
                f"| {_pct(anchor.flops_fraction)} | {_pct(planner.flops_fraction)} | {time_cell} "
                f"| {_ratio(planner.time_ratio)} | {planner.solve_s:.1f} s{'*' if planner.hit_time_limit else ''} "
                f"| {'yes' if wins else 'no'} |"
            )
            others = [r for r in mine if r.method in ("planner", "planner_sweep") and r is not planner
                      and dominates(r, anchor)[0]]
            also = f"; {others[0].label} does" if others and not wins else ""
            verdicts.append(f"{anchor.label}: {'dominates' if wins else 'does not dominate (' + '; '.join(reasons) + ')'}{also}")
        sweep_rows = [r for r in mine if r.method == "planner_sweep"]
        sweep_text = ", ".join(f"{_mib(r.peak_bytes)} / {_pct(r.flops_fraction)} / {_ratio(r.time_ratio)}"
                               for r in sweep_rows)
        over = [f"{r.label} by {r.peak_bytes - r.budget_bytes} bytes" for r in mine
                if r.method.startswith("planner") and r.within_budget is False]
        info = infos[model]
        notes.append(
            f"- **{model}** ({MODELS[model][1]}; layers {info['layers']}; profile {info['profile_s']:.1f} s, "
            f"sweep {info['sweep_s']:.1f} s). " + "; ".join(verdicts) + ". "
            f"Sweep (measured peak / extra FLOPs / step time): {sweep_text or 'none'}. "
            + (f"Measured over budget: {', '.join(over)}." if over else "Every plan's measured peak is within its budget.")
        )
    lines += ["", "Per model, the planner at each anchor's measured peak against that anchor "
              "(dominates: peak lower or equal, extra FLOPs lower or equal and extra step time lower; "
              "compile's extra time is against compile 1.0; * the solver stopped at its time limit):", "", *notes, ""]
    lines += [f"![{model}]({image_dir}anchors_{model}.png)" for model in dict.fromkeys(r.model for r in rows)]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r.model == model and r.ok and r.peak_bytes is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"none": ("k", "X", "none"), "every_k": ("tab:red", "s", "every k-th layer"),
              "compile": ("tab:blue", "^", "torch.compile memory budget"),
              "planner": ("tab:green", "o", "planner at an anchor's peak"),
              "planner_sweep": ("tab:olive", "D", "planner sweep")}
    for ax, (attr, ylabel) in zip(axes, [("flops_fraction", "extra FLOPs (% of unoptimized step)"),
                                         ("time_ratio", "step time / unoptimized eager step")]):
        for method, (color, marker, label) in styles.items():
            pts = sorted(((r.peak_bytes / MIB, getattr(r, attr) * (100 if attr == "flops_fraction" else 1), r)
                          for r in mine if r.method == method and getattr(r, attr) is not None),
                         key=lambda p: p[0])
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=color, marker=marker, label=label, zorder=3)
            if method == "planner_sweep":
                ax.plot([p[0] for p in pts], [p[1] for p in pts], c=color, lw=1, zorder=2)
            if method in ("every_k", "compile"):
                for x, y, r in pts:
                    ax.annotate(r.label.replace("compile ", "c"), (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=7, color=color)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model}: {MODELS[model][1]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"models {', '.join(QUICK_MODELS)}, fewer budgets and "
                        "repeats (under 3 minutes on a 2-core CPU)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), help="default: all (quick: mlp gpt2)")
    parser.add_argument("--fractions", nargs="*", type=float,
                        help="activation_memory_budget values for torch.compile besides 1.0 (default 0.7 0.5 0.35; quick none)")
    parser.add_argument("--repeats", type=int, help="interleaved timing repeats (default 7; quick 3)")
    parser.add_argument("--sweep-points", type=int,
                        help="budgets of the planner's sweep, the unoptimized peak included (default 6; quick 4)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--time-limit-s", type=float, default=30.0, help="the planner's solver time limit per solve")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (default 1: steadier timings on a shared machine)")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results, quick: benchmarks/results/quick)")
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one cache entry per compiled budget, on shared code objects
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    defaults = QUICK if args.quick else FULL
    models = args.models or (QUICK_MODELS if args.quick else list(MODELS))
    fractions = args.fractions if args.fractions is not None else defaults["fractions"]
    repeats = args.repeats or defaults["repeats"]
    sweep_points = args.sweep_points or defaults["sweep_points"]
    out = args.out or (ROOT / "benchmarks" / "results" / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    started = time.perf_counter()
    rows: list[Row] = []
    infos: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="anchors-profiles-") as cache_dir:
        for name in models:
            model_rows, infos[name] = run_model(name, device, fractions, repeats, sweep_points, cache_dir,
                                                args.time_limit_s)
            rows += model_rows
            plot(rows, name, out / f"anchors_{name}.png")
            log.info("%s done at %.0f s", name, time.perf_counter() - started)
    import pandas

    frame = pandas.DataFrame([dataclasses.asdict(r) for r in rows])
    frame.insert(frame.columns.get_loc("peak_bytes") + 1, "peak_mib", frame["peak_bytes"] / MIB)
    frame.to_csv(out / "anchors.csv", index=False)
    mode = "quick" if args.quick else "full"
    wall_s = time.perf_counter() - started
    text = markdown(rows, infos, device, mode, fractions, repeats, wall_s)
    (out / "anchors.md").write_text(text)
    print(text)
    if args.docs:
        image_dir = os.path.relpath(out.resolve(), DOCS_DIR) + "/"
        publish_doc(markdown(rows, infos, device, mode, fractions, repeats, wall_s, image_dir), "anchors", sys.argv,
                    title="Against the anchors: checkpoint every k-th layer and torch.compile's memory budget",
                    about=DOC_ABOUT)
    log.info("wrote %s (%.1f min)", out, (time.perf_counter() - started) / 60)


if __name__ == "__main__":
    main()
