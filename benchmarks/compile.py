"""Plans that compile: ``optimize(..., compile=True)`` against the compiled anchors, with Inductor on CPU or a GPU.

For a HF GPT-2 and a Llama-style model (4 layers, width 256), every row is one training step
(``model(**batch).loss.backward()``) run under ``torch.compile`` (Inductor):

- ``compiled none``: ``torch.compile(model)``, nothing recomputed: the reference step (1.00x);
- ``compiled every layer``: HF ``gradient_checkpointing_enable()`` (non-reentrant) then
  ``torch.compile``; its measured peak is the first budget;
- at each budget (80 % of compiled none's measured peak, where a few segments fit; every layer's
  measured peak; 50 % of compiled none's):
  ``compile(optimize)``: ``torch.compile(optimize(model, budget))``, the eager plan compiled around
  its segments; ``optimize compile=True``: the plan honoured inside one compiled graph;
  ``compile budget f``: ``torch._functorch.config.activation_memory_budget = f``, the fraction
  (of those tried) whose measured peak comes closest to the budget.

Peaks are measured at the allocator (``torch.profiler`` memory events) on a warm compiled
step. Step times are ratios to compiled none, from interleaved repeats in one process (each
repeat runs every row's step once), median. Graph breaks are Dynamo's counter over the row's
first (compiling) step; compile time is that step's wall time (for ``optimize compile=True``,
every plan compiled while checking plans, with the profile: ``optimize`` s). "same loss" says
whether the row's loss at one seed equals compiled none's bit for bit (dropout on: GPT-2's
attention and residual dropout 0.1).

    python benchmarks/compile.py --docs                # both models, about 25 min on 2 cores
    python benchmarks/compile.py --models gpt2 --batch 2 --repeats 3
    python benchmarks/compile.py --device cuda --quick --docs   # on a GPU: docs/benchmarks/compile_cuda.md

``--quick`` keeps every-layer's peak as the only budget and 0.5 as the only
``activation_memory_budget`` fraction, leaves out ``compile(optimize)``, and times 3 repeats:
the prepared GPU run's step (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIB, ROOT, add_docs_argument, benchmark_logging, isolated_profile_cache, publish_table,  # noqa: E402
                    step_time_ratios, to_device)
from models import gpt2, llama  # noqa: E402

from planner import optimize  # noqa: E402
from planner.core.errors import PlannerError  # noqa: E402
from profiling import StepInputs, measure_step_peak_bytes, run_step  # noqa: E402
from rewrite.compiled import graph_break_count  # noqa: E402

log = logging.getLogger("benchmarks.compile")

MODELS: dict[str, tuple[Callable[..., tuple[torch.nn.Module, Any]], str]] = {
    "gpt2": (functools.partial(gpt2, layers=4, width=256, vocab=4096), "GPT2LMHeadModel, 4 layers, width 256, "
                                                                        "vocab 4096, dropout 0.1"),
    "llama": (functools.partial(llama, layers=4, width=256, vocab=4096), "LlamaForCausalLM, 4 layers, width 256, "
                                                                          "vocab 4096"),
}
#: the ``activation_memory_budget`` fractions tried; the one closest to each budget is shown
MEMORY_BUDGET_FRACTIONS = (0.7, 0.5, 0.3, 0.1)
#: ``--quick``: the fraction tried and the budget planned (every layer's peak)
QUICK_MEMORY_BUDGET_FRACTIONS = (0.5,)
QUICK_BUDGETS = ("every layer's peak",)


class _LeftOut(Exception):
    """A row ``--quick`` does not run."""


@dataclass
class Row:
    label: str
    budget: str = ""
    peak_bytes: int | None = None
    graph_breaks: int | None = None
    compile_s: float | None = None
    same_loss: bool | None = None
    time_ratio: float | None = None
    note: str = ""
    module: Any = field(default=None, repr=False)


def memory_budget_backend(fraction: float) -> Callable[..., Any]:
    """An Inductor backend partitioning with ``activation_memory_budget = fraction`` (its own
    backend object, so Dynamo keeps one cache entry per fraction)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with functorch_config.patch(activation_memory_budget=fraction, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)

    return backend


def seeded_loss(module: Any, inputs: StepInputs, seed: int = 7) -> torch.Tensor:
    """The loss of one training step at ``seed`` (gradients cleared after)."""
    torch.manual_seed(seed)
    loss = module(*inputs.args, **inputs.kwargs).loss
    value = loss.detach().clone()
    loss.backward()
    module.zero_grad(set_to_none=True)
    return value


def first_step(row: Row, module: Any, inputs: StepInputs) -> None:
    """Run ``module``'s first (compiling) step, recording its graph breaks and wall time."""
    before = graph_break_count()
    started = time.perf_counter()
    run_step(module, inputs)
    row.compile_s = time.perf_counter() - started
    row.graph_breaks = graph_break_count() - before
    module.zero_grad(set_to_none=True)


