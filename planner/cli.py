"""The ``ckpt-planner`` command.

    ckpt-planner report PATH --budget-gb 6 [--sweep] [--format text|json|csv|markdown] [--plot out.png]
                        [--target h100] [--bound-s 60 | --no-bound]
    ckpt-planner check TARGET --baseline memory.json [--tolerance 5%] [--budget-gb 6] [--update]
    ckpt-planner plan examples/models.py:gpt2 --budget-gb 0.25

``report`` loads a saved model (a ``torch.export`` ``.pt2``, a HuggingFace ``save_pretrained``
directory, or, with ``--trust-pickle``, a whole pickled module), profiles one training step and
reports the unoptimized peak, the plan at the budget, the largest activations and, with
``--sweep``, the memory/overhead Pareto front, and a lower bound on the recompute time any plan
needs at the budget (:mod:`planner.reach`: the covering bound, or with ``--bound-s`` also the
segment covering bound and the segment account, each solved for up to that long; ``--no-bound``
leaves it out). ``plan`` does the same planning for a Python
entry point ``FILE_OR_MODULE:FUNCTION`` that returns ``(model, example_inputs)``.

Exit codes: 0 plan found, 1 a ``check`` regression, 2 usage or input error, 3 budget infeasible
(the message names the smallest feasible budget). Errors are one line on stderr, starting
``ckpt-planner:``, that say what to do; options are checked before a model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from planner.errors import InfeasibleBudgetError, InputError, PlannerError
from planner.pipeline import MAX_PLAUSIBLE_BUDGET_GB, _budget_bytes

__all__ = ["main", "load_entry_point"]

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3

#: budgets below this many bytes are refused as a unit mistake: no training step fits in under
#: a KiB, and the planner's arithmetic leaves no room at all under a few bytes
MIN_PLAUSIBLE_BUDGET_BYTES = 1024
#: the most budgets ``--sweep`` plans: each is a solve, and a front of more points shows nothing new
MAX_SWEEP_POINTS = 100

#: the Python API's argument names, as the command line spells them, for messages raised below it
_FLAG_NAMES = (
    ("budget_gb=", "--budget-gb "),
    ("budget_gb", "--budget-gb"),
    ("max_stages", "--max-stages"),
    ("max_solve_s", "--max-solve-s"),
    ("simplify_attention_masks", "--simplify-attention-masks"),
)
#: Python API arguments the command line does not have: advice naming them is left out
_API_ONLY_ARGUMENTS = ("reserve_gb",)


def load_entry_point(spec: str) -> tuple[Any, Any]:
    """Call ``path/to/file.py:function`` or ``package.module:function`` and return its
    ``(model, example_inputs)``."""
    target, sep, func_name = spec.rpartition(":")
    if not sep or not target or not func_name:
        raise PlannerError(f"entry point {spec!r} must look like file.py:function or module:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise PlannerError(f"entry point file {target!r} does not exist")
        sys.path.insert(0, str(path.resolve().parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise PlannerError(f"cannot import {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PlannerError(f"cannot import module {target!r}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise PlannerError(f"{target!r} has no function {func_name!r}")
    result = func()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise PlannerError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result


def _plan_command(args: argparse.Namespace) -> int:
    from planner.pipeline import optimize

    model, example_inputs = load_entry_point(args.target)
    opt = optimize(model, example_inputs, budget_gb=args.budget_gb, max_stages=args.max_stages,
                   exact=args.exact or None, max_solve_s=args.max_solve_s,
                   simplify_attention_masks=args.simplify_attention_masks)
    plan = opt.plan
    if args.format == "json":
        print(json.dumps({
            "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "unoptimized_peak_bytes": plan.unoptimized_peak_bytes,
            "measured_unoptimized_peak_bytes": plan.measured_unoptimized_peak_bytes,
            "recompute_ms": plan.recompute_ms,
            "recompute_flops": plan.recompute_flops,
            "step_ms": plan.step_ms,
            "optimality_gap": plan.optimality_gap,
            "hit_time_limit": plan.hit_time_limit,
            "computation_changes": list(plan.computation_changes),
            "segments": [list(s.node_names) for s in plan.segments],
        }, indent=2))
    else:
        print(plan.summary())
    return EXIT_OK


def _entry_point_name(spec: str) -> str:
    target, _, func = spec.rpartition(":")
    return f"{Path(target).stem}:{func}" if target.endswith(".py") else spec


def _load_target(args: argparse.Namespace, allow_entry_point: bool) -> tuple[str, Any, Any]:
    """``(name, module or captured graph, StepInputs)`` for a saved-model path or an entry point."""
    from profiling.load import load_model
    from profiling.measure import StepInputs

    target = args.target
    if not Path(target).exists() and ":" in target:
        if not allow_entry_point:
            raise PlannerError(f"{target} does not exist; {args.command} takes a saved model (a .pt2, a "
                               f"save_pretrained directory or a pickled module): for file.py:function use "
                               f"`ckpt-planner plan` or `ckpt-planner check`")
        model, example_inputs = load_entry_point(target)
        return _entry_point_name(target), model, StepInputs.from_example(example_inputs)
    loaded = load_model(
        target,
        input_shapes=args.input_shape,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        image_size=args.image_size,
        trust_pickle=args.trust_pickle,
    )
    return loaded.name, loaded.module, loaded.inputs


def _captured(module: Any, inputs: Any, args: argparse.Namespace) -> Any:
    import torch.fx

    from profiling.trace import prepare_saved_program, trace_module

    if isinstance(module, torch.fx.GraphModule):  # a saved program: its graph, made plannable as a captured one
        return prepare_saved_program(module, Path(args.target).name)
    return trace_module(module, inputs, simplify_attention_masks=args.simplify_attention_masks)


def _check_command(args: argparse.Namespace) -> int:
    from planner.check import baseline_from, compare, junit_xml, parse_tolerance, read_baseline, render_check
    from planner.check import write_baseline
    from planner.pipeline import plan_for_budget
    from profiling.profile import profile_graph

    tolerance = parse_tolerance(args.tolerance)
    if args.update:
        _check_parent_exists(args.baseline, "--baseline")
    if args.junit:
        _check_parent_exists(args.junit, "--junit")
    baseline = None
    if not args.update or Path(args.baseline).exists():
        try:
            baseline = read_baseline(args.baseline)
        except PlannerError:
            if not args.update:
                raise
    name, module, inputs = _load_target(args, allow_entry_point=True)
    graph = profile_graph(_captured(module, inputs, args), inputs, fake=True)
    budgets = [int(gb * 2**30) for gb in args.budget_gb or []]
    if not budgets and baseline is not None:
        budgets = [p["budget_bytes"] for p in baseline["plans"]]
    plans = []
    for budget in budgets:
        try:
            plan = plan_for_budget(graph, budget / 2**30, max_stages=args.max_stages, exact=args.exact or None,
                                   max_solve_s=args.max_solve_s)
            plans.append((budget, plan, None))
        except InfeasibleBudgetError as exc:
            plans.append((budget, None, exc.min_feasible_bytes))
    current = baseline_from(graph, [(b, dataclasses.replace(p, budget_bytes=b) if p else None, m)
                                    for b, p, m in plans], name)
    if args.update:
        if baseline is not None and baseline["model"] == name:
            sys.stdout.write(render_check(compare(baseline, current, tolerance), args.format))
        write_baseline(args.baseline, current)
        print(f"baseline written to {args.baseline}", file=sys.stderr)
        return EXIT_OK
    assert baseline is not None
    result = compare(baseline, current, tolerance)
    sys.stdout.write(render_check(result, args.format))
    if args.junit:
        try:
            Path(args.junit).write_text(junit_xml(result))
        except OSError as exc:
            raise PlannerError(f"--junit {args.junit} could not be written: {exc.strerror or exc}") from None
    return EXIT_REGRESSION if result.regressed else EXIT_OK


def _check_parent_exists(path: str, flag: str) -> None:
    """Refuse an output file in a folder that does not exist, before any work: a typo in the
    path should not silently create folders."""
    parent = Path(path).parent
    if not parent.is_dir():
        raise PlannerError(f"{flag} {path}: folder {parent} does not exist; create it first or pass another path")
    if Path(path).is_dir():
        raise PlannerError(f"{flag} {path} is a folder; pass a file name")


def _report_command(args: argparse.Namespace) -> int:
    from planner.pipeline import plan_for_budget
    from planner.report import build_report, render
    from planner.sweep import sweep
    from profiling.profile import profile_graph

    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise PlannerError(f"--plot {args.plot}: the plot is written as PNG; give a .png file name")
    if args.target_device:
        from profiling.roofline import DEVICE_SPECS

        if args.target_device.lower() not in DEVICE_SPECS:  # before loading: the profiler would say so later
            raise PlannerError(f"unknown target device {args.target_device!r}; use one of {sorted(DEVICE_SPECS)}")
    name, module, inputs = _load_target(args, allow_entry_point=False)
    if args.target_device:
        # fake tensors: nothing allocated, times from the target's roofline
        graph = profile_graph(_captured(module, inputs, args), inputs, fake=True, target=args.target_device)
    else:
        graph = profile_graph(_captured(module, inputs, args), inputs)
    plan = plan_for_budget(graph, args.budget_gb, max_stages=args.max_stages, exact=args.exact or None,
                           max_solve_s=args.max_solve_s)
    plans = (sweep(graph, points=args.sweep, max_stages=args.max_stages, max_solve_s=args.max_solve_s)
             if args.sweep else [])
    bound = None
    if not args.no_bound:
        from planner.costgraph import protect_reads_before_writes
        from planner.reach import COVERING_TIME_LIMIT_S, recompute_bound

        bound = recompute_bound(protect_reads_before_writes(graph), plan.budget_bytes,
                                time_limit_s=args.bound_s or COVERING_TIME_LIMIT_S, with_account=args.bound_s > 0)
    report = build_report(graph, plan, model_name=name, sweep_plans=plans, bound=bound)
    sys.stdout.write(render(report, args.format))
    if args.plot:
        from planner.plot import plot_report

        plot_report(report, args.plot)
    return EXIT_OK


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors on one line like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ckpt-planner: {_printable(message)}; see `{self.prog} --help`\n")


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum``."""
    bounds = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    return parse


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, positive (or zero where ``allow_zero``)."""
    bounds = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bounds}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bounds}, got {text}")
        return value

    return parse


def _gib(text: str) -> float:
    """An argparse type: a number (its range is checked by :func:`_check_budget`, with advice)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB such as 6 or 0.5, got {text!r}") from None


