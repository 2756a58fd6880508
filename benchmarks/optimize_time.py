"""What one call of ``optimize`` costs, end to end, in unoptimized training steps (CPU).

For each model, in a fresh process (what a user's first call pays, imports included): the
unoptimized training step's time (median of warm steps, half taken before the call and half
after), then ``optimize(model, inputs, budget_gb=...)`` at default settings, at a budget of
70 % of the measured unoptimized peak, timed whole and by phase: capture
(``profiling.trace.trace_module``), profile (``profiling.cache.cached_profile_graph``: the
profiling run and the warm timing passes; on the graph-break path ``profile_op_stream``), solve (``planner.budget_plan.plan_for_budget``, every
solve of the call), measure (the measured steps: ``measure_unoptimized_step``, the unoptimized
step against the budget, which is also the profile's per-node temporaries and the step's peak,
then ``measure_step_peak_bytes``, the plan's check), rewrite (``apply_plan``) and the rest.
The bar: everything but the solve within 6 unoptimized steps, the solve under 10 s.

``--corpus`` times the same call on every family of ``benchmarks/corpus_models.py`` (each with
its own training step: a criterion outside the model where the family has one), its example
batch repeated ``--batch-scale`` times (default 32) so that a step takes a few hundred
milliseconds rather than a few, and writes ``optimize_time_corpus.md``.

    python benchmarks/optimize_time.py --docs
    python benchmarks/optimize_time.py --corpus --docs
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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

#: the functions each phase of ``optimize`` runs, by name, wherever a planner module imported them
PHASE_FUNCTIONS = {"capture": ("trace_module",), "profile": ("cached_profile_graph", "profile_op_stream"),
                   "solve": ("plan_for_budget",),
                   "measure": ("measure_step_peak_bytes", "measure_unoptimized_step"), "rewrite": ("apply_plan",)}
PHASES = tuple(PHASE_FUNCTIONS)
MAX_STEPS_BESIDE_SOLVE = 6
MAX_SOLVE_S = 10.0
BUDGET_FRACTION = 0.7

DOC_ABOUT = f"""\
How to read it:

- *step*: the unoptimized training step (forward, loss, backward), median of warm steps timed in
  the same process, half before the call and half after.
