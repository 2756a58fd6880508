"""Each option is declared once (a field of ``PlanOptions`` or ``CaptureOptions`` with its
default and help) and reaches every front door: ``optimize``'s keywords with the same defaults,
the README's options table, and the CLI, whose flags are made from the fields, unless
``planner.cli_options.NOT_ON_THE_CLI`` says why not. A new field missing from any of them fails
here; a new field the CLI can take is a flag with no further edit."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import argparse

import pytest

from planner import InputError
from planner.cli import main
from planner.cli_arguments import build_parser
from planner.cli_options import COMMANDS, NOT_ON_THE_CLI, ONLY_ON, add_option_flags, flag_name, options_from_args
from planner.core.options import PlanOptions, SolveOptions, option
from planner.pipeline import CaptureOptions, optimize

#: Fields of the solve's search that only ``solve``/``PlanOptions`` take: tuning knobs of the
#: starts (docs/tuning.md), not options a user of ``optimize`` sets.
SOLVER_TUNING = {"max_attempts", "refine_s", "polish", "finer_s", "exact_s", "finer_rounds", "short_segments"}

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


def test_every_option_field_has_its_one_line_help():
    for field in dataclasses.fields(PlanOptions) + dataclasses.fields(CaptureOptions):
        help_text = field.metadata.get("help", "")
        assert help_text and "\n" not in help_text, f"{field.name} has no one-line help"
    assert SOLVER_TUNING <= {f.name for f in dataclasses.fields(SolveOptions)}


def test_every_option_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    missing = [name for name in _user_options() if not any(f"`{name}`" in line for line in table)]
    assert not missing, f"options missing from README's table: {missing}"


def _flags_by_command() -> dict[str, dict[str, argparse.Action]]:
    parser = build_parser()
    return {name: {option: action for action in sub._actions for option in action.option_strings}
            for group in parser._subparsers._group_actions for name, sub in group.choices.items()}


def _all_fields() -> list[dataclasses.Field]:
    return [*dataclasses.fields(SolveOptions), *dataclasses.fields(PlanOptions), *dataclasses.fields(CaptureOptions)]


def test_every_option_field_is_a_cli_flag_or_says_why_not():
    flags = _flags_by_command()
    for field in _all_fields():
        commands = [command for command in COMMANDS if flag_name(field.name) in flags[command]]
        if field.name in NOT_ON_THE_CLI:
            assert not commands, f"{field.name} is in NOT_ON_THE_CLI but a flag of {commands}"
            continue
        expected = list(ONLY_ON.get(field.name, (COMMANDS, ""))[0])
        assert commands == expected, f"{field.name} is a flag of {commands}, not of {expected}"
        action = flags[expected[0]][flag_name(field.name)]
        assert action.dest == field.name and action.default == field.default, field.name
        assert field.metadata["help"].split()[0] in action.help, field.name
    names = {f.name for f in _all_fields()}
    assert set(NOT_ON_THE_CLI) <= names and set(ONLY_ON) <= names, "a stated reason names no field"
    assert all(reason for reason in NOT_ON_THE_CLI.values())


def test_a_new_field_is_a_flag_with_no_further_edit():
    @dataclasses.dataclass(frozen=True)
    class Wider(PlanOptions):
        depth_limit: int | None = option(None, "how deep the search may go")
        patience_s: float = option(1.5, "seconds of patience")
        verbose_solve: bool = option(False, "log every stage model")

    parser = argparse.ArgumentParser()
    add_option_flags(parser, "report", classes=(Wider, CaptureOptions))
    args = parser.parse_args(["--depth-limit", "7", "--verbose-solve", "--max-stages", "4"])
    wider = options_from_args(args, Wider)
    assert (wider.depth_limit, wider.patience_s, wider.verbose_solve, wider.max_stages) == (7, 1.5, True, 4)
    assert "--patience-s" in parser.format_help() and "seconds of patience (default 1.5)" in parser.format_help()


def test_a_field_the_cli_cannot_take_must_say_why():
    @dataclasses.dataclass(frozen=True)
    class WithCallable(PlanOptions):
        scorer: object = option(None, "a Python object")

    with pytest.raises(TypeError, match="NOT_ON_THE_CLI"):
        add_option_flags(argparse.ArgumentParser(), "plan", classes=(WithCallable,))


def test_the_plan_command_passes_every_flag_to_optimize(monkeypatch, capsys):
    import planner.pipeline

    seen = {}

    def record(model, example_inputs, **keywords):
        seen.update(keywords)
        raise InputError("recorded")

    monkeypatch.setattr(planner.pipeline, "optimize", record)
    monkeypatch.setattr("planner.cli.load_entry_point", lambda spec: (None, ()))
    assert main(["plan", "m:f", "--budget-gb", "1", "--max-stages", "8", "--exact", "--trace-method", "modules",
                 "--output-held", "--compile"]) == 2
    assert "recorded" in capsys.readouterr().err
    assert seen == {"budget_gb": 1.0, "max_stages": 8, "exact": True, "max_solve_s": None, "trace_method": "modules",
                    "simplify_attention_masks": False, "chunk_loss": False, "output_held": True, "compile": True,
                    "offload": False, "host_link": "h100", "host_bandwidth_gbps": None, "pinned_host_gb": None}


def test_offload_is_a_flag_of_report_and_plan_and_plan_refuses_it_with_optimize_s_one_line(monkeypatch, capsys):
    import torch

    flags = _flags_by_command()
    for flag in ("--offload", "--host-link", "--host-bandwidth-gbps", "--pinned-host-gb"):
        assert flag in flags["report"] and flag in flags["plan"] and flag not in flags["check"], flag
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    monkeypatch.setattr("planner.cli.load_entry_point", lambda spec: (model, (torch.randn(2, 4),)))
    assert main(["plan", "m:f", "--budget-gb", "1", "--offload", "--host-link", "gh200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ckpt-planner: offload=True needs a CUDA device") and "\n" not in err
    # a value the options refuse fails before anything loads, on report as on plan
    assert main(["report", "missing.pt2", "--budget-gb", "1", "--offload", "--pinned-host-gb", "-1"]) == 2
    assert "pinned_host_gb must be a positive number" in capsys.readouterr().err
    assert main(["report", "missing.pt2", "--budget-gb", "1", "--host-link", "pcie9"]) == 2
    assert "invalid choice: 'pcie9'" in capsys.readouterr().err