def _check_budget(budget_gb: float) -> None:
    """Raise :class:`InputError` for a ``--budget-gb`` no plan can be made for, before anything
    is loaded: the checks of :func:`planner.pipeline._budget_bytes`, worded for the command line;
    a value that looks like another unit gets a suggested ``--budget-gb`` only where that value
    would itself be accepted."""
    if math.isfinite(budget_gb) and budget_gb > MAX_PLAUSIBLE_BUDGET_GB:
        raise InputError(f"--budget-gb {budget_gb:g} looks like the wrong unit: it is in GiB (2**30 bytes), and no "
                         f"single device has more than {MAX_PLAUSIBLE_BUDGET_GB:g} GiB{_unit_hint(budget_gb)}")
    budget_bytes = _budget_bytes(budget_gb, "--budget-gb")
    if budget_bytes < MIN_PLAUSIBLE_BUDGET_BYTES:
        raise InputError(f"--budget-gb {budget_gb:g} is {budget_bytes} bytes, less than any training step holds: "
                         f"the budget is in GiB (2**30 bytes), e.g. --budget-gb 0.5 for 512 MiB")


def _unit_hint(budget_gb: float) -> str:
    """'; for N MiB pass --budget-gb X' for each unit whose conversion is a valid budget."""
    hints = []
    for unit, per_gib, smallest in (("MiB", 2**10, 0), ("bytes", 2**30, 2**20)):
        suggestion = f"{budget_gb / per_gib:.4g}"
        if budget_gb >= smallest and 0 < float(suggestion) <= MAX_PLAUSIBLE_BUDGET_GB:
            hints.append(f"for {budget_gb:g} {unit} pass --budget-gb {suggestion}")
    return "; " + "; ".join(hints) if hints else "; pass the budget in GiB"


