"""Each option is declared once (a field of ``PlanOptions`` or ``CaptureOptions`` with its
default) and reaches every front door: ``optimize``'s keywords with the same defaults, the
README's options table, and the CLI or a stated reason why not. A new field missing from any of
them fails here."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from planner.cli_arguments import build_parser
from planner.core.options import PlanOptions, SolveOptions
from planner.pipeline import CaptureOptions, optimize

#: Fields of the solve's search that only ``solve``/``PlanOptions`` take: tuning knobs of the
#: starts (docs/tuning.md), not options a user of ``optimize`` sets.
SOLVER_TUNING = {"max_attempts", "refine_s", "polish", "finer_s", "exact_s", "finer_rounds", "short_segments"}

#: Options of ``optimize`` the CLI does not take, and why.
NOT_ON_THE_CLI = {
    "reserve_gb": "the CLI plans a saved model, whose optimizer the budget does not see",
    "safety_margin": "a library tuning knob",
    "solver": "a library tuning knob",
    "time_limit_s": "bounded by --max-solve-s on the command line",
    "selective": "a library option",
    "world_size": "the CLI plans one process",
    "timing_repeats": "a library tuning knob",
    "cache_dir": "the CLI profiles once per call",
    "progress": "-v logs progress",
    "loss_fn": "a Python callable",
}

ROOT = Path(__file__).resolve().parents[1]


def _user_options() -> dict[str, object]:
    fields = [f for f in dataclasses.fields(PlanOptions) if f.name not in SOLVER_TUNING]
    fields += list(dataclasses.fields(CaptureOptions))
    return {f.name: f.default for f in fields}


def test_every_option_is_a_keyword_of_optimize_with_the_fields_default():
    parameters = inspect.signature(optimize).parameters
    for name, default in _user_options().items():
        assert name in parameters, f"optimize has no keyword {name}"
        assert parameters[name].default == default, f"optimize's default of {name} differs from its field's"


def test_every_solve_field_has_its_one_line_help():
    for field in dataclasses.fields(PlanOptions):
        help_text = field.metadata.get("help", "")
        assert help_text and "\n" not in help_text, f"{field.name} has no one-line help"
    assert SOLVER_TUNING <= {f.name for f in dataclasses.fields(SolveOptions)}


def test_every_option_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    missing = [name for name in _user_options() if not any(f"`{name}`" in line for line in table)]
    assert not missing, f"options missing from README's table: {missing}"


def test_every_option_is_a_cli_flag_or_says_why_not():
    parser = build_parser()
    flags = {option.lstrip("-").replace("-", "_") for action in parser._subparsers._group_actions
             for sub in action.choices.values() for a in sub._actions for option in a.option_strings}
    for name in _user_options():
        assert name in flags or name in NOT_ON_THE_CLI, f"option {name} is neither a CLI flag nor in NOT_ON_THE_CLI"
    assert not set(NOT_ON_THE_CLI) & flags, "an option listed as off the CLI has a flag now"
