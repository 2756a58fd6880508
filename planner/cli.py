"""The ``ckpt-planner`` command.

    ckpt-planner report PATH --budget-gb 6 [--sweep] [--format text|json|csv|markdown] [--plot out.png]
                        [--target h100] [--bound-s 60 | --no-bound] [--trace-method graph-breaks]
    ckpt-planner check TARGET --baseline memory.json [--tolerance 5%] [--budget-gb 6] [--update]
    ckpt-planner plan examples/models.py:gpt2 --budget-gb 0.25

``report`` loads a saved model (a ``torch.export`` ``.pt2``, a HuggingFace ``save_pretrained``
directory, or, with ``--trust-pickle``, a whole pickled module), profiles one training step and
reports the unoptimized peak, the plan at the budget, the largest activations and, with
``--sweep``, the memory/overhead Pareto front, and a lower bound on the recompute time any plan
needs at the budget (:mod:`planner.bounds.reach`: the covering bound, or with ``--bound-s`` also the
segment covering bound and the segment account, each solved for up to that long; ``--no-bound``
leaves it out). ``plan`` does the same planning for a Python
entry point ``FILE_OR_MODULE:FUNCTION`` that returns ``(model, example_inputs)``. A model
``torch.export`` cannot capture is planned on the graph-break path, else the module path
(:mod:`planner.cli_capture`; ``--trace-method`` picks one), and the output names the path.

Exit codes: 0 plan found, 1 a ``check`` regression, 2 usage or input error, 3 budget infeasible
(the message names the smallest feasible budget). Errors are one line on stderr, starting
``ckpt-planner:``, that say what to do; options are checked before a model is loaded.

This module holds the three commands and :func:`main`; the flags are parsed by
:mod:`planner.cli_arguments` (those of the planning options made from their fields by
:mod:`planner.cli_options`, which also builds the options back from them), and
:mod:`planner.cli_messages` checks budgets, words the errors and holds warnings until a command
succeeds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.bounds.reach import COVERING_TIME_LIMIT_S, recompute_bound
from planner.capture_options import CaptureOptions
from planner.check import baseline_from, baseline_key, check_same_capture, check_same_model, compare, junit_xml
from planner.check import parse_tolerance
from planner.check import read_baseline, render_check, stem_key, write_baseline
from planner.cli_arguments import build_parser as _parser
from planner.cli_messages import EXIT_INFEASIBLE, EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, check_budgets
from planner.cli_messages import check_trace_method, command_logging, for_the_command_line
from planner.cli_options import check_option_flags, option_values, options_from_args
from planner.core.costgraph import CostGraph, protect_reads_before_writes
from planner.core.errors import InfeasibleBudgetError, PlannerError
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.core.units import GIB
from planner.plot import plot_report
from planner.report import build_report, render
from planner.sweep import sweep

# torch (profiling/, rewrite/, planner.pipeline) is imported inside the commands that run a model:
# usage errors and --help answer at once, and `report` on a saved profile needs no torch.

__all__ = ["main", "load_entry_point"]

log = logging.getLogger(__name__)


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


def _step(args: argparse.Namespace) -> Any:
    """The training step the command line plans for: the output's loss, the output held
    through the backward only with ``--output-held``."""
    return options_from_args(args, CaptureOptions).step


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """The planning options the command line sets; the rest keep their defaults."""
    return options_from_args(args, PlanOptions)


def _plan_command(args: argparse.Namespace) -> int:
    from planner.pipeline import optimize

    model, example_inputs = load_entry_point(args.target)
    opt = optimize(model, example_inputs, budget_gb=args.budget_gb, **option_values(args))
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
            "capture": plan.capture,
            "compile_graph_breaks": plan.compile_graph_breaks,
            "compile_s": plan.compile_s,
            "compile_split_before_loss": plan.compile_split_before_loss,
            **({"subgraphs": plan.subgraphs} if plan.capture == "graph-breaks" else {}),
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
    from profiling.trace import prepare_saved_program, trace_module

    if _is_saved_program(module):  # a saved program: its graph, made plannable as a captured one
        return prepare_saved_program(module, Path(args.target).name)
    return trace_module(module, inputs, method=args.trace_method,
                        simplify_attention_masks=args.simplify_attention_masks)


def _is_saved_program(module: Any) -> bool:
    """Whether the loaded target is a saved ``torch.export`` program's graph (a ``.pt2``)."""
    import torch.fx

    return isinstance(module, torch.fx.GraphModule)