def _for_the_command_line(message: str) -> str:
    """A library error message as the command line shows it: one line, the API's argument names
    spelled as flags, and advice about arguments the command line lacks left out. Wording only:
    which error it is was decided by its type."""
    # libraries append details on further lines (a wrapped exception's own text): keep the first
    lines = [line.strip() for line in message.split("\n") if line.strip()]
    text = _printable(lines[0]) if lines else "failed without a message"
    for name in _API_ONLY_ARGUMENTS:
        text = re.sub(rf"\s*\([^()]*\b{name}\b[^()]*\)", "", text)
        pieces = re.split(r"(; |, or )", text)
        kept = [pieces[0]]
        for separator, clause in zip(pieces[1::2], pieces[2::2]):
            if name not in clause:
                kept += [separator, clause]
        if name in kept[0] and len(kept) > 2:
            kept = kept[2:]
        text = "".join(kept)
    for api_name, flag in _FLAG_NAMES:
        text = text.replace(api_name, flag)
    return text


def _printable(text: str) -> str:
    """``text`` with control characters escaped: a value typed on the command line and echoed in
    a message must not break it over lines (str.splitlines also breaks at \\x1c-\\x1e, \\x85...)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _add_verbose(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log progress")


def _add_input_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-shape", action="append", metavar="SPEC",
                        help="an input as 2x3x224x224:float32; repeat for several positional inputs")
    parser.add_argument("--batch-size", type=_int_at_least(1), default=1, help="HuggingFace directory: batch size")
    parser.add_argument("--seq-len", type=_int_at_least(1), default=128,
                        help="HuggingFace directory: tokens per sequence")
    parser.add_argument("--image-size", type=_int_at_least(1), help="HuggingFace directory: image side in pixels")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow unpickling PATH (runs code from the file)")
    _add_max_stages(parser)
    _add_solve_options(parser)


def _add_max_stages(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-stages", type=_int_at_least(1), default=32,
                        help="stages the graph is reduced to before solving (default 32)")


def _add_solve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simplify-attention-masks", action="store_true",
                        help="pass is_causal instead of a constant causal mask to attention where the model "
                             "passes the mask: a faster kernel, but other rounding and attention-dropout "
                             "stream than the model's own (labelled in the output)")
    parser.add_argument("--exact", action="store_true",
                        help="prove the plan the cheapest over its stages or find a cheaper one (slower on "
                             "large graphs; by default it runs under 64 compute nodes, and under 512 where "
                             "the first plan leaves over 1 %% of the budget unused)")
    parser.add_argument("--max-solve-s", type=_seconds(allow_zero=False), metavar="SECONDS",
                        help="stop improving each plan after SECONDS of solving and use the cheapest found by "
                             "then (the first ILP still runs to its own limit); default: no bound, so plans do "
                             "not depend on the machine's speed")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ckpt-planner", description="Automatic activation-checkpoint planner.")
    _add_verbose(parser, default=False)
    # -v is accepted after the subcommand too; suppressed there, so it does not reset the
    # value given before the subcommand
    common = _Parser(add_help=False)
    _add_verbose(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", parents=[common], help="report what checkpointing buys on a saved model")
    report.add_argument("target", metavar="PATH",
                        help="a .pt2 from torch.export.save, a save_pretrained directory, or a pickled module")
    report.add_argument("--budget-gb", type=_gib, required=True, help="peak training-step memory, GiB")
    report.add_argument("--sweep", type=_int_at_least(2, MAX_SWEEP_POINTS), nargs="?", const=8, default=0,
                        metavar="N", help=f"also plan N budgets (default 8, at most {MAX_SWEEP_POINTS}) from the "
                                          f"minimum to the unoptimized peak")
    report.add_argument("--format", choices=("text", "json", "csv", "markdown"), default="text")
    report.add_argument("--plot", metavar="FILE.png", help="draw memory over the step (and the Pareto front)")
    report.add_argument("--bound-s", type=_seconds(allow_zero=True), default=0.0, metavar="SECONDS",
                        help="the report always gives a quick lower bound on the recompute time any plan (kept "
                             "outputs included) needs at the budget (the covering bound, seconds at most); this "
                             "also solves the segment covering bound and the segment account, each for up to SECONDS "
                             "(HiGHS), which know what a recompute holds in the backward: often a tighter bound")
    report.add_argument("--no-bound", action="store_true", help="skip the lower bound")
    report.add_argument("--target", dest="target_device", metavar="DEVICE",
                        help="plan for another device without running there: profile on fake tensors (bytes "
                             "from shapes, nothing allocated) and time ops with DEVICE's roofline "
                             "(cpu, l4, a100, a100-80gb, h100, h200)")
    _add_input_options(report)
    report.set_defaults(func=_report_command)

    check = sub.add_parser("check", parents=[common],
                           help="fail when peak training memory grew against a baseline file")
    check.add_argument("target", metavar="TARGET",
                       help="a saved model (as for report) or file.py:function / module:function "
                            "returning (model, example_inputs)")
    check.add_argument("--baseline", required=True, metavar="FILE.json", help="the baseline to compare with")
    check.add_argument("--tolerance", default="5%", help="allowed growth of the peak, e.g. 5%% or 0.05 (default 5%%)")
    check.add_argument("--budget-gb", type=_gib, action="append",
                       help="also plan at this budget (repeatable); default: the baseline's budgets")
    check.add_argument("--update", action="store_true",
                       help="write the current figures as the new baseline (its folder must exist)")
    check.add_argument("--format", choices=("text", "json"), default="text")
    check.add_argument("--junit", metavar="FILE.xml", help="also write the result as JUnit XML")
    _add_input_options(check)
    check.set_defaults(func=_check_command)

    plan = sub.add_parser("plan", parents=[common],
                          help="plan checkpoints for a model given by a Python entry point")
    plan.add_argument("target", help="file.py:function or module:function returning (model, example_inputs)")
    plan.add_argument("--budget-gb", type=_gib, required=True, help="peak training-step memory, GiB")
    _add_max_stages(plan)
    _add_solve_options(plan)
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.set_defaults(func=_plan_command)
    return parser


def _budgets_of(args: argparse.Namespace) -> list[float]:
    budgets = args.budget_gb
    if budgets is None:
        return []
    return list(budgets) if isinstance(budgets, list) else [budgets]


class _HeldWarnings(logging.Handler):
    """Keeps the warnings logged while a command runs, to show once it has succeeded: a failed
    command prints its one line alone (a busy machine's timing warning says nothing about why
    a budget is infeasible)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def show(self) -> None:
        for record in self.records:
            print(self.format(record), file=sys.stderr)


