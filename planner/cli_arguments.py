"""The ``ckpt-planner`` command line: the parser of its subcommands and flags, with ``-v``
accepted before and after the subcommand. The flags of the planning options are made from their
fields by :mod:`planner.cli_options`; the rest, each command's own, are here. Which command runs
is ``args.command``; the commands themselves are in :mod:`planner.cli`."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from planner.cli_messages import EXIT_USAGE, printable
from planner.cli_options import add_option_flags, int_at_least, seconds

__all__ = ["MAX_SWEEP_POINTS", "build_parser"]

#: the most budgets ``--sweep`` plans: each is a solve, and a front of more points shows nothing new
MAX_SWEEP_POINTS = 100


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors on one line like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ckpt-planner: {printable(message)}; see `{self.prog} --help`\n")


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
    parser.add_argument("--batch-size", type=int_at_least(1), default=1, help="HuggingFace directory: batch size")
    parser.add_argument("--seq-len", type=int_at_least(1), default=128,
                        help="HuggingFace directory: tokens per sequence")
    parser.add_argument("--image-size", type=int_at_least(1), help="HuggingFace directory: image side in pixels")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow unpickling PATH (runs code from the file)")


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
    report.add_argument("--sweep", type=int_at_least(2, MAX_SWEEP_POINTS), nargs="?", const=8, default=0,
                        metavar="N", help=f"also plan N budgets (default 8, at most {MAX_SWEEP_POINTS}) from the "
                                          f"minimum to the unoptimized peak")
    report.add_argument("--format", choices=("text", "json", "csv", "markdown"), default="text")
    report.add_argument("--plot", metavar="FILE.png", help="draw memory over the step (and the Pareto front)")
    report.add_argument("--bound-s", type=seconds(allow_zero=True), default=0.0, metavar="SECONDS",
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
    add_option_flags(report, "report")

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
    add_option_flags(check, "check")

    plan = sub.add_parser("plan", parents=[common],
                          help="plan checkpoints for a model given by a Python entry point")
    plan.add_argument("target", help="file.py:function or module:function returning (model, example_inputs)")
    plan.add_argument("--budget-gb", type=_gib, required=True, help="peak training-step memory, GiB")
    plan.add_argument("--format", choices=("text", "json"), default="text")
    add_option_flags(plan, "plan")
    return parser