def _check_command(args: argparse.Namespace) -> int:
    from planner.cli_capture import check_method_applies, plan_on, profile_on_a_path
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
    # the baseline's model is checked before the model is loaded and profiled
    name = baseline_key(args.target, args.baseline)
    if baseline is not None:
        try:
            baseline = check_same_model(baseline, name, stem_key(args.target))
        except PlannerError:
            if not args.update:
                raise
            baseline = None  # --update replaces another model's baseline
    _, module, inputs = _load_target(args, allow_entry_point=True)
    check_method_applies(args.trace_method, module)
    # a captured graph on fake tensors (the same bytes on any machine); the paths without a
    # capture measure one real step (time plays no part in pass or fail: one timing step)
    profiled = profile_on_a_path(module, inputs, args.trace_method, capture=lambda: _captured(module, inputs, args),
                                 profile=lambda gm: profile_graph(gm, inputs, fake=True, step=_step(args)),
                                 step=_step(args), timing_repeats=1)
    if baseline is not None and not args.update:
        check_same_capture(baseline, profiled.capture, args.baseline)
    graph = profiled.graph
    budgets = [int(gb * GIB) for gb in args.budget_gb or []]
    if not budgets and baseline is not None:
        budgets = [p["budget_bytes"] for p in baseline["plans"]]
    plans = []
    for budget in budgets:
        try:
            plan = plan_on(graph, budget / GIB, _plan_options(args))
            plans.append((budget, plan, None))
        except InfeasibleBudgetError as exc:
            plans.append((budget, None, exc.min_feasible_bytes))
    current = baseline_from(graph, [(b, dataclasses.replace(p, budget_bytes=b) if p else None, m)
                                    for b, p, m in plans], name)
    if args.update:
        if baseline is not None and baseline.get("capture", "graph") == profiled.capture:
            sys.stdout.write(render_check(_compared(baseline, current, tolerance, profiled), args.format))
        write_baseline(args.baseline, current)
        print(f"baseline written to {args.baseline}", file=sys.stderr)
        return EXIT_OK
    assert baseline is not None
    result = _compared(baseline, current, tolerance, profiled)
    sys.stdout.write(render_check(result, args.format))
    if args.junit:
        try:
            Path(args.junit).write_text(junit_xml(result))
        except OSError as exc:
            raise PlannerError(f"--junit {args.junit} could not be written: {exc.strerror or exc}") from None
    return EXIT_REGRESSION if result.regressed else EXIT_OK


def _compared(baseline: dict[str, Any], current: dict[str, Any], tolerance: float, profiled: Any) -> Any:
    """:func:`planner.check.compare`, saying why the figures are not the captured graph's."""
    return dataclasses.replace(compare(baseline, current, tolerance), capture_failure=profiled.capture_failure)


def _check_parent_exists(path: str, flag: str) -> None:
    """Refuse an output file in a folder that does not exist, before any work: a typo in the
    path should not silently create folders."""
    parent = Path(path).parent
    if not parent.is_dir():
        raise PlannerError(f"{flag} {path}: folder {parent} does not exist; create it first or pass another path")
    if Path(path).is_dir():
        raise PlannerError(f"{flag} {path} is a folder; pass a file name")


