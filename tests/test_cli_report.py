"""``ckpt-planner report`` as a subprocess on each input kind, checked against the Python API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner import simulate
from profiling import StepInputs, measure_step_peak_bytes, profile_graph, trace_module

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                                                torch.nn.Linear(256, 64)) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = Small().train()
    x = torch.randn(256, 64)
    torch.export.save(torch.export.export(model, (x,), strict=False), root / "small.pt2")
    torch.save(model, root / "small.pkl")
    torch.save({"not": "a module"}, root / "dict.pkl")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    (root / "empty_dir").mkdir()
    data = (root / "small.pt2").read_bytes()
    (root / "truncated.pt2").write_bytes(data[: len(data) // 2])
    (root / "garbage.pt2").write_bytes(os.urandom(4096))
    return root, model, x


def test_pt2_json_matches_python_api(saved):
    root, model, x = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", "0.002", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    program = torch.export.load(str(root / "small.pt2"))
    graph = profile_graph(program.module(), (x,))
    assert report["unoptimized"]["predicted_peak_bytes"] == simulate(graph).peak_bytes
    assert report["unoptimized"]["measured_peak_bytes"] == measure_step_peak_bytes(model, StepInputs((x,)))
    plan = report["plan"]
    assert plan["budget_bytes"] == int(0.002 * 2**30)
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"] < report["unoptimized"]["predicted_peak_bytes"]
    assert plan["segment_count"] >= 1 and plan["recompute_flops"] > 0
    assert report["largest_activations_by_node"][0]["saved_bytes"] == 256 * 256 * 4


def test_huggingface_directory_text_report_and_plot(saved):
    root, _, _ = saved
    png = root / "out" / "gpt2.png"
    result = cli("report", str(root / "gpt2"), "--budget-gb", "1", "--batch-size", "2", "--seq-len", "32",
                 "--plot", str(png), "--sweep", "3")
    assert result.returncode == 0, result.stderr
    assert "unoptimized peak (measured)" in result.stdout and "Pareto front" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(root / "gpt2")).train()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    graph = profile_graph(trace_module(model, {"input_ids": ids, "labels": ids}), {"input_ids": ids, "labels": ids})
    as_json = json.loads(cli("report", str(root / "gpt2"), "--budget-gb", "1", "--batch-size", "2",
                             "--seq-len", "32", "--format", "json").stdout)
    assert as_json["unoptimized"]["predicted_peak_bytes"] == simulate(graph).peak_bytes
    assert as_json["unoptimized"]["measured_peak_bytes"] == graph.measured_peak_bytes


def test_pickle_needs_the_flag_then_works_with_input_shapes(saved):
    root, _, _ = saved
    refused = cli("report", str(root / "small.pkl"), "--budget-gb", "1", "--input-shape", "256x64:float32")
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr
    ok = cli("report", str(root / "small.pkl"), "--budget-gb", "0.002", "--trust-pickle",
             "--input-shape", "256x64:float32", "--format", "csv")
    assert ok.returncode == 0, ok.stderr
    header, row = ok.stdout.strip().splitlines()[:2]
    assert header.startswith("kind,model,unoptimized_peak_bytes,budget_bytes,predicted_peak_bytes")
    assert row.startswith("budget,small.pkl,")


def test_markdown_format_and_input_shape_override_on_pt2(saved):
    root, _, _ = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", "1", "--format", "markdown",
                 "--input-shape", "256x64")
    assert result.returncode == 0, result.stderr
    assert "### Summary" in result.stdout and "| budget |" in result.stdout


def test_infeasible_budget_exits_3_naming_the_minimum(saved):
    root, _, _ = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", "0.0001")
    assert result.returncode == 3
    assert "smallest feasible budget is" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.pt2"], "does not exist"),
        (["truncated.pt2"], "torch.export"),
        (["garbage.pt2"], "torch.export"),
        (["small.pkl", "--trust-pickle"], "--input-shape"),
        (["dict.pkl", "--trust-pickle", "--input-shape", "2x64"], "not an nn.Module"),
        (["empty_dir"], "config.json"),
        (["small.pt2", "--input-shape", "2xq"], "shape must look like"),
        (["small.pt2", "--input-shape", "2x64:float5"], "unknown dtype"),
        (["small.pt2", "--plot", "out.jpg"], "PNG"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(saved, args, message):
    root, _, _ = saved
    result = cli("report", *args, "--budget-gb", "1", cwd=root)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ckpt-planner")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (root / "out.jpg").exists()


def test_unknown_format_is_a_usage_error(saved):
    root, _, _ = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", "1", "--format", "xml")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "ckpt-planner"
    if not script.exists():
        pytest.fail("the ckpt-planner console script is not installed; pip install -e . declares it")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "report" in result.stdout and "plan" in result.stdout


@pytest.mark.parametrize("budget, message", [("6000", "looks like the wrong unit"), ("-1", "positive finite"),
                                             ("nan", "positive finite")])
def test_bad_budget_is_exit_2_and_writes_nothing(saved, budget, message):
    root, _, _ = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", budget, "--plot", "bad_budget.png", cwd=root)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (root / "bad_budget.png").exists()


def test_target_device_plans_on_fake_tensors_with_the_same_bytes_as_the_python_api(saved):
    root, model, x = saved
    result = cli("report", str(root / "gpt2"), "--budget-gb", "0.01", "--batch-size", "2", "--seq-len", "32",
                 "--target", "h100", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    from profiling.load import load_model

    loaded = load_model(str(root / "gpt2"), batch_size=2, seq_len=32)
    graph = profile_graph(trace_module(loaded.module, loaded.inputs), loaded.inputs, fake=True, target="h100")
    assert data["unoptimized"]["predicted_peak_bytes"] == simulate(graph).peak_bytes
    assert data["unoptimized"]["measured_peak_bytes"] is None, "nothing is run for real with --target"
    assert data["plan"]["predicted_peak_bytes"] <= data["plan"]["budget_bytes"]
    bad = cli("report", str(root / "gpt2"), "--budget-gb", "1", "--target", "tpu9")
    assert bad.returncode == 2 and "unknown target device 'tpu9'" in bad.stderr


def test_offload_flags_predict_a_plan_with_copies_for_the_target_and_it_costs_no_more(saved):
    root, _, _ = saved
    result = cli("report", str(root / "gpt2"), "--budget-gb", "0.0017", "--batch-size", "2", "--seq-len", "32",
                 "--target", "h100", "--format", "json", "--offload", "--host-link", "h100")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["offloaded_bytes"] > 0 and len(plan["offloaded"]) >= 1 and plan["host_link"].startswith("h100")
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert plan["extra_time_ms"] == plan["recompute_ms"] + plan["exposed_transfer_ms"]
    from planner.pipeline import plan_for_budget
    from profiling.load import load_model

    loaded = load_model(str(root / "gpt2"), batch_size=2, seq_len=32)
    graph = profile_graph(trace_module(loaded.module, loaded.inputs), loaded.inputs, fake=True, target="h100")
    assert plan["extra_time_ms"] <= plan_for_budget(graph, 0.0017).extra_time_ms


def test_exact_flag_proves_or_improves_the_plan_on_a_larger_graph(saved):
    """GPT-2's graph has more than 64 compute nodes, so by default the exact search runs there
    only when the ILP's plan leaves room unused: ``--exact`` never costs more than the default
    plan, and its plan is proven within the gap.
    Both runs profile on fake tensors with roofline times (``--target cpu``), so that they
    price one and the same profile (measured node times differ from run to run)."""
    root, _, _ = saved
    reports = []
    for extra in ((), ("--exact",)):
        result = cli("report", str(root / "gpt2"), "--budget-gb", "0.0017", "--batch-size", "2", "--seq-len", "32",
                     "--target", "cpu", "--format", "json", *extra)
        assert result.returncode == 0, result.stderr
        reports.append(json.loads(result.stdout)["plan"])
    default, exact = reports
    assert exact["predicted_peak_bytes"] <= exact["budget_bytes"]
    assert default["segment_count"] >= 1
    assert exact["recompute_ms"] <= default["recompute_ms"] + 1e-9
    assert exact["optimality_gap"] is not None


def test_bound_flag_reports_the_least_possible_recompute_below_the_plan(saved):
    """Every report gives a lower bound on the recompute time of any plan at the budget (kept
    outputs included), the covering bound unless ``--no-bound``; ``--bound-s`` also solves the
    segment covering bound and the segment account, which can only raise it (tests/test_reach.py):
    positive (the budget needs recompute), at most the plan's, and shown in the text summary."""
    root, _, _ = saved
    result = cli("report", str(root / "small.pt2"), "--budget-gb", "0.002", "--format", "json", "--bound-s", "20")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    bound = report["lower_bound"]
    assert bound["proven_infeasible"] is False and bound["method"]
    assert 0 < bound["recompute_ms"] <= report["plan"]["recompute_ms"] + 1e-9
    text = cli("report", str(root / "small.pt2"), "--budget-gb", "0.002", "--bound-s", "20")
    assert text.returncode == 0, text.stderr
    line = next(row for row in text.stdout.splitlines() if row.startswith("least possible extra time"))
    assert "by any plan" in line and "of segments" not in line, line
    quick = json.loads(cli("report", str(root / "small.pt2"), "--budget-gb", "0.002", "--format", "json").stdout)
    assert quick["lower_bound"]["method"].startswith("covering ILP"), quick["lower_bound"]
    # each run profiles afresh (a loaded machine can change the times): compare within a run
    assert 0 < quick["lower_bound"]["recompute_ms"] <= quick["plan"]["recompute_ms"] + 1e-9
    skipped = cli("report", str(root / "small.pt2"), "--budget-gb", "0.002", "--format", "json", "--no-bound")
    assert json.loads(skipped.stdout)["lower_bound"] is None
