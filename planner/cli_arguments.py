"""The ``ckpt-planner`` command line: the parser of its subcommands and flags, with ``-v``
accepted before and after the subcommand, and the argparse types that check values as they are
parsed. Which command runs is ``args.command``; the commands themselves are in
:mod:`planner.cli`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn

from planner.cli_messages import EXIT_USAGE, printable
from planner.core.options import PlanOptions

__all__ = ["MAX_SWEEP_POINTS", "TRACE_METHOD_CHOICES", "build_parser"]

#: ``--trace-method`` values: :data:`planner.capture_options.CAPTURE_METHODS` (a test keeps them equal)
TRACE_METHOD_CHOICES = ("export", "symbolic_trace", "graph-breaks", "modules")

#: the most budgets ``--sweep`` plans: each is a solve, and a front of more points shows nothing new
MAX_SWEEP_POINTS = 100


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors on one line like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ckpt-planner: {printable(message)}; see `{self.prog} --help`\n")


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
    """An argparse type: a number (its range is checked by
    :func:`planner.cli_messages.check_budget`, with advice)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB such as 6 or 0.5, got {text!r}") from None


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
    parser.add_argument("--max-stages", type=_int_at_least(1), default=PlanOptions.max_stages,
                        help=f"stages the graph is reduced to before solving (default {PlanOptions.max_stages})")


def _add_solve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-held", action="store_true",
                        help="plan for a training loop that keeps the model's output alive through the backward "
                             "(default: the output is dropped once the loss is taken, as in "
                             "model(**batch).loss.backward() and the HF Trainer)")
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


def _add_chunk_loss(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-loss", action="store_true",
                        help="let the plan compute the output head and cross-entropy loss in row chunks under "
                             "checkpoint where that pays (a lower floor on language models): another summation "
                             "order, so the loss and gradients agree to rtol 1e-5, not bit for bit (labelled in "
                             "the output)")


def _add_trace_method(parser: argparse.ArgumentParser) -> None:
    # the values of planner.capture_options.CAPTURE_METHODS, which imports torch
    parser.add_argument("--trace-method", choices=TRACE_METHOD_CHOICES, default="export",
                        help="capture the forward as a graph (export, default; falls back to graph-breaks, then "
                             "modules, where capture fails), plan over the ops of the eager step (graph-breaks: "
                             "for models with graph breaks) or over submodule calls directly (modules: coarser)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ckpt-planner``: ``report``, ``check`` and ``plan``, named in ``args.command``."""
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
    _add_chunk_loss(report)
    report.add_argument("--target", dest="target_device", metavar="DEVICE",
                        help="plan for another device without running there: profile on fake tensors (bytes "
                             "from shapes, nothing allocated) and time ops with DEVICE's roofline "
                             "(cpu, l4, a100, a100-80gb, h100, h200)")
    _add_input_options(report)
    _add_trace_method(report)

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
    _add_trace_method(check)

    plan = sub.add_parser("plan", parents=[common],
                          help="plan checkpoints for a model given by a Python entry point")
    plan.add_argument("target", help="file.py:function or module:function returning (model, example_inputs)")
    plan.add_argument("--budget-gb", type=_gib, required=True, help="peak training-step memory, GiB")
    _add_max_stages(plan)
    _add_solve_options(plan)
    _add_chunk_loss(plan)
    _add_trace_method(plan)
    plan.add_argument("--compile", action="store_true",
                      help="plan for a training step run under torch.compile (Inductor): the plan honoured inside "
                           "one compiled graph and checked on the compiled step's measured peak (one compile per "
                           "plan checked)")
    plan.add_argument("--format", choices=("text", "json"), default="text")
    return parser
