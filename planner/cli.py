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

Exit codes: 0 plan found, 2 usage or input error, 3 budget infeasible (the message names the
smallest feasible budget).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

from planner.errors import InfeasibleBudgetError, PlannerError

__all__ = ["main", "load_entry_point"]

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


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
    if allow_entry_point and not Path(target).exists() and ":" in target:
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

    from profiling.trace import trace_module

    if isinstance(module, torch.fx.GraphModule):  # a saved program: planned as it was exported
        return module
    return trace_module(module, inputs, simplify_attention_masks=args.simplify_attention_masks)


def _check_command(args: argparse.Namespace) -> int:
    from planner.check import baseline_from, compare, junit_xml, parse_tolerance, read_baseline, render_check
    from planner.check import write_baseline
    from planner.pipeline import plan_for_budget
    from profiling.profile import profile_graph

    tolerance = parse_tolerance(args.tolerance)
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
        Path(args.junit).write_text(junit_xml(result))
    return EXIT_REGRESSION if result.regressed else EXIT_OK


def _report_command(args: argparse.Namespace) -> int:
    from planner.pipeline import plan_for_budget
    from planner.report import build_report, render
    from planner.sweep import sweep
    from profiling.profile import profile_graph

    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise PlannerError(f"--plot {args.plot}: the plot is written as PNG; give a .png file name")
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


def _add_input_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-shape", action="append", metavar="SPEC",
                        help="an input as 2x3x224x224:float32; repeat for several positional inputs")
    parser.add_argument("--batch-size", type=int, default=1, help="HuggingFace directory: batch size")
    parser.add_argument("--seq-len", type=int, default=128, help="HuggingFace directory: tokens per sequence")
    parser.add_argument("--image-size", type=int, help="HuggingFace directory: image side in pixels")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow unpickling PATH (runs code from the file)")
    parser.add_argument("--max-stages", type=int, default=32)
    _add_solve_options(parser)


def _add_solve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simplify-attention-masks", action="store_true",
                        help="pass is_causal instead of a constant causal mask to attention where the model "
                             "passes the mask: a faster kernel, but other rounding and attention-dropout "
                             "stream than the model's own (labelled in the output)")
    parser.add_argument("--exact", action="store_true",
                        help="prove the plan the cheapest over its stages or find a cheaper one (slower on "
                             "large graphs; by default it runs under 64 compute nodes, and under 512 where "
                             "the first plan leaves over 1 %% of the budget unused)")
    parser.add_argument("--max-solve-s", type=float, metavar="SECONDS",
                        help="stop improving each plan after SECONDS of solving and use the cheapest found by "
                             "then (the first ILP still runs to its own limit); default: no bound, so plans do "
                             "not depend on the machine's speed")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-planner", description="Automatic activation-checkpoint planner.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="report what checkpointing buys on a saved model")
    report.add_argument("target", metavar="PATH",
                        help="a .pt2 from torch.export.save, a save_pretrained directory, or a pickled module")
    report.add_argument("--budget-gb", type=float, required=True, help="peak training-step memory, GiB")
    report.add_argument("--sweep", type=int, nargs="?", const=8, default=0, metavar="N",
                        help="also plan N budgets (default 8) from the minimum to the unoptimized peak")
    report.add_argument("--format", choices=("text", "json", "csv", "markdown"), default="text")
    report.add_argument("--plot", metavar="FILE.png", help="draw memory over the step (and the Pareto front)")
    report.add_argument("--bound-s", type=float, default=0.0, metavar="SECONDS",
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

    check = sub.add_parser("check", help="fail when peak training memory grew against a baseline file")
    check.add_argument("target", metavar="TARGET",
                       help="a saved model (as for report) or file.py:function / module:function "
                            "returning (model, example_inputs)")
    check.add_argument("--baseline", required=True, metavar="FILE.json", help="the baseline to compare with")
    check.add_argument("--tolerance", default="5%", help="allowed growth of the peak, e.g. 5%% or 0.05 (default 5%%)")
    check.add_argument("--budget-gb", type=float, action="append",
                       help="also plan at this budget (repeatable); default: the baseline's budgets")
    check.add_argument("--update", action="store_true", help="write the current figures as the new baseline")
    check.add_argument("--format", choices=("text", "json"), default="text")
    check.add_argument("--junit", metavar="FILE.xml", help="also write the result as JUnit XML")
    _add_input_options(check)
    check.set_defaults(func=_check_command)

    plan = sub.add_parser("plan", help="plan checkpoints for a model given by a Python entry point")
    plan.add_argument("target", help="file.py:function or module:function returning (model, example_inputs)")
    plan.add_argument("--budget-gb", type=float, required=True, help="peak training-step memory, GiB")
    plan.add_argument("--max-stages", type=int, default=32)
    _add_solve_options(plan)
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.set_defaults(func=_plan_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args))
    except InfeasibleBudgetError as exc:
        print(f"ckpt-planner: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except PlannerError as exc:
        print(f"ckpt-planner: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