- *capture* to *rewrite*: wall-clock seconds of each phase of one `optimize` call at default
  settings (*solve*: every solve of the call; *measure*: the measured steps, the unoptimized
  step against the budget, which is also the profile's memory pass, and then the plan's), at {BUDGET_FRACTION:.0%} of the measured unoptimized peak; *rest*: the call's time outside them
  (checks, the wrapper). Each model runs in a fresh process, so the first capture pays the
  imports a user's first call pays, and with no profile cached, as a first call of the model
  (a later call of the same model reads its profile: no *profile* time). A budget below every
  plan (*at its floor*) is refused, and planned again at the smallest feasible budget the refusal
  names, as a user would: both calls are timed together (the second reads the first's profile).
- *beside the solve*: the call's time less the solve, in unoptimized steps. Bar: at most
  {MAX_STEPS_BESIDE_SOLVE} steps beside the solve, and the solve under {MAX_SOLVE_S:.0f} s.
- On the graph-break path (a model `torch.export` cannot capture: *capture* is the failed
  attempt) *profile* is the op-stream profile (`profile_op_stream`: a recording step, a step
  under the memory profiler that also measures the unoptimized peak, then the timing steps, or,
  where the cache holds the recorded ops' profile, the recording step alone) and *measure* the
  plans' measured steps.
- Profiling is one profiling forward (shapes, storages, saved tensors, FLOPs); the node times
  and the step's time come from the step under the memory profiler alone (`timing_repeats` at
  its default: per-node temporaries, node times, shares after the last save and the step's
  peak), which is the measured unoptimized step, under *measure*.
- Times are wall clock on a shared 2-core machine: a busy neighbour lengthens the step and the
  call alike, so the ratio moves less than either.
"""


@contextlib.contextmanager
def timed_phases(phases: dict[str, float]) -> Iterator[None]:
    """Within the block, each of :data:`PHASE_FUNCTIONS` in every loaded ``planner`` module that
    holds it adds its wall time to ``phases``; a phase called inside another counts in the outer
    one. The functions are restored on exit.

    Example:
        >>> import planner.pipeline
        >>> from planner import optimize
        >>> model, phases = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).train(), {}
        >>> with timed_phases(phases):
        ...     _ = optimize(model, (torch.randn(4, 8),), budget_gb=1.0, timing_repeats=1, cache_dir=None)
        >>> sorted(phases)   # a step within the budget: measured, not profiled or solved
        ['capture', 'measure', 'rewrite']
    """
    running: list[str] = []
    originals: list[tuple[Any, str, Any]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if running:
                return fn(*args, **kwargs)
            running.append(name)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                running.pop()
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
        return wrapper

    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "planner" or module_name.startswith("planner.")):
            continue
        for phase, attrs in PHASE_FUNCTIONS.items():
            for attr in attrs:
                if callable(getattr(module, attr, None)):
                    originals.append((module, attr, getattr(module, attr)))
                    setattr(module, attr, timed(phase, getattr(module, attr)))
    try:
        yield
    finally:
        for module, attr, original in originals:
            setattr(module, attr, original)


def _step_times_s(model: torch.nn.Module, inputs: Any, repeats: int, step: Any) -> list[float]:
    times = [step_seconds(model, inputs, torch.device("cpu"), step) for _ in range(repeats)]
    model.zero_grad(set_to_none=True)
    return times


def measure_one(name: str, repeats: int, batch_scale: int | None = None) -> dict[str, Any]:
    """Time ``optimize`` on one model in this process (see the module docstring); with
    ``batch_scale``, ``name`` is a corpus family built with that batch scale."""
    import planner.pipeline  # noqa: F401 - loads the modules whose phases are timed
    from planner import InfeasibleBudgetError, optimize
    from profiling import StepInputs, TrainingStep, measure_step_peak_bytes

    loss_fn = None
    if batch_scale is None:
        model, example = MODELS[name][1]()
    else:
        from corpus_models import FAMILIES

        model, example = FAMILIES[name].build(batch_scale)
        loss_fn = FAMILIES[name].loss_fn
    inputs = StepInputs.from_example(example)
    step = TrainingStep(loss_fn=loss_fn)
    peak_bytes = measure_step_peak_bytes(model, inputs, step=step)
    _step_times_s(model, inputs, 1, step)  # untimed: the first step of a process pays page faults
    steps = _step_times_s(model, inputs, repeats, step)
    phases: dict[str, float] = {}
    with timed_phases(phases):
        started = time.perf_counter()
        at_floor = False
        try:
            opt = optimize(model, example, budget_gb=BUDGET_FRACTION * peak_bytes / 2**30, loss_fn=loss_fn)
        except InfeasibleBudgetError as refusal:  # as a user would: again at the floor it names
            at_floor = True
            opt = optimize(model, example, budget_gb=refusal.min_feasible_bytes / 2**30, loss_fn=loss_fn)
        total_s = time.perf_counter() - started
    steps += _step_times_s(model, inputs, repeats, step)
    return {"name": name, "step_s": statistics.median(steps), "total_s": total_s, "phases": phases,
            "segments": len(opt.plan.segments), "at_floor": at_floor}


def _beside_solve_steps(r: dict[str, Any]) -> float:
    return float((r["total_s"] - r["phases"].get("solve", 0.0)) / r["step_s"])


def _meets(r: dict[str, Any]) -> bool:
    return _beside_solve_steps(r) <= MAX_STEPS_BESIDE_SOLVE and r["phases"].get("solve", 0.0) < MAX_SOLVE_S


def headline(results: list[dict[str, Any]]) -> str:
    """How many rows meet the bar, and the worst of each half of it (a failed row counts against it)."""
    timed = [r for r in results if "error" not in r]
    line = f"{sum(_meets(r) for r in timed)} of {len(results)} meet the bar."
    if timed:
        slowest = max(timed, key=_beside_solve_steps)
        longest = max(timed, key=lambda r: r["phases"].get("solve", 0.0))
        line += (f" Worst beside the solve: {_beside_solve_steps(slowest):.1f} steps ({slowest['name']}); longest "
                 f"solve: {longest['phases'].get('solve', 0.0):.1f} s ({longest['name']}).")
    return line


def markdown(results: list[dict[str, Any]], batch_scale: int | None = None, overheads_s: float | None = None) -> str:
    lines = ["| model | step (s) | " + " | ".join(f"{p} (s)" for p in PHASES) + " | rest (s) | total (s) | "
             "beside the solve (steps) | meets the bar |", "|---" * (len(PHASES) + 6) + "|"]
    for r in results:
        phases = r["phases"]
        rest = r["total_s"] - sum(phases.get(p, 0.0) for p in PHASES)
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * (len(PHASES) + 4))
            continue
        name = f"{r['name']} (at its floor)" if r.get("at_floor") else r["name"]
        lines.append(f"| {name} | {r['step_s']:.3f} | " + " | ".join(f"{phases.get(p, 0.0):.2f}" for p in PHASES)
                     + f" | {rest:.2f} | {r['total_s']:.2f} | {_beside_solve_steps(r):.1f} | "
                     f"{'yes' if _meets(r) else 'no'} |")
    if batch_scale is None:
        models = "Models: " + "; ".join(f"**{r['name']}**: {MODELS[r['name']][0]}" for r in results) + "."
    else:
        models = (f"Models: the corpus families of `benchmarks/corpus_models.py` (docs/benchmarks/corpus.md), "
                  f"every example batch repeated {batch_scale} times, each family's own training step.")
    lines += ["", headline(results), "",
              f"CPU, torch {torch.__version__}, one thread, budget {BUDGET_FRACTION:.0%} of the measured "
              f"unoptimized peak. {models}"]
    if overheads_s is not None:
        lines += ["", f"The device's checkpoint overheads (`profiling/device_overheads.py`) are measured once per "
                      f"machine and kept beside the cached profiles: this run measured them before its first "
                      f"model, in {overheads_s:.2f} s, which a user's first profile on a machine pays once."]
    return "\n".join(lines) + "\n"


def _device_overheads_s(cache_folder: Path) -> float:
    """Measure the device's checkpoint overheads into ``cache_folder``, where every model's
    process reads them (as a user's later calls on the machine do); returns the seconds taken."""
    import planner.pipeline  # noqa: F401 - the imports a first call pays anyway, outside the time
    from profiling.cache import device_overheads_path
    from profiling.device_overheads import device_overheads_ms

    cpu = torch.device("cpu")
    started = time.perf_counter()
    device_overheads_ms(cpu, device_overheads_path(Path(cache_folder), {cpu}))
    return time.perf_counter() - started


def main() -> None:
    parser: argparse.ArgumentParser = table_arguments(__doc__.splitlines()[0], list(MODELS))
    parser.add_argument("--repeats", type=int, default=4, help="warm unoptimized steps timed before and after")
    parser.add_argument("--corpus", action="store_true",
                        help="time every corpus family instead (or those named by --families)")
    parser.add_argument("--families", nargs="*", default=None, help="with --corpus: these families only")
    parser.add_argument("--batch-scale", type=int, default=32,
                        help="with --corpus: repeat each example batch this many times (default 32)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = args.batch_scale if args.corpus else None
    if args.one:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(measure_one(args.one, args.repeats, scale)))
        return
    benchmark_logging()
    overheads_s = _device_overheads_s(isolated_profile_cache())
    names = args.models
    if args.corpus:
        from corpus_models import FAMILIES

        unknown = sorted(set(args.families or ()) - set(FAMILIES))
        if unknown:
            parser.error(f"unknown families {unknown}; choose among {sorted(FAMILIES)}")
        names = args.families or list(FAMILIES)
    results = []
    for name in names:
        log.info("%s: optimize in a fresh process", name)
        command = [sys.executable, __file__, "--one", name, "--repeats", str(args.repeats), "--threads", str(args.threads)]
        if args.corpus:
            command += ["--corpus", "--batch-scale", str(args.batch_scale)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:  # one row says why; the table goes on
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            log.warning("%s failed: %s", name, last)
            results.append({"name": name, "error": last[:200]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    page = "optimize_time_corpus" if args.corpus else "optimize_time"
    title = "End-to-end time of optimize on the corpus" if args.corpus else "End-to-end time of optimize"
    doc = {"name": page, "title": title, "about": DOC_ABOUT}
    publish_table(markdown(results, scale, overheads_s), args.out, f"{page}.md", doc if args.docs else None)


if __name__ == "__main__":
    main()
