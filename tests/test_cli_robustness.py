"""``ckpt-planner`` keeps its promise on bad input: exit 2 (or 3 for a budget below the smallest
feasible one) with one line on stderr that says what to do, checked before the slow work;
and the figures it prints read right on small models."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch

from graphs import chain
from planner import InputError, simulate
from planner.check import BaselineError, write_baseline
from planner.cli import _parser, main
from planner.core.plan import Plan, Segment, describe_segments, format_ms
from planner.report import build_report, render

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A tiny exported program (one 8x8 float32 input), a torch.save file named .pt2, a tiny
    GPT-2 directory with 16 positions, and a directory whose config.json holds a list."""
    root = tmp_path_factory.mktemp("robustness")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).train()
    torch.export.save(torch.export.export(model, (torch.randn(8, 8),), strict=False), root / "tiny.pt2")
    torch.save(model, root / "pickled.pt2")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    (root / "list_config").mkdir()
    (root / "list_config" / "config.json").write_text("[1, 2, 3]")
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, expected_code: int, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected_code, err
    assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""
    import profiling.load

    def refuse(*args, **kwargs):
        raise AssertionError("the bad option must be refused before the model is loaded")

    monkeypatch.setattr(profiling.load, "load_model", refuse)
    monkeypatch.setattr("planner.cli.load_entry_point", refuse)


@pytest.mark.parametrize("sweep", [["--sweep", "1"], ["--sweep=-3"], ["--sweep", "0"], ["--sweep", "x"],
                                   ["--sweep", "100000"]])
def test_sweep_of_fewer_than_two_points_is_a_usage_error(corpus, capsys, no_loading, sweep):
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "1", *sweep)
    assert_one_line(code, err, 2, "--sweep", "integer from 2 to")


def test_more_input_shapes_than_the_program_takes_names_its_inputs(corpus, capsys):
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "1",
                       "--input-shape", "8x8", "--input-shape", "8x8")
    assert_one_line(code, err, 2, "takes 1 input", "8x8:float32", "got 2 --input-shape")


@pytest.mark.parametrize("spec", ["4x8", "8x8x1", "8x8:int64"])
def test_input_shape_the_program_was_not_exported_for_names_the_expected_one(corpus, capsys, spec):
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "1", "--input-shape", spec)
    assert_one_line(code, err, 2, f"--input-shape {spec} does not fit", "exported as 8x8:float32",
                    "pass --input-shape 8x8:float32")
    assert "_guards_fn" not in err


def test_config_json_holding_a_list_is_one_line(corpus, capsys):
    code, _, err = run(capsys, "report", str(corpus / "list_config"), "--budget-gb", "1")
    assert_one_line(code, err, 2, "config.json holds a JSON list")


