"""The promises on a corpus no one tuned on: every family of :mod:`corpus_models` (HuggingFace
families from tiny configs, hand-written patterns), planned at checkpoint-every-layer's
measured peak and at 70 % and 50 % of the unoptimized peak.

For each family: which capture path the plans took (``plan.capture``: the FX graph, or module
calls); the measured peak of the unoptimized step, of every-layer (HuggingFace's
``gradient_checkpointing_enable`` where the family supports it, a hand-written equivalent
otherwise) and of each plan; the prediction error of each plan's peak; whether the loss and every
parameter gradient of one step from the same seed equal the original module's bit for bit
(``torch.equal``); the plans' extra FLOPs against every-layer's; step time as a ratio to the
unoptimized step (interleaved repeats, median); and the first ``optimize`` call's wall time (capture,
profile, solve, rewrite), in seconds and in unoptimized steps. The step is the family's own:
``loss_fn(model(**batch))`` for a criterion outside the model, else the output's ``loss``, the
output dropped before the backward. A family that fails is a row with its one-line error.

    python benchmarks/corpus.py [--families gpt2 llama bert] [--device cpu|cuda] [--quick] [--docs]

``--quick`` plans at every-layer's peak only, with fewer timing repeats. ``--docs`` writes
``docs/benchmarks/corpus.md`` (``corpus_cuda.md`` on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import GIB, MIB, ROOT, add_docs_argument, benchmark_logging, isolated_profile_cache, publish_table, \
    step_seconds, step_time_ratios, to_device
from corpus_models import FAMILIES, SKIPPED, Family

from planner import InfeasibleBudgetError, optimize
from planner.milp.highs import PlannerHiGHS
from profiling import StepInputs, TrainingStep, measure_step_flops, measure_step_peak_bytes

log = logging.getLogger("corpus")

#: the budgets each family is planned at, as (label, fraction of the unoptimized peak); None is
#: every-layer's measured peak
TARGETS: tuple[tuple[str, float | None], ...] = (("every layer", None), ("70 %", 0.70), ("50 %", 0.50))
#: a prediction within this share of the measured peak holds the promise
PREDICTION_TOLERANCE = 0.02
#: the captured graph with nothing recomputed steps at most this share slower than eager
CAPTURED_TOLERANCE = 0.03
#: steps of one module timed in a row as one sample: a step of a few milliseconds swings by 10 %
#: or more, the sum of a few steps less
STEPS_PER_SAMPLE = 2
#: the captured-over-eager ratio, a 3 % promise, is timed apart from the plans: this many
#: interleaved samples per timing repeat, each of :data:`CAPTURED_STEPS_PER_SAMPLE` steps (a
#: spread of about 2 % on 10 ms steps, against 5 % from 15 single steps)
CAPTURED_SAMPLES_PER_REPEAT = 3
CAPTURED_STEPS_PER_SAMPLE = 4
#: fast planning options (one timing pass)
QUICK_OPTIONS = {"timing_repeats": 1}

DOC_ABOUT = """\
## How to read it

One row per family of `benchmarks/corpus_models.py`: HuggingFace families built from tiny
configs (2 layers, width 64, 4 x 64 tokens, vocabulary 1024, 4 x 32 x 32 images; attention dropout
0.1 where the family has it), and hand-written patterns (layers as a loop body over three
module lists, a criterion outside the model, tied weights, dict outputs, a BatchNorm CNN with
in-place ReLU, ...). The step is the family's own: `loss_fn(model(**batch))` where the
criterion is outside the model, else the output's `loss`; the output is dropped before the
backward.

- **capture**: the path the plans took: `graph` (the captured FX graph, node by node),
  `graph-breaks` (the ATen ops of the eager step, where `torch.export` could not capture the
  model: a branch on tensor values, a module that replaces its own submodule in its forward) or
  `modules` (whole submodule calls checkpointed).
