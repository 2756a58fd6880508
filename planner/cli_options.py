"""The planning options as ``ckpt-planner`` flags, made from their fields.

Every field of :class:`~planner.core.options.PlanOptions` (with those of
:class:`~planner.core.options.SolveOptions`) and of
:class:`~planner.capture_options.CaptureOptions` is a flag of the commands, unless
:data:`NOT_ON_THE_CLI` says why not: named after the field (``max_solve_s`` is
``--max-solve-s``), with the field's one-line help and default, its values parsed by the
field's type (a ``bool`` is a switch) and checked by the dataclass, or as they are parsed where
:data:`VALUE_TYPES` has an argparse type. :data:`ONLY_ON` names the flags only some commands
take. The commands build their options back from the parsed flags with
:func:`options_from_args`. Like the rest of the parser, this imports no torch.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_option_flags(parser, "plan")
    >>> args = parser.parse_args(["--max-stages", "8", "--exact", "--trace-method", "modules"])
    >>> options_from_args(args, PlanOptions).max_stages, options_from_args(args, PlanOptions).exact
    (8, True)
    >>> options_from_args(args, CaptureOptions).trace_method
    'modules'
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from planner.capture_options import CAPTURE_METHODS, CaptureOptions
from planner.core.offload import HOST_LINKS
from planner.core.options import PlanOptions

__all__ = ["OPTION_CLASSES", "NOT_ON_THE_CLI", "ONLY_ON", "VALUE_TYPES", "COMMANDS", "add_option_flags", "flag_name",
           "option_flags", "option_values", "options_from_args", "check_option_flags", "int_at_least", "seconds"]

Options = TypeVar("Options")

#: The option classes whose fields are flags (``PlanOptions`` carries ``SolveOptions``'s).
OPTION_CLASSES: tuple[type, ...] = (PlanOptions, CaptureOptions)

_TUNING = "a tuning knob of the solver's starts, set in the library (docs/tuning.md)"

#: The fields the command line leaves out, and why; every other field is a flag.
NOT_ON_THE_CLI: dict[str, str] = {
    # how the search spends its effort: the defaults are measured (docs/tuning.md), and a
    # command line that bounds a solve does it with --max-solve-s
    "solver": "the chain DP solves the default stage models exactly; a named MILP solver is for comparisons",
    "time_limit_s": "each MILP's limit; --max-solve-s bounds a command's solving",
    "max_attempts": _TUNING,
    "refine_s": _TUNING,
    "polish": _TUNING,
    "finer_s": _TUNING,
    "exact_s": _TUNING,
    "finer_rounds": _TUNING,
    "short_segments": _TUNING,
    # what the planned step is: the commands plan one process's step of a saved model or
    # an entry point, with nothing beside it
    "selective": "a second ILP per plan, for optimize(selective=True) in the training script",
    "reserve_gb": "room for the optimizer's state, which a saved model's step does not have",
    "safety_margin": "the margin the prediction's measured error chose (docs/tuning.md#safety_margin)",
    "world_size": "the commands plan one process",
    # how the command profiles: once per call, logging progress with -v
    "timing_repeats": "the profiler's default passes, more while they disagree (docs/tuning.md#timing_repeats)",
    "cache_dir": "report and check profile once per command; plan takes optimize's default folder "
                 "($CKPT_PLANNER_CACHE_DIR)",
    "progress": "-v logs progress",
    "loss_fn": "a Python callable; the commands take the output's loss",
}

#: Offload is predicted only until a GPU has measured offload plans (docs/benchmarks/offload.md):
#: ``report`` predicts it for the device it profiles or targets, ``plan`` passes it to
#: optimize, which refuses it with one line.
_OFFLOAD = (("report", "plan"), "check holds the step that runs today to its baseline, and offload is predicted "
                                "only until a GPU has measured it")

#: Flags only some commands take: the commands, and why not the others.
ONLY_ON: dict[str, tuple[tuple[str, ...], str]] = {
    "compile": (("plan",), "report and check profile the eager step"),
    "chunk_loss": (("report", "plan"), "check compares the step as captured with its baseline"),
    "offload": _OFFLOAD,
    "host_link": _OFFLOAD,
    "host_bandwidth_gbps": _OFFLOAD,
    "pinned_host_gb": _OFFLOAD,
}

#: The commands that take the option flags.
COMMANDS = ("report", "check", "plan")


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum``.

    Example:
        >>> int_at_least(1)("3")
        3
    """
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


def seconds(allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, positive (or zero where ``allow_zero``).

    Example:
        >>> seconds(allow_zero=True)("0")
        0.0
    """
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


def _parsed_as(kind: type) -> Callable[[str], Any]:
    """An argparse type for a field of type ``kind`` (int, float or str); its range is the
    dataclass's to check."""
    if kind is str:
        return str
    noun = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text}")
        return value

    return parse