@dataclasses.dataclass
class _ReportSteps:
    """The ``report`` command's capture, profile and solve, for the loss-chunk choice
    (:class:`planner.loss_chunking.ChunkChoiceSteps`): a saved program is prepared in place, so
    captures after the first work on a copy; each capture is profiled once (the loss chunks ask
    again), on fake tensors with a target device; solves run at ``--budget-gb``."""

    args: argparse.Namespace
    module: Any
    inputs: Any
    plan_options: PlanOptions
    capture_options: CaptureOptions
    profiles: dict[str, Any] = dataclasses.field(default_factory=dict)
    captures: int = 0

    def capture(self) -> Any:
        source = self.module
        if self.captures and _is_saved_program(self.module):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 warns copying the program's pytree specs
                source = copy.deepcopy(self.module)
        self.captures += 1
        return _captured(source, self.inputs, self.args)

    def profile(self, gm: Any) -> CostGraph:
        from profiling.profile import profile_graph

        if gm.code not in self.profiles:
            # fake tensors with a target: nothing allocated, times from the target's roofline
            target = self.args.target_device
            self.profiles[gm.code] = (profile_graph(gm, self.inputs, fake=True, target=target, step=_step(self.args))
                                      if target else profile_graph(gm, self.inputs, step=_step(self.args)))
        return self.profiles[gm.code]

    def plan(self, graph: CostGraph, budget_gb: float | None = None) -> Plan:
        from planner.pipeline import plan_for_budget

        return plan_for_budget(graph, self.args.budget_gb if budget_gb is None else budget_gb, self.plan_options)


def _report_command(args: argparse.Namespace) -> int:
    from planner.cli_capture import check_method_applies, labelled, plan_on, profile_on_a_path
    from planner.loss_chunking import choose_loss_chunks, loss_chunk_floors, with_chunked_floor

    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise PlannerError(f"--plot {args.plot}: the plot is written as PNG; give a .png file name")
    if args.target_device:
        from profiling.roofline import DEVICE_SPECS

        if args.target_device.lower() not in DEVICE_SPECS:  # before loading: the profiler would say so later
            raise PlannerError(f"unknown target device {args.target_device!r}; use one of {sorted(DEVICE_SPECS)}")
    name, module, inputs = _load_target(args, allow_entry_point=False)
    fake_only = f"--target {args.target_device}" if args.target_device else None
    check_method_applies(args.trace_method, module)
    steps = _ReportSteps(args, module, inputs, _plan_options(args), options_from_args(args, CaptureOptions))
    profiled = profile_on_a_path(module, inputs, args.trace_method, capture=steps.capture, profile=steps.profile,
                                 step=_step(args), fake_only=fake_only)
    plain_graph = profiled.graph
    floors = None
    if profiled.capture == "graph":
        try:
            _, plan, graph = choose_loss_chunks(steps, profiled.captured, plain_graph)
        except InfeasibleBudgetError as refusal:
            raise with_chunked_floor(steps, profiled.captured, refusal) from None
        floors = loss_chunk_floors(steps, profiled.captured, plain_graph)
    else:
        if args.chunk_loss:
            log.warning("--chunk-loss rewrites the loss of a captured graph: the %s path leaves the loss as the "
                        "model computes it", profiled.capture)
        graph = plain_graph
        plan = plan_on(graph, args.budget_gb, _plan_options(args))
    plans = ([labelled(p, graph) for p in sweep(graph, options=_plan_options(args), points=args.sweep)]
             if args.sweep else [])
    bound = None
    if not args.no_bound:
        bound = recompute_bound(protect_reads_before_writes(graph), plan.budget_bytes,
                                time_limit_s=args.bound_s or COVERING_TIME_LIMIT_S, with_account=args.bound_s > 0)
    options = _plan_options(args)
    report = build_report(graph, plan, model_name=name, sweep_plans=plans, bound=bound, loss_chunk_floors=floors,
                          unoptimized_graph=plain_graph, capture_failure=profiled.capture_failure,
                          offload=options if options.offload else None)
    sys.stdout.write(render(report, args.format))
    if args.plot:
        plot_report(report, args.plot)
    return EXIT_OK


#: each subcommand's function, by the name the parser gives it in ``args.command``
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "report": _report_command,
    "check": _check_command,
    "plan": _plan_command,
}


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (argparse's own exits, such as ``--help``, too)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    with command_logging(args.verbose) as held:
        try:
            check_budgets(args)
            check_option_flags(args)  # a value an option's dataclass refuses fails before anything loads
            check_trace_method(args)
            code = int(_COMMANDS[args.command](args))
        except InfeasibleBudgetError as exc:
            print(f"ckpt-planner: {for_the_command_line(str(exc))}", file=sys.stderr)
            return EXIT_INFEASIBLE
        except PlannerError as exc:
            print(f"ckpt-planner: {for_the_command_line(str(exc))}", file=sys.stderr)
            return EXIT_USAGE
        if held is not None:
            held.show()
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