- **none**: measured peak and step time (median) of the unoptimized step.
- **every layer**: measured peak of every-layer
  (`gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`,
  or, marked `hand`, each layer under non-reentrant `torch.utils.checkpoint` where the family
  has no HuggingFace support, or its layers are not one list), with its share of the
  unoptimized peak.
- **at every layer / 70 % / 50 %**: the plan's measured peak at a budget of every-layer's
  measured peak, and of 70 % and 50 % of the unoptimized peak, as a share of the unoptimized
  peak; `fits` when it is within the budget, `OVER` when not. A budget below every plan the
  planner finds is planned at the smallest feasible budget it names (`min`, its share of the
  unoptimized peak in brackets).
- **prediction**: the worst error of a plan's predicted peak against its measured peak,
  (predicted - measured) / measured: negative is an underestimate.
- **bit for bit**: the loss and every parameter gradient after one step from the same seed,
  each plan against the original module, with `torch.equal`.
- **FLOPs**: extra FLOPs (`FlopCounterMode`) of the plan at every-layer's peak over
  every-layer's extra FLOPs (at most 1 holds "never lose to the obvious plan"; `-` where
  every-layer recomputes nothing the counter sees).
- **step time**: every-layer's and the plan's (at every-layer's peak) step time over the
  unoptimized step's, interleaved repeats in one process (each sample two steps in a row),
  median.
- **captured / eager**: step time of the captured graph with nothing recomputed (`optimize` at
  twice the unoptimized peak) over the eager module's: timed apart, three times as many
  interleaved samples as the step-time column, each four steps in a row, median.
- **optimize (solve)**: wall time of the first `optimize` call (capture, profile, solve, measured
  check, rewrite) in seconds and in unoptimized steps, and the seconds of the solve that made
  its plan (`plan.solve_s`); later budgets reuse the cached profile.

The headline counts the families that hold each promise; a family whose run raised is counted
against every promise.
"""

OUTPUT_HELD_ABOUT = """
This page plans and measures the other convention: a loop that keeps the model's output until
the backward ends (`optimize(..., output_held=True)`, CLI `--output-held`); every-layer and the
unoptimized step are measured the same way.
"""


@dataclasses.dataclass
class PlanResult:
    target: str
    budget_bytes: int
    at_minimum: bool = False
    capture: str = "-"
    peak_bytes: int = 0
    predicted_bytes: int = 0
    extra_flops: int = 0
    bitwise: bool | None = None
    #: where the step differs: "loss", or the number of gradients that differ
    mismatch: str = ""
    optimize_s: float = float("nan")
    #: seconds of the solve that made the returned plan (``plan.solve_s``)
    solve_s: float = float("nan")
    step_time: float = float("nan")
    error: str = ""

    @property
    def fits(self) -> bool:
        return not self.error and self.peak_bytes <= self.budget_bytes

    @property
    def prediction_error(self) -> float:
        return (self.predicted_bytes - self.peak_bytes) / self.peak_bytes if self.peak_bytes else float("nan")


@dataclasses.dataclass
class FamilyResult:
    name: str
    group: str
    anchor: str
    base_peak_bytes: int = 0
    base_flops: int = 0
    base_step_s: float = float("nan")
    every_peak_bytes: int = 0
    every_extra_flops: int = 0
    every_step_time: float = float("nan")
    #: the captured graph with nothing recomputed (``optimize`` at a roomy budget), over eager
    captured_step_time: float = float("nan")
    plans: list[PlanResult] = dataclasses.field(default_factory=list)
    error: str = ""
    wall_s: float = 0.0

    def plan(self, target: str) -> PlanResult | None:
        return next((p for p in self.plans if p.target == target), None)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 200 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _call(module: torch.nn.Module, inputs: StepInputs) -> Any:
    return module(*inputs.args, **inputs.kwargs)


def _step_flops(module: torch.nn.Module, inputs: StepInputs, step: TrainingStep, seed: int = 1) -> int:
    """FLOPs of one step of ``module`` from ``seed``: a model that skips layers at random
    (wav2vec2's layer drop) runs the same layers in every module it is compared with."""
    torch.manual_seed(seed)
    return measure_step_flops(module, inputs, step=step)


def step_result(family: Family, module: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                inputs: StepInputs, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients (by the original model's names) of one step of ``module``
    from ``seed``; the gradients are cleared before and after."""
    for p in params.values():
        p.grad = None
    torch.manual_seed(seed)
    output = _call(module, inputs)
    loss = family.loss(output)
    del output
    loss.backward()
    grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    return loss.detach(), grads


def compare_steps(reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
                  other: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> tuple[bool, str]:
    """Whether two steps' loss and gradients are bitwise equal, and if not, what differs."""
    differ = []
    if not torch.equal(reference[0], other[0]):
        differ.append("loss")
    if reference[1].keys() != other[1].keys():
        differ.append(f"{len(reference[1].keys() ^ other[1].keys())} gradients missing")
    grads = [n for n in reference[1].keys() & other[1].keys() if not torch.equal(reference[1][n], other[1][n])]
    if grads:
        differ.append(f"{len(grads)} of {len(reference[1])} gradients")
    return not differ, ", ".join(differ)


def _optimize(family: Family, model: torch.nn.Module, example: Any, budget_bytes: int, options: dict[str, Any]
              ) -> tuple[torch.nn.Module, bool, float]:
    """``optimize`` at ``budget_bytes``, or at the smallest feasible budget it names; whether it was
    the smallest, and the seconds of the call that returned."""
    started = time.perf_counter()
    try:
        return (optimize(model, example, budget_gb=budget_bytes / GIB, loss_fn=family.loss_fn, **options), False,
                time.perf_counter() - started)
    except InfeasibleBudgetError as exc:
        first_s = time.perf_counter() - started
        log.info("%s: %d bytes infeasible; planning at the smallest feasible budget %d", family.name, budget_bytes,
                 exc.min_feasible_bytes)
        started = time.perf_counter()
        opt = optimize(model, example, budget_gb=exc.min_feasible_bytes / GIB, loss_fn=family.loss_fn, **options)
        return opt, True, first_s + time.perf_counter() - started


def run_family(family: Family, device: torch.device, repeats: int, targets: tuple[tuple[str, float | None], ...],
               options: dict[str, Any]) -> FamilyResult:
    """Measure one family; any failure is recorded, per plan where it can be, never raised."""
    started = time.perf_counter()
    result = FamilyResult(family.name, family.group, family.anchor)
    try:
        _measure_family(family, device, repeats, targets, options, result)
    except Exception as exc:  # noqa: BLE001 - one row per failing family, the table goes on
        result.error = one_line(exc)
        log.info("%s: failed: %s", family.name, result.error)
    result.wall_s = time.perf_counter() - started
    return result


def _measure_family(family: Family, device: torch.device, repeats: int, targets: tuple[tuple[str, float | None], ...],
                    options: dict[str, Any], result: FamilyResult) -> None:
    model, example = to_device(*family.build(), device)
    inputs = StepInputs.from_example(example)
    step = TrainingStep(loss_fn=family.loss_fn, output_held=options.get("output_held", False))
    params = dict(model.named_parameters())
    every = family.every_layer(model)
    result.base_peak_bytes = measure_step_peak_bytes(model, inputs, step=step)
    result.base_flops = _step_flops(model, inputs, step)
    result.every_peak_bytes = measure_step_peak_bytes(every, inputs, step=step)
    result.every_extra_flops = _step_flops(every, inputs, step) - result.base_flops
    reference = step_result(family, model, params, inputs)
    # a budget above the unoptimized peak: the captured graph as optimize returns it, nothing recomputed
    captured = optimize(model, example, budget_gb=2 * result.base_peak_bytes / GIB, loss_fn=family.loss_fn,
                        **options)
    timed: list[tuple[PlanResult | None, torch.nn.Module]] = [(None, model), (None, every)]
    with tempfile.TemporaryDirectory(prefix="corpus-profiles-") as cache_dir:
        for target, fraction in targets:
            budget = result.every_peak_bytes if fraction is None else int(fraction * result.base_peak_bytes)
            row = PlanResult(target, budget)
            result.plans.append(row)
            try:
                opt, row.at_minimum, row.optimize_s = _optimize(family, model, example, budget,
                                                               {**options, "cache_dir": cache_dir})
                plan = opt.plan
                row.budget_bytes, row.capture = plan.budget_bytes, plan.capture
                row.predicted_bytes, row.solve_s = plan.predicted_peak_bytes, plan.solve_s
                row.peak_bytes = measure_step_peak_bytes(opt, inputs, step=step)
                row.extra_flops = _step_flops(opt, inputs, step) - result.base_flops
                row.bitwise, row.mismatch = compare_steps(reference, step_result(family, opt, params, inputs))
                timed.append((row, opt))
            except Exception as exc:  # noqa: BLE001 - this budget's cell says why
                row.error = one_line(exc)
                log.info("%s %s: failed: %s", family.name, target, row.error)
        result.base_step_s = statistics.median(step_seconds(model, inputs, device, step)
                                               for _ in range(max(3, repeats)))
        ratios = step_time_ratios([m for _, m in timed], inputs, repeats, device, step=step,
                                  steps_per_sample=STEPS_PER_SAMPLE)
        result.captured_step_time = step_time_ratios([model, captured], inputs, CAPTURED_SAMPLES_PER_REPEAT * repeats,
                                                     device, step=step,
                                                     steps_per_sample=CAPTURED_STEPS_PER_SAMPLE)[1]
    result.every_step_time = ratios[1]
    for (row, _), ratio in zip(timed[2:], ratios[2:]):
        assert row is not None
        row.step_time = ratio


# --------------------------------------------------------------------------- the table


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.2f}" if whole else "-"


def _plan_cell(r: FamilyResult, p: PlanResult | None) -> str:
    if p is None:
        return "-"
    if p.error:
        return f"error: {p.error}"
    cell = f"{_share(p.peak_bytes, r.base_peak_bytes)} {'fits' if p.fits else 'OVER'}"
    if p.at_minimum:
        cell += f" (min [{_share(p.budget_bytes, r.base_peak_bytes)}])"
    return cell


def _flops_cell(r: FamilyResult, p: PlanResult | None) -> str:
    if p is None or p.error:
        return "-"
    if r.every_extra_flops <= 0:
        return f"- ({p.extra_flops / r.base_flops:+.0%})" if r.base_flops else "-"
    return f"{p.extra_flops / r.every_extra_flops:.2f}"


def _bitwise_cell(r: FamilyResult) -> str:
    checked = [p for p in r.plans if p.bitwise is not None]
    if not checked:
        return "-"
    wrong = [f"{p.target}: {p.mismatch}" for p in checked if not p.bitwise]
    return "yes" if not wrong else "no (" + "; ".join(wrong) + ")"


def _prediction(r: FamilyResult) -> float | None:
    errors = [p.prediction_error for p in r.plans if not p.error and p.peak_bytes]
    return max(errors, key=abs) if errors else None


def promises(results: list[FamilyResult]) -> list[tuple[str, list[str], list[str]]]:
    """(promise, families that hold it, families that do not, each with why)."""
    out: list[tuple[str, list[str], list[str]]] = []

    def check(label: str, verdict: Any) -> None:
        held, failed = [], []
        for r in results:
            why = r.error or verdict(r)
            (failed if why else held).append(r.name if not why else f"{r.name} ({why})")
        out.append((label, held, failed))

    def every_plan_returned(r: FamilyResult) -> str:
        errs = [f"{p.target}: {p.error}" for p in r.plans if p.error]
        return "; ".join(errs)

    def budget_holds(r: FamilyResult) -> str:
        over = [f"{p.target}: {p.peak_bytes / MIB:.2f} MiB > {p.budget_bytes / MIB:.2f} MiB"
                for p in r.plans if not p.error and not p.fits]
        return "; ".join(over)

    def every_layer_met(r: FamilyResult) -> str:
        p = r.plan("every layer")
        if p is None or p.error:
            return "no plan"
        if p.at_minimum:
            return f"infeasible at every-layer's peak; smallest feasible {p.budget_bytes / r.every_peak_bytes:.2f}x it"
        if p.extra_flops > max(r.every_extra_flops, 0):
            return f"extra FLOPs {p.extra_flops:,} > every-layer's {r.every_extra_flops:,}"
        return ""

    def bitwise(r: FamilyResult) -> str:
        wrong = [f"{p.target}: {p.mismatch}" for p in r.plans if p.bitwise is False]
        return "; ".join(wrong) if wrong else ("" if any(p.bitwise for p in r.plans) else "not checked")

    def predicted(r: FamilyResult) -> str:
        worst = _prediction(r)
        if worst is None:
            return "no plan"
        return "" if abs(worst) <= PREDICTION_TOLERANCE else f"{worst:+.1%}"

    def no_slower(r: FamilyResult) -> str:
        p = r.plan("every layer")
        if p is None or p.error:
            return "no plan"
        return "" if p.step_time <= r.every_step_time else f"{p.step_time:.2f}x against {r.every_step_time:.2f}x"

    def captured_as_fast(r: FamilyResult) -> str:
        ratio = r.captured_step_time
        return "" if ratio <= 1 + CAPTURED_TOLERANCE else f"{ratio:.3f}x"

    def captured(r: FamilyResult) -> str:
        paths = {p.capture for p in r.plans if not p.error}
        if not paths:
            return "no plan"
        return "" if paths == {"graph"} else " and ".join(sorted(paths - {"graph"})) + " path"

    check("every budget returns a plan (or names its smallest feasible one, which plans)", every_plan_returned)
    check("the budget holds: every plan's measured peak within its budget", budget_holds)
    check("never lose to every-layer: a plan at every-layer's peak, extra FLOPs at most every-layer's",
          every_layer_met)
    check("exactly the user's computation: loss and every gradient bit for bit", bitwise)
    check(f"the prediction within {PREDICTION_TOLERANCE:.0%} of the measured peak", predicted)
    check("at every-layer's peak, a step no slower than every-layer's (timing: noisy on a shared CPU)", no_slower)
    check("captured as one graph (the others planned over their eager step's ops or module calls)", captured)
    check(f"the captured graph, nothing recomputed, within {CAPTURED_TOLERANCE:.0%} of eager's step time "
          "(timing: noisy on a shared CPU)", captured_as_fast)
    return out


def markdown(results: list[FamilyResult], where: str, repeats: int, wall_s: float, quick: bool,
             solver_note: str = "") -> str:
    total = len(results)
    lines = [f"{where}, torch {torch.__version__}, transformers {_transformers_version()}, {total} families, "
             f"{repeats} interleaved timing repeats{', quick (every-layer budget only)' if quick else ''}, "
             f"wall time {wall_s / 60:.1f} min.", ""]
    if solver_note:
        lines += [solver_note, ""]
    if SKIPPED:
        lines += ["Skipped (class missing): " + "; ".join(f"{k} ({v})" for k, v in SKIPPED.items()) + ".", ""]
    lines += ["| promise | families | fail |", "|---|---|---|"]
    for label, held, failed in promises(results):
        lines.append(f"| {label} | {len(held)} of {total} | {'; '.join(failed) if failed else '-'} |")
    lines += ["", "| family | group | capture | none | every layer | at every layer | at 70 % | at 50 % "
              "| prediction | bit for bit | FLOPs | step time (every layer, plan) | captured / eager | optimize (solve) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | {r.group} | error: {r.error} |" + " |" * 11)
            continue
        paths = sorted({p.capture for p in r.plans if not p.error}) or ["-"]
        every = f"{r.every_peak_bytes / MIB:.2f} MiB ({_share(r.every_peak_bytes, r.base_peak_bytes)})" + (
            ", hand" if r.anchor == "hand" else "")
        head = r.plan("every layer")
        worst = _prediction(r)
        first = r.plans[0] if r.plans else None
        optimize_cell = (f"{first.optimize_s:.1f} s ({first.optimize_s / r.base_step_s:,.0f} steps; "
                         f"solve {first.solve_s:.1f} s)" if first is not None and not first.error else "-")
        time_cell = f"{r.every_step_time:.2f}x, " + (f"{head.step_time:.2f}x" if head is not None and not head.error
                                                     else "-")
        lines.append(
            f"| {r.name} | {r.group} | {', '.join(paths)} | {r.base_peak_bytes / MIB:.2f} MiB, "
            f"{r.base_step_s * 1000:.0f} ms | {every} "
            f"| {_plan_cell(r, r.plan('every layer'))} | {_plan_cell(r, r.plan('70 %'))} "
            f"| {_plan_cell(r, r.plan('50 %'))} | {'-' if worst is None else f'{worst:+.1%}'} | {_bitwise_cell(r)} "
            f"| {_flops_cell(r, head)} | {time_cell} | {r.captured_step_time:.3f}x | {optimize_cell} |")
    lines += ["", "Families: " + "; ".join(f"**{r.name}**: {FAMILIES[r.name].about}" for r in results) + "."]
    return "\n".join(lines) + "\n"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", choices=list(FAMILIES), default=None,
                        help="default: every family of corpus_models")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true",
                        help="plan at every-layer's peak only, one profiling timing pass, 3 timing repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing repeats (default 15; quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1: steadier timings)")
    parser.add_argument("--output-held", action="store_true",
                        help="plan and measure the loop that holds the output through the backward "
                             "(optimize(output_held=True)); its page is corpus_output_held.md")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    args = parser.parse_args()
    benchmark_logging()
    isolated_profile_cache()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    names = args.families or list(FAMILIES)
    repeats = args.repeats or (3 if args.quick else 15)
    targets = TARGETS[:1] if args.quick else TARGETS
    options: dict[str, Any] = dict(QUICK_OPTIONS) if args.quick else {}
    if args.output_held:
        options["output_held"] = True
    where = (f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"CPU, {args.threads} thread(s)")
    started = time.perf_counter()
    results = []
    solver_note = ""
    for name in names:
        result = run_family(FAMILIES[name], device, repeats, targets, options)
        results.append(result)
        if PlannerHiGHS.abandoned and not solver_note:
            solver_note = (f"HiGHS abandoned a stuck solve during {name} ({PlannerHiGHS.abandoned[0]}): that family "
                           "and the ones after it solved with CBC while the stuck solve kept one core busy, so "
                           "their optimize times and step times are slower than a run without it.")
        head = result.plan("every layer")
        log.info("%s: %s in %.0f s", name, result.error or (
            f"{len(result.plans)} plans, "
            f"{'bit for bit' if all(p.bitwise for p in result.plans) else 'NOT bit for bit'}, "
            f"at every layer {_plan_cell(result, head)}"), result.wall_s)
    text = markdown(results, where, repeats, time.perf_counter() - started, args.quick, solver_note)
    stem = ("corpus" if device.type == "cpu" else "corpus_cuda") + ("_output_held" if args.output_held else "")
    _write_csv(results, args.out / f"{stem}.csv")
    doc = {"name": stem, "title": "The promises on a corpus of model families no one tuned on"
           + ("" if device.type == "cpu" else ", on a GPU")
           + (", the output held through the backward" if args.output_held else ""),
           "about": DOC_ABOUT + (OUTPUT_HELD_ABOUT if args.output_held else "")} if args.docs else None
    publish_table(text, args.out, f"{stem}.md", doc=doc)


def _write_csv(results: list[FamilyResult], path: Path) -> None:
    import pandas

    rows = []
    for r in results:
        family = {k: v for k, v in dataclasses.asdict(r).items() if k != "plans"}
        rows += [{**family, **dataclasses.asdict(p)} for p in r.plans] or [family]
    path.parent.mkdir(parents=True, exist_ok=True)
    pandas.DataFrame(rows).to_csv(path, index=False)


if __name__ == "__main__":
    main()