def test_torch_save_file_named_pt2_is_one_quiet_line(corpus):
    """A real process: torch's loader logs a traceback as warnings before it fails, and those
    lines must not reach the terminal."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "planner.cli", "report", str(corpus / "pickled.pt2"),
                             "--budget-gb", "1"], capture_output=True, text=True, env=env, timeout=300)
    lines = python_lines(result.stderr)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "not a torch.export program" in lines[0] and "--trust-pickle" in lines[0], lines[0]
    assert "warnings above" not in result.stderr and "Traceback" not in result.stderr


def test_torch_save_file_named_pt2_loads_as_a_pickle_with_trust_pickle(corpus):
    from profiling.load import load_model

    loaded = load_model(corpus / "pickled.pt2", input_shapes=["4x8"], trust_pickle=True)
    assert loaded.kind == "pickle" and isinstance(loaded.module, torch.nn.Sequential)


def test_seq_len_beyond_the_position_limit_is_refused_before_profiling(corpus, capsys, monkeypatch):
    import transformers

    def no_building(*args, **kwargs):
        raise AssertionError("the sequence length must be checked before the model is built")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", no_building)
    code, _, err = run(capsys, "report", str(corpus / "gpt2"), "--budget-gb", "1", "--seq-len", "17")
    assert_one_line(code, err, 2, "--seq-len 17", "position limit of 16", "n_positions", "--seq-len 16 or less")


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--image-size"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_sizes_below_one_are_usage_errors(corpus, capsys, no_loading, flag, value):
    code, _, err = run(capsys, "report", str(corpus / "gpt2"), "--budget-gb", "1", flag, value)
    line = assert_one_line(code, err, 2, flag)
    assert "use_cache" not in line


@pytest.mark.parametrize("command", ["report", "check", "plan"])
@pytest.mark.parametrize("budget, fragment", [("-1", "positive finite"), ("0", "positive finite"),
                                              ("nan", "positive finite"), ("inf", "positive finite"),
                                              ("6000", "looks like the wrong unit")])
def test_budget_is_checked_before_anything_is_loaded(corpus, capsys, no_loading, command, budget, fragment):
    target = "nowhere.py:build" if command == "plan" else str(corpus / "tiny.pt2")
    extra = ["--baseline", str(corpus / "none.json"), "--update"] if command == "check" else []
    code, _, err = run(capsys, command, target, "--budget-gb", budget, *extra)
    line = assert_one_line(code, err, 2, "--budget-gb", fragment)
    assert "budget_gb" not in line


@pytest.mark.parametrize("budget", ["1e9", "8e9", "6000", "2e6", "1e300"])
def test_wrong_unit_suggestion_is_itself_accepted(corpus, capsys, no_loading, budget):
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", budget)
    line = assert_one_line(code, err, 2, "looks like the wrong unit")
    suggestions = re.findall(r"pass --budget-gb ([0-9.e+-]+)", line)
    if budget != "1e300":
        assert suggestions, line
    for suggestion in suggestions:
        # the suggested budget passes the checks: the run gets as far as loading the model
        with pytest.raises(AssertionError, match="must be refused before the model is loaded"):
            main(["report", str(corpus / "tiny.pt2"), "--budget-gb", suggestion])


def test_infeasible_budget_names_the_flag_not_the_python_argument(corpus, capsys):
    code, out, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "1e-6", "--no-bound")
    line = assert_one_line(code, err, 3, "smallest feasible budget is", "raise --budget-gb to at least",
                           "--max-stages")
    assert "budget_gb" not in line and "max_stages" not in line and out == ""


def test_advice_about_arguments_the_command_lacks_is_left_out(corpus, capsys, monkeypatch):
    import planner.pipeline

    def refuse(*args, **kwargs):
        raise InputError("budget_gb=0.5 leaves no room after the reserve; raise budget_gb=2, or lower reserve_gb "
                         "(reserve_gb is for optimizer state)")

    monkeypatch.setattr(planner.pipeline, "plan_for_budget", refuse)
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "0.5", "--target", "cpu")
    line = assert_one_line(code, err, 2, "--budget-gb 0.5 leaves no room", "raise --budget-gb 2")
    assert "reserve_gb" not in line, line


def test_verbose_is_accepted_before_and_after_the_subcommand(corpus, capsys):
    for argv in (["-v", "report", "m.pt2", "--budget-gb", "1"], ["report", "m.pt2", "--budget-gb", "1", "-v"],
                 ["check", "m.pt2", "--baseline", "b.json", "--verbose"], ["plan", "m:f", "-v", "--budget-gb", "1"]):
        assert _parser().parse_args(argv).verbose is True, argv
    assert _parser().parse_args(["report", "m.pt2", "--budget-gb", "1"]).verbose is False
    code, _, err = run(capsys, "report", str(corpus / "tiny.pt2"), "--budget-gb", "-1", "-v")
    assert_one_line(code, err, 2, "--budget-gb must be a positive finite number")


def test_usage_errors_are_one_line_and_help_exits_0(capsys):
    code, _, err = run(capsys, "report", "--budget-gb", "1")
    assert_one_line(code, err, 2, "required", "ckpt-planner report --help")
    code, _, err = run(capsys)
    assert_one_line(code, err, 2, "required")
    code, out, _ = run(capsys, "report", "--help")
    assert code == 0 and "--budget-gb" in out


def selective_plan(recompute_ms: float = 2.0, step_ms: float = 10.0) -> tuple[Plan, object]:
    graph = chain([4, 4, 4, 4, 4])
    segment = Segment(("n2", "n3", "n4"), recompute_ms=recompute_ms, recompute_flops=10, kept_nodes=("n3",))
    plan = Plan(budget_bytes=64 * MIB, predicted_peak_bytes=simulate(graph, [segment.node_names]).peak_bytes,
                unoptimized_peak_bytes=simulate(graph).peak_bytes, segments=(segment,), forward_ms=step_ms / 3,
                step_ms=step_ms, forward_flops=100, solver="test", solve_s=0.0)
    return plan, graph


def test_summary_and_report_count_the_nodes_of_segments_the_same_way():
    plan, graph = selective_plan()
    wording = "3 nodes in 1 segment (2 rerun; 1 kept or skipped)"
    assert describe_segments(plan.segments) == wording and len(plan.recomputed_nodes) == 2
    assert wording in plan.summary()
    text = render(build_report(graph, plan), "text")
    assert wording in text
    table = text.split("Recomputed segments\n")[1].split("\n\n")[0].splitlines()
    header = re.split(r"  +", table[0])
    row = dict(zip(header, re.split(r"  +", table[2])))
    assert row["nodes"] == "3" and row["rerun"] == "2", table


def test_small_times_keep_three_significant_digits():
    assert [format_ms(t) for t in (0.0123, 0.068, 0.25, 3.3, 492.61, 0)] == [
        "12.3 µs", "68.0 µs", "0.250 ms", "3.30 ms", "493 ms", "0 ms"]
    plan, graph = selective_plan(recompute_ms=0.0123, step_ms=0.068)
    assert "12.3 µs per step" in plan.summary() and "68.0 µs step" in plan.summary()
    text = render(build_report(graph, plan), "text")
    line = next(row for row in text.splitlines() if row.startswith("extra time"))
    assert "12.3 µs per step" in line and "of 68.0 µs" in line and "0.0 ms" not in line, line


def test_plan_summary_values_start_in_one_column():
    plan, _ = selective_plan()
    rows = [line for line in plan.summary().splitlines() if not line.startswith("  ")]
    columns = {re.search(r"\S  +(\S)", line).start(1) for line in rows}
    assert len(columns) == 1, plan.summary()


def test_baseline_is_written_with_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_baseline(tmp_path / "memory.json", {"format": "x"})
    finally:
        os.umask(old)
    assert (tmp_path / "memory.json").stat().st_mode & 0o777 == 0o644
    assert json.loads((tmp_path / "memory.json").read_text()) == {"format": "x"}
    assert not list(tmp_path.glob("*.tmp"))


def test_baseline_in_a_missing_folder_is_refused(tmp_path, capsys, no_loading):
    with pytest.raises(BaselineError, match="does not exist"):
        write_baseline(tmp_path / "nowhere" / "memory.json", {})
    target = tmp_path / "typo" / "memory.json"
    code, _, err = run(capsys, "check", "netdef.py:build", "--baseline", str(target), "--update", "--budget-gb", "1")
    assert_one_line(code, err, 2, "--baseline", "does not exist")
    assert not target.parent.exists()


def test_csv_and_json_carry_step_ms():
    plan, graph = selective_plan(recompute_ms=2.0, step_ms=8.0)
    report = build_report(graph, plan, sweep_plans=[plan])
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert rows and all(float(r["step_ms"]) == 8.0 for r in rows)
    assert math.isclose(float(rows[0]["overhead_ratio"]), float(rows[0]["recompute_ms"]) / float(rows[0]["step_ms"]))
    data = json.loads(render(report, "json"))
    assert data["plan"]["step_ms"] == 8.0 and data["pareto"][0]["step_ms"] == 8.0


def test_plot_legend_tells_close_peaks_apart_and_title_names_the_device(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from planner.plot import distinct_mib_labels, plot_report

    assert distinct_mib_labels([10.5, 10.0]) == ["10.5", "10.0"]
    assert len(set(distinct_mib_labels([100.004, 100.001]))) == 2
    plan, graph = selective_plan()
    report = build_report(dataclasses.replace(graph, metadata={"device": "cpu", "target": "h100", "mode": "fake"}), plan)
    assert report.device == "h100 (fake tensors, roofline)"

    def timeline(peak_mib: float):
        return types.SimpleNamespace(timeline=(("forward", "a", int(peak_mib * MIB)), ("backward", "b", MIB)))

    report = dataclasses.replace(report, timelines={"unoptimized": timeline(10.5), "plan": timeline(10.0)})
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    plot_report(report, tmp_path / "report.png")
    axes = figures[0].axes[0]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "unoptimized (peak 10.5 MiB)" in legend and "plan (peak 10.0 MiB)" in legend, legend
    assert "h100" in axes.get_title(), axes.get_title()


@pytest.mark.parametrize("max_gb, message", [
    ("1", "must be a number of GiB, got the string '1': pass max_gb=1"),
    (None, "must be a number of GiB, got NoneType"),
    (True, "must be a number of GiB, got bool"),
    (float("nan"), "positive finite number of GiB"),
    (0, "positive finite number of GiB"),
    (-1, "positive finite number of GiB"),
])
def test_assert_peak_memory_checks_max_gb_first(max_gb, message, monkeypatch):
    import planner.testing

    monkeypatch.setattr(planner.testing, "predicted_peak_bytes",
                        lambda *a: (_ for _ in ()).throw(AssertionError("must not profile")))
    with pytest.raises(InputError) as info:
        planner.testing.assert_peak_memory(torch.nn.Linear(4, 4), (torch.randn(2, 4),), max_gb=max_gb)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and "max_gb" in str(info.value) and message in str(info.value)


def test_assert_peak_memory_refuses_an_eval_model_as_optimize_does():
    from planner import optimize
    from planner.testing import assert_peak_memory

    model, x = torch.nn.Linear(4, 4).eval(), torch.randn(2, 4)
    with pytest.raises(InputError) as helper:
        assert_peak_memory(model, (x,), max_gb=1.0)
    with pytest.raises(InputError) as planner_error:
        optimize(model, (x,), budget_gb=1.0)
    assert str(helper.value) == str(planner_error.value) and "model.train()" in str(helper.value)


def test_pulp_is_pinned_below_4():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pulp = next(d for d in dependencies if d.startswith("pulp"))
    assert "<4" in pulp.replace(" ", ""), pulp


def test_fallback_milp_solver_solves_without_the_pulp_4_warning():
    """CBC, bundled with PuLP 3.x, is the MILP solver when highspy is missing; PuLP warns on
    each construction of its class that it goes away in 4.0, which users must not see."""
    solve_module = importlib.import_module("planner.solvers.solve")
    assert "CBC" in solve_module.available_solvers()
    graph = chain([4, 4, 4, 4, 4, 4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = solve_module.solve(graph, int(simulate(graph).peak_bytes * 0.8), solver="CBC")
    assert plan.solver.startswith("CBC") and plan.segments
    assert plan.predicted_peak_bytes <= int(simulate(graph).peak_bytes * 0.8)
    pulp_4 = [str(w.message) for w in caught if "4.0" in str(w.message) or "PULP_CBC_CMD" in str(w.message)]
    assert not pulp_4, pulp_4


NOISY_CLI = """
import logging, sys
import planner.pipeline
from planner.cli import main
from planner.core.errors import InfeasibleBudgetError