#: Argparse types of the fields whose range is checked as the flag is parsed, with the flag
#: named; the other fields' values are checked by their dataclass when the options are made.
VALUE_TYPES: dict[str, Callable[[str], Any]] = {
    "max_stages": int_at_least(1),
    "max_solve_s": seconds(allow_zero=False),
}
#: The values a flag may take, where its field takes a fixed set.
_CHOICES: dict[str, tuple[str, ...]] = {"trace_method": CAPTURE_METHODS, "host_link": tuple(sorted(HOST_LINKS))}


def flag_name(field_name: str) -> str:
    """The flag of a field: ``--`` and its name in kebab case.

    Example:
        >>> flag_name("max_solve_s")
        '--max-solve-s'
    """
    return "--" + field_name.replace("_", "-")


def option_flags(command: str, classes: tuple[type, ...] = OPTION_CLASSES) -> list[dataclasses.Field[Any]]:
    """The fields of ``classes`` that are flags of ``command``, in declaration order."""
    seen: set[str] = set()
    chosen = []
    for cls in classes:
        for field in dataclasses.fields(cls):
            if field.name in seen or field.name in NOT_ON_THE_CLI:
                continue
            seen.add(field.name)
            if command in ONLY_ON.get(field.name, (COMMANDS, ""))[0]:
                chosen.append(field)
    return chosen


def _argparse_keywords(field: dataclasses.Field[Any], hint: Any) -> tuple[str, dict[str, Any]]:
    """The flag and ``add_argument`` keywords of ``field``, whose resolved type is ``hint``."""
    help_text = field.metadata.get("help")
    if not help_text:
        raise TypeError(f"option field {field.name} has no help: declare it with planner.core.options.option")
    help_text = help_text.replace("%", "%%")
    kinds = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    default = field.default
    if bool in kinds and default in (False, None):  # a switch; absent: the field's default
        return flag_name(field.name), {"action": "store_true", "default": default, "help": help_text}
    if kinds == {bool} and default is True:
        return "--no-" + field.name.replace("_", "-"), {"action": "store_false", "dest": field.name,
                                                        "help": f"turn off: {help_text}"}
    values = kinds - {types.NoneType}
    if len(values) != 1 or not values <= {int, float, str}:
        raise TypeError(f"option field {field.name} of type {hint} has no flag form: give it one in "
                        f"planner/cli_options.py or add it to NOT_ON_THE_CLI with the reason")
    (kind,) = values
    keywords: dict[str, Any] = {"type": VALUE_TYPES.get(field.name, _parsed_as(kind)), "default": default,
                                "help": help_text if default is None else f"{help_text} (default {default})"}
    if field.name in _CHOICES:
        keywords["choices"] = _CHOICES[field.name]
    if field.name.endswith("_s"):
        keywords["metavar"] = "SECONDS"
    return flag_name(field.name), keywords


def add_option_flags(parser: argparse.ArgumentParser, command: str,
                     classes: tuple[type, ...] = OPTION_CLASSES) -> None:
    """Add the flags of ``command`` made from the fields of ``classes`` to ``parser``, in a
    group of their own."""
    group = parser.add_argument_group("planning options", "optimize's keywords of the same names, as flags")
    hints = {cls: typing.get_type_hints(cls) for cls in classes}
    for field in option_flags(command, classes):
        hint = next(hints[cls][field.name] for cls in classes if field.name in hints[cls])
        flag, keywords = _argparse_keywords(field, hint)
        group.add_argument(flag, **keywords)


def option_values(args: argparse.Namespace, classes: tuple[type, ...] = OPTION_CLASSES) -> dict[str, Any]:
    """The value of each option flag the command has, by field name: keywords of ``optimize``
    and of the option classes.

    Example:
        >>> args = argparse.Namespace(max_stages=8, exact=None, budget_gb=1.0)
        >>> sorted(option_values(args).items())
        [('exact', None), ('max_stages', 8)]
    """
    names = [f.name for cls in classes for f in dataclasses.fields(cls) if f.name not in NOT_ON_THE_CLI]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def options_from_args(args: argparse.Namespace, cls: type[Options]) -> Options:
    """``cls`` (one of :data:`OPTION_CLASSES`) with the values of the flags the command has;
    the other fields keep their defaults. Raises the dataclass's
    :class:`~planner.core.errors.InputError` for a value it refuses."""
    return cls(**option_values(args, (cls,)))


def check_option_flags(args: argparse.Namespace) -> None:
    """Make each option object from ``args``, so that a value its dataclass refuses fails
    before anything is loaded."""
    for cls in OPTION_CLASSES:
        options_from_args(args, cls)

