"""What one call of ``optimize`` costs, end to end, in unoptimized training steps (CPU).

For each model, in a fresh process (what a user's first call pays, imports included): the
unoptimized training step's time (median of warm steps, half taken before the call and half
after), then ``optimize(model, inputs, budget_gb=...)`` at default settings, at a budget of
70 % of the measured unoptimized peak, timed whole and by phase: capture
(``profiling.trace.trace_module``), profile (``profiling.cache.cached_profile_graph``: the
profiling run, the warm timing passes, the per-node temporaries and the step's peak), solve
(``planner.pipeline.plan_for_budget``), rewrite (``rewrite.apply.apply_plan``) and the rest.
The bar: everything but the solve within 6 unoptimized steps, the solve under 10 s.

    python benchmarks/optimize_time.py --docs
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (benchmark_logging, isolated_profile_cache, publish_table, step_seconds,  # noqa: E402
                    table_arguments)

import models as example_models  # noqa: E402

log = logging.getLogger("benchmarks.optimize_time")

MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]] = {
    "autoencoder": ("MLP autoencoder, tied weights, 6 layers, width 512, hidden 2048, 16 x 256 tokens",
                    example_models.tied_autoencoder),
    "mlp": ("residual MLP, 8 blocks, width 256, hidden 1024, batch 2048", example_models.residual_mlp),
    "gpt2": ("GPT-2, 4 layers, width 256, batch 8 x 256", example_models.gpt2),
    "llama": ("Llama, 4 layers, width 256, batch 4 x 256", example_models.llama),
    "bert": ("BERT, 4 layers, width 256, batch 8 x 256", example_models.bert),
}

PHASES = ("capture", "profile", "solve", "rewrite")
MAX_STEPS_BESIDE_SOLVE = 6
MAX_SOLVE_S = 10.0
BUDGET_FRACTION = 0.7

DOC_ABOUT = f"""\
How to read it:

- *step*: the unoptimized training step (forward, loss, backward), median of warm steps timed in
  the same process, half before the call and half after.
- *capture* to *rewrite*: wall-clock seconds of each phase of one `optimize` call at default
  settings, at {BUDGET_FRACTION:.0%} of the measured unoptimized peak; *rest*: the call's time outside them
  (checks, the wrapper). Each model runs in a fresh process, so the first capture pays the
  imports a user's first call pays, and with an empty profile cache, as a first call on a machine
  (a later call of the same model reads its profile: no *profile* time).
- *beside the solve*: the call's time less the solve, in unoptimized steps. Bar: at most
  {MAX_STEPS_BESIDE_SOLVE} steps beside the solve, and the solve under {MAX_SOLVE_S:.0f} s.
- Profiling is one profiling forward (shapes, storages, saved tensors, FLOPs), one step under the
  memory profiler (per-node temporaries and the step's peak), then the warm timing passes
  (`timing_repeats` = 2, more while they spread by over 25 %; the step's time is taken from them).
- Times are wall clock on a shared 2-core machine: a busy neighbour lengthens the step and the
  call alike, so the ratio moves less than either.
"""


def _timed(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
    return wrapper


def _step_times_s(model: torch.nn.Module, inputs: Any, repeats: int) -> list[float]:
    times = [step_seconds(model, inputs, torch.device("cpu")) for _ in range(repeats)]
    model.zero_grad(set_to_none=True)
    return times


def measure_one(name: str, repeats: int) -> dict[str, Any]:
    """Time ``optimize`` on one model in this process (see the module docstring)."""
    import planner.pipeline as pipeline
    from planner import optimize
    from profiling import StepInputs, measure_step_peak_bytes

    model, example = MODELS[name][1]()
    inputs = StepInputs.from_example(example)
    peak_bytes = measure_step_peak_bytes(model, inputs)
    _step_times_s(model, inputs, 1)  # untimed: the first step of a process pays page faults
    steps = _step_times_s(model, inputs, repeats)
    phases: dict[str, float] = {}
    for phase, attr in (("capture", "trace_module"), ("profile", "cached_profile_graph"),
                        ("solve", "plan_for_budget"), ("rewrite", "apply_plan")):
        setattr(pipeline, attr, _timed(phases, phase, getattr(pipeline, attr)))
    started = time.perf_counter()
    opt = optimize(model, example, budget_gb=BUDGET_FRACTION * peak_bytes / 2**30)
    total_s = time.perf_counter() - started
    steps += _step_times_s(model, inputs, repeats)
    return {"name": name, "step_s": statistics.median(steps), "total_s": total_s, "phases": phases,
            "segments": len(opt.plan.segments)}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| model | step (s) | capture (s) | profile (s) | solve (s) | rewrite (s) | rest (s) | total (s) | "
             "beside the solve (steps) | meets the bar |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        phases = r["phases"]
        rest = r["total_s"] - sum(phases.get(p, 0.0) for p in PHASES)
        beside_steps = (r["total_s"] - phases.get("solve", 0.0)) / r["step_s"]
        meets = beside_steps <= MAX_STEPS_BESIDE_SOLVE and phases.get("solve", 0.0) < MAX_SOLVE_S
        lines.append(f"| {r['name']} | {r['step_s']:.3f} | " + " | ".join(f"{phases.get(p, 0.0):.2f}" for p in PHASES)
                     + f" | {rest:.2f} | {r['total_s']:.2f} | {beside_steps:.1f} | {'yes' if meets else 'no'} |")
    lines += ["", f"CPU, torch {torch.__version__}, one thread, budget {BUDGET_FRACTION:.0%} of the measured "
                  "unoptimized peak. Models: " + "; ".join(f"**{r['name']}**: {MODELS[r['name']][0]}"
                                                          for r in results) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser: argparse.ArgumentParser = table_arguments(__doc__.splitlines()[0], list(MODELS))
    parser.add_argument("--repeats", type=int, default=4, help="warm unoptimized steps timed before and after")
    parser.add_argument("--one", choices=list(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(measure_one(args.one, args.repeats)))
        return
    benchmark_logging()
    isolated_profile_cache()
    results = []
    for name in args.models:
        log.info("%s: optimize in a fresh process", name)
        done = subprocess.run([sys.executable, __file__, "--one", name, "--repeats", str(args.repeats),
                               "--threads", str(args.threads)], check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    doc = {"name": "optimize_time", "title": "End-to-end time of optimize", "about": DOC_ABOUT}
    publish_table(markdown(results), args.out, "optimize_time.md", doc if args.docs else None)


if __name__ == "__main__":
    main()