real_plan_for_budget = planner.pipeline.plan_for_budget

def noisy(graph, budget_gb, *args, **options):
    logging.getLogger("profiling.profile").warning("timings varied by 40% between passes")
    if budget_gb < 0.001:
        raise InfeasibleBudgetError(int(budget_gb * 2**30), 4096)
    return real_plan_for_budget(graph, budget_gb, *args, **options)

planner.pipeline.plan_for_budget = noisy
sys.exit(main(sys.argv[1:]))
"""


def python_lines(stderr: str) -> list[str]:
    """stderr without blank lines and the profiler's C++ markers."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("USDT:")]


def test_warnings_are_held_until_the_command_succeeds(corpus):
    """In a real process: a warning logged on the way (a busy machine's timing warning) is shown
    after a plan is found, and left out when the command fails with its one line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-c", NOISY_CLI, "report", str(corpus / "tiny.pt2"), "--target", "cpu", "--no-bound"]
    failed = subprocess.run([*base, "--budget-gb", "1e-4"], capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 3, failed.stderr
    assert len(python_lines(failed.stderr)) == 1 and "smallest feasible budget" in failed.stderr, failed.stderr
    planned = subprocess.run([*base, "--budget-gb", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert planned.returncode == 0, planned.stderr
    assert python_lines(planned.stderr) == ["timings varied by 40% between passes"], planned.stderr


def test_infeasible_budget_on_a_huggingface_directory_is_one_line(corpus):
    """transformers' progress bars and config warnings stay off a failing command's stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    result = subprocess.run([sys.executable, "-m", "planner.cli", "report", str(corpus / "gpt2"), "--seq-len", "8",
                             "--budget-gb", "1e-6", "--target", "cpu", "--no-bound"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 3, result.stderr
    lines = python_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), result.stderr