def run_model(name: str, batch: int, seq_len: int, repeats: int, device: torch.device = torch.device("cpu"),
              quick: bool = False) -> tuple[list[Row], dict[str, Any]]:
    build, about = MODELS[name]
    model, example = to_device(*build(batch=batch, seq_len=seq_len), device)
    inputs = StepInputs.from_example(example)
    rows: list[Row] = []
    eager_peak = measure_step_peak_bytes(model, inputs)

    none = Row("compiled none")
    none.module = torch.compile(model)
    first_step(none, none.module, inputs)
    none.peak_bytes = measure_step_peak_bytes(none.module, inputs)
    reference_loss = seeded_loss(none.module, inputs)
    none.same_loss = True
    rows.append(none)
    log.info("%s: compiled none %.1f MiB (eager %.1f MiB), %d graph breaks", name, none.peak_bytes / MIB,
             eager_peak / MIB, none.graph_breaks)

    every_model = copy.deepcopy(model)
    every_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    every = Row("compiled every layer")
    every.module = torch.compile(every_model)
    first_step(every, every.module, inputs)
    every.peak_bytes = measure_step_peak_bytes(every.module, inputs)
    every.same_loss = bool(torch.equal(seeded_loss(every.module, inputs), reference_loss))
    rows.append(every)
    log.info("%s: compiled every layer %.1f MiB, %d graph breaks", name, every.peak_bytes / MIB, every.graph_breaks)

    budgets = [("80% of compiled none", none.peak_bytes * 4 // 5), ("every layer's peak", every.peak_bytes),
               ("50% of compiled none", none.peak_bytes // 2)]
    if quick:
        budgets = [b for b in budgets if b[0] in QUICK_BUDGETS]
    fraction_rows: list[Row] = []
    for fraction in QUICK_MEMORY_BUDGET_FRACTIONS if quick else MEMORY_BUDGET_FRACTIONS:
        row = Row(f"compile budget {fraction:g}")
        row.module = torch.compile(model, backend=memory_budget_backend(fraction))
        first_step(row, row.module, inputs)
        row.peak_bytes = measure_step_peak_bytes(row.module, inputs)
        row.same_loss = bool(torch.equal(seeded_loss(row.module, inputs), reference_loss))
        fraction_rows.append(row)
        log.info("%s: activation_memory_budget %g: %.1f MiB", name, fraction, row.peak_bytes / MIB)

    for label, budget_bytes in budgets:
        budget_gb = budget_bytes / 2**30
        eager_plan = Row("compile(optimize)", label)
        try:
            if quick:
                raise _LeftOut
            started = time.perf_counter()
            planned = optimize(model, example, budget_gb=budget_gb)
            eager_plan.note = f"optimize {time.perf_counter() - started:.0f} s"
            eager_plan.module = torch.compile(planned)
            first_step(eager_plan, eager_plan.module, inputs)
            eager_plan.peak_bytes = measure_step_peak_bytes(eager_plan.module, inputs)
            eager_plan.same_loss = bool(torch.equal(seeded_loss(eager_plan.module, inputs), reference_loss))
        except PlannerError as exc:
            eager_plan.note = f"no plan: {str(exc).splitlines()[0][:120]}"
        except _LeftOut:
            eager_plan.note = "left out (--quick)"
        rows.append(eager_plan)

        compiled_plan = Row("optimize compile=True", label)
        try:
            started = time.perf_counter()
            opt = optimize(model, example, budget_gb=budget_gb, compile=True)
            optimize_s = time.perf_counter() - started
            compiled_plan.module = opt
            first_step(compiled_plan, opt, inputs)  # compiled while planning: no compile here
            split = opt.plan.compile_split_before_loss
            compiled_plan.graph_breaks = (opt.plan.compile_graph_breaks or 0) + (compiled_plan.graph_breaks or 0)
            compiled_plan.compile_s = optimize_s
            compiled_plan.peak_bytes = measure_step_peak_bytes(opt, inputs)
            compiled_plan.same_loss = bool(torch.equal(seeded_loss(opt, inputs), reference_loss))
            compiled_plan.note = (f"{len(opt.plan.segments)} segments, plan's own measure "
                                  f"{opt.plan.measured_peak_bytes / MIB:.1f} MiB, last compile {opt.plan.compile_s:.0f} s"
                                  + (", two graphs (split before the loss)" if split else ""))
        except PlannerError as exc:
            compiled_plan.note = f"no plan: {str(exc).splitlines()[0][:120]}"
        rows.append(compiled_plan)

        closest = min(fraction_rows, key=lambda r: abs((r.peak_bytes or 0) - budget_bytes))
        rows.append(dataclasses_replace(closest, budget=label))
        log.info("%s at %s (%.1f MiB): compile(optimize) %s, compile=True %s, closest budget fraction %s", name, label,
                 budget_bytes / MIB, _mib(eager_plan.peak_bytes), _mib(compiled_plan.peak_bytes), closest.label)

    timed = [r for r in rows if r.module is not None]
    unique: list[Any] = []
    for r in timed:
        if all(r.module is not m for m in unique):
            unique.append(r.module)
    ratios = step_time_ratios(unique, inputs, repeats=repeats, device=device)
    by_module = {id(m): ratio for m, ratio in zip(unique, ratios)}
    for r in timed:
        r.time_ratio = by_module[id(r.module)]
    info = {"about": f"{about}, batch {batch} x {seq_len}", "budgets": budgets, "eager_peak": eager_peak}
    return rows, info


def dataclasses_replace(row: Row, **changes: Any) -> Row:
    new = copy.copy(row)
    for key, value in changes.items():
        setattr(new, key, value)
    return new


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f} MiB"


def markdown(results: dict[str, tuple[list[Row], dict[str, Any]]], repeats: int, wall_s: float,
             warm_cache: bool = False, device: torch.device = torch.device("cpu")) -> str:
    cache = "Inductor's on-disk cache reused (--warm-cache)" if warm_cache else "a fresh Inductor cache (first compiles)"
    machine = (f"{torch.cuda.get_device_name(device)} GPU" if device.type == "cuda" else
               f"{platform.machine()} CPU ({os.cpu_count()} cores, shared), {torch.get_num_threads()} thread")
    lines = [
        f"Machine: {machine}; "
        f"torch {torch.__version__}, Inductor, {cache}; {repeats} interleaved timing repeats; "
        f"wall time {wall_s / 60:.1f} min.",
        "",
    ]
    for name, (rows, info) in results.items():
        budgets = ", ".join(f"{label} {b / MIB:.1f} MiB" for label, b in info["budgets"])
        lines += [f"### {name}: {info['about']}", "",
                  f"Eager unoptimized peak {info['eager_peak'] / MIB:.1f} MiB. Budgets: {budgets}.", "",
                  "| budget | row | measured peak | within budget | step time (x compiled none) | graph breaks | "
                  "compile s | same loss | note |",
                  "|---|---|---|---|---|---|---|---|---|"]
        budget_of = dict(info["budgets"])
        for r in rows:
            within = "" if not r.budget or r.peak_bytes is None else (
                "yes" if r.peak_bytes <= budget_of[r.budget] else "NO")
            lines.append(
                f"| {r.budget or '-'} | {r.label} | {_mib(r.peak_bytes)} | {within} | "
                f"{'-' if r.time_ratio is None else f'{r.time_ratio:.2f}x'} | "
                f"{'-' if r.graph_breaks is None else r.graph_breaks} | "
                f"{'-' if r.compile_s is None else f'{r.compile_s:.0f}'} | "
                f"{'-' if r.same_loss is None else ('yes' if r.same_loss else 'no')} | {r.note} |")
        lines.append("")
    return "\n".join(lines)


DOC_ABOUT = """\
## How to read it

Every row runs `model(**batch).loss.backward()` under `torch.compile` (Inductor, on the device the page names). Budgets:
80 % of the measured peak of `torch.compile(model)` (a budget a few segments meet), the measured
peak of HF `gradient_checkpointing_enable()` (non-reentrant) then `torch.compile`, and half the
measured peak of `torch.compile(model)`. `compile(optimize)` is
`torch.compile(optimize(model, budget))`: the eager plan, each segment a graph break run eagerly.
`optimize compile=True` is the plan honoured inside one compiled graph, checked on the compiled
step's measured peak; its compile time is the whole `optimize` call (profile, solves, and every plan
compiled while checking). `compile budget f` is `torch._functorch.config.activation_memory_budget
= f` at the fraction, of 0.7, 0.5, 0.3 and 0.1, whose measured peak comes closest to the budget.
`optimize compile=True` compiles a step whose graph computes its loss beside other outputs as
two graphs run in a row, split before the loss (docs/memory.md#compiled-steps; no Dynamo graph
break), and the note says so; HF's own loss function breaks GPT-2's `torch.compile(model)` there.
Step times are medians of per-repeat ratios to compiled none, the rows' steps interleaved in one
process on a shared machine (single timings swing by 10 % or more). "same loss": the loss at one seed
equals `torch.compile(model)`'s bit for bit.
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing repeats (default 5; quick 3)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true",
                        help="every layer's peak as the only budget, one activation_memory_budget fraction")
    parser.add_argument("--warm-cache", action="store_true",
                        help="reuse Inductor's on-disk cache (default: a fresh one, so compile times are a first compile's)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    args = parser.parse_args(argv)
    benchmark_logging()
    isolated_profile_cache()
    if not args.warm_cache:  # read by Inductor at each compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cache-")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    started = time.perf_counter()
    results = {name: run_model(name, args.batch, args.seq_len, repeats, device, args.quick) for name in args.models}
    text = markdown(results, repeats, time.perf_counter() - started, args.warm_cache, device)
    stem = "compile" if device.type == "cpu" else "compile_cuda"
    title = "Plans that compile" + ("" if device.type == "cpu" else ", on a GPU")
    publish_table(text, args.out, f"{stem}.md", {"name": stem, "title": title,
                                                  "about": DOC_ABOUT} if args.docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