@contextmanager
def _logging(verbose: bool) -> Iterator[_HeldWarnings | None]:
    """With ``-v``, progress is logged as it happens; without, warnings are held (see
    :class:`_HeldWarnings`)."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        yield None
        return
    held = _HeldWarnings()
    root = logging.getLogger()
    root.addHandler(held)
    try:
        with _transformers_errors_only():
            yield held
    finally:
        root.removeHandler(held)


@contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """transformers logs through a handler of its own, past the held warnings, and warns about
    configs while a model runs: keep it to errors, unless the user set TRANSFORMERS_VERBOSITY.
    The variable is read when transformers is first imported, so a process that imports it
    during the command keeps that level afterwards."""
    if "TRANSFORMERS_VERBOSITY" in os.environ:
        yield
        return
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    imported = sys.modules.get("transformers.utils.logging")
    level = imported.get_verbosity() if imported is not None else None
    if imported is not None:
        imported.set_verbosity_error()
    try:
        yield
    finally:
        del os.environ["TRANSFORMERS_VERBOSITY"]
        if imported is not None and level is not None:
            imported.set_verbosity(level)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (argparse's own exits, such as ``--help``, too)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    with _logging(args.verbose) as held:
        try:
            for budget_gb in _budgets_of(args):
                _check_budget(budget_gb)
            code = int(args.func(args))
        except InfeasibleBudgetError as exc:
            print(f"ckpt-planner: {_for_the_command_line(str(exc))}", file=sys.stderr)
            return EXIT_INFEASIBLE
        except PlannerError as exc:
            print(f"ckpt-planner: {_for_the_command_line(str(exc))}", file=sys.stderr)
            return EXIT_USAGE
        if held is not None:
            held.show()
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
