"""What the ``ckpt-planner`` command says, and when: its exit codes, the ``--budget-gb`` checks
made before a model is loaded, library error messages reworded for the command line, control
characters escaped in echoed values, and warnings held until the command has succeeded."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from planner.core.errors import InputError
from planner.core.options import MAX_PLAUSIBLE_BUDGET_GB, check_budget_gb

__all__ = [
    "EXIT_OK", "EXIT_REGRESSION", "EXIT_USAGE", "EXIT_INFEASIBLE", "MIN_PLAUSIBLE_BUDGET_BYTES",
    "HeldWarnings", "check_budgets", "check_budget", "for_the_command_line", "printable", "command_logging",
]

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3

#: budgets below this many bytes are refused as a unit mistake: no training step fits in under
#: a KiB, and the planner's arithmetic leaves no room at all under a few bytes
MIN_PLAUSIBLE_BUDGET_BYTES = 1024

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


def check_budgets(args: argparse.Namespace) -> None:
    """:func:`check_budget` for each ``--budget-gb`` the command was given (none, one, or a list)."""
    budgets = args.budget_gb
    if budgets is None:
        return
    for budget_gb in list(budgets) if isinstance(budgets, list) else [budgets]:
        check_budget(budget_gb)


def check_trace_method(args: argparse.Namespace) -> None:
    """Refuse, before anything is loaded, a ``--trace-method`` that runs real training steps
    (``graph-breaks``, ``modules``) together with ``--target``, which plans on fake tensors."""
    target = getattr(args, "target_device", None)
    if target and getattr(args, "trace_method", "export") in ("graph-breaks", "modules"):
        raise InputError(f"--trace-method {args.trace_method} runs real training steps and --target {target} "
                         f"plans on fake tensors: drop one of the two")


def check_budget(budget_gb: float) -> None:
    """Raise :class:`InputError` for a ``--budget-gb`` no plan can be made for, before anything
    is loaded: the checks of :func:`planner.core.options.check_budget_gb`, worded for the command line;
    a value that looks like another unit gets a suggested ``--budget-gb`` only where that value
    would itself be accepted."""
    if math.isfinite(budget_gb) and budget_gb > MAX_PLAUSIBLE_BUDGET_GB:
        raise InputError(f"--budget-gb {budget_gb:g} looks like the wrong unit: it is in GiB (2**30 bytes), and no "
                         f"single device has more than {MAX_PLAUSIBLE_BUDGET_GB:g} GiB{_unit_hint(budget_gb)}")
    budget_bytes = check_budget_gb(budget_gb, "--budget-gb")
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


def for_the_command_line(message: str) -> str:
    """A library error message as the command line shows it: one line, the API's argument names
    spelled as flags, and advice about arguments the command line lacks left out. Wording only:
    which error it is was decided by its type."""
    # libraries append details on further lines (a wrapped exception's own text): keep the first
    lines = [line.strip() for line in message.split("\n") if line.strip()]
    text = printable(lines[0]) if lines else "failed without a message"
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


def printable(text: str) -> str:
    """``text`` with control characters escaped: a value typed on the command line and echoed in
    a message must not break it over lines (str.splitlines also breaks at \\x1c-\\x1e, \\x85...)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class HeldWarnings(logging.Handler):
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
def command_logging(verbose: bool) -> Iterator[HeldWarnings | None]:
    """With ``-v``, progress is logged as it happens; without, warnings are held (see
    :class:`HeldWarnings`)."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        yield None
        return
    held = HeldWarnings()
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
