"""``ckpt-planner report`` and ``check`` on every capture path: the captured graph, the
graph-break path (a model ``torch.export`` cannot capture, or ``--trace-method graph-breaks``)
and the module path (``--trace-method modules``, or where the graph-break path fails too). The
output names the path in its ``capture`` row and field, and what cannot be done is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.capture_options import CAPTURE_METHODS
from planner.check import BaselineError, validate_baseline
from planner.cli import main
from planner.cli_arguments import build_parser

WIDTH, TOKENS = 32, 256
BUDGET_GB = "0.0008"  # about 75 % of the unoptimized step's 1.05 MiB

ENTRY_POINT = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class ItemNet(nn.Module):
    def __init__(self, d=32, hidden={hidden}, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.mean().item() > 10:  # data-dependent: torch.export cannot capture it
                x = x * 0.5
        return x


def build():
    torch.manual_seed(0)
    return ItemNet().train(), (torch.randn(256, 32),)
'''


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ItemNet(nn.Module):
    """A branch on a tensor's value between blocks: a graph break per block."""

    def __init__(self, d: int = WIDTH, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.mean().item() > 10:
                x = x * 0.5
        return x


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pickled :class:`ItemNet` and a small exported program."""
    root = tmp_path_factory.mktemp("capture_paths")
    torch.manual_seed(0)
    torch.save(ItemNet().train(), root / "item.pkl")
    seq = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).train()
    torch.export.save(torch.export.export(seq, (torch.randn(8, 8),), strict=False), root / "seq.pt2")
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def report(capsys: pytest.CaptureFixture[str], saved: Path, *extra: str) -> tuple[int, str, str]:
    return run(capsys, "report", str(saved / "item.pkl"), "--trust-pickle", "--input-shape", f"{TOKENS}x{WIDTH}",
               "--budget-gb", BUDGET_GB, *extra)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), err
    return lines[0]


def test_trace_method_flag_takes_every_capture_method_on_every_command() -> None:
    parser = build_parser()
    for command, budget in (("report", "--budget-gb=1"), ("check", "--baseline=b.json"), ("plan", "--budget-gb=1")):
        for method in CAPTURE_METHODS:
            args = parser.parse_args([command, "model.pt", budget, "--trace-method", method])
            assert args.trace_method == method


def test_report_of_an_uncapturable_model_falls_back_to_the_graph_break_path(saved, capsys, tmp_path):
    code, out, err = report(capsys, saved, "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["capture"] == result["plan"]["capture"] == "graph-breaks"
    assert result["subgraphs"] == 5  # a break after each of the four blocks
    assert result["capture_failure"].startswith("could not capture ItemNet with export")
    assert result["unoptimized"]["measured_peak_bytes"] > result["plan"]["budget_bytes"]
    assert result["plan"]["segment_count"] >= 1
    assert result["plan"]["predicted_peak_bytes"] <= result["plan"]["budget_bytes"]
    assert result["largest_activations_by_node"][0]["op"] == "aten.tanh.default"
    # the failed capture's partial graph stays off stderr; the fallback's warning comes after the output
    assert "def forward" not in err and "planning over the ops of its eager step" in err

    png = tmp_path / "item.png"
    code, out, err = report(capsys, saved, "--sweep", "3", "--plot", str(png))
    assert code == 0, err
    capture_row = next(line for line in out.splitlines() if line.startswith("capture"))
    assert "graph-breaks" in capture_row and "5 subgraphs" in capture_row and "could not be captured" in capture_row
    assert "Pareto front" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_the_module_path_by_flag_and_where_the_graph_break_path_fails(saved, capsys, monkeypatch):
    code, out, err = report(capsys, saved, "--trace-method", "modules", "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["capture"] == result["plan"]["capture"] == "modules" and result["capture_failure"] is None
    assert "subgraphs" not in result
    assert {row["node"] for row in result["largest_activations_by_node"]} == {f"blocks.{i}" for i in range(4)}
    assert result["plan"]["segment_count"] >= 1 and err == ""

    def broken(*args, **kwargs):
        raise RuntimeError("the op stream could not be recorded")

    monkeypatch.setattr("planner.cli_capture.profile_op_stream", broken)
    code, out, err = report(capsys, saved, "--format", "markdown")
    assert code == 0, err
    assert "| capture | modules (whole submodule calls checkpointed" in out and "could not be captured" in out
    assert "the graph-break path failed (RuntimeError)" in err and "planning over submodule calls" in err


def test_a_model_no_path_can_run_is_one_line(saved, capsys):
    code, _, err = run(capsys, "report", str(saved / "item.pkl"), "--trust-pickle", "--input-shape", "256x31",
                       "--budget-gb", "1")
    line = one_line(err)
    assert code == 2 and "could not capture ItemNet" in line and "the module path could not run it" in line


def test_trace_method_the_target_cannot_take_is_one_line(saved, capsys, monkeypatch):
    code, _, err = run(capsys, "report", str(saved / "seq.pt2"), "--budget-gb", "1", "--trace-method", "modules")
    assert code == 2 and "a .pt2 is a captured graph" in one_line(err)

    code, _, err = report(capsys, saved, "--target", "h100")
    assert code == 2 and "drop --target h100 to plan over the model's eager step" in one_line(err)

    def refuse(*args, **kwargs):
        raise AssertionError("the option pair must be refused before the model is loaded")

    monkeypatch.setattr("profiling.load.load_model", refuse)
    code, _, err = report(capsys, saved, "--target", "h100", "--trace-method", "graph-breaks")
    assert code == 2 and "plans on fake tensors: drop one of the two" in one_line(err)


def test_check_on_the_graph_break_path_passes_then_catches_growth(tmp_path, capsys):
    source = tmp_path / "netdef.py"
    source.write_text(ENTRY_POINT.format(hidden=128))
    target, baseline = f"{source}:build", str(tmp_path / "memory.json")
    code, _, err = run(capsys, "check", target, "--baseline", baseline, "--budget-gb", BUDGET_GB, "--update")
    assert code == 0, err
    written = json.loads(Path(baseline).read_text())
    assert written["capture"] == "graph-breaks" and written["plans"][0]["feasible"]

    code, out, err = run(capsys, "check", target, "--baseline", baseline)
    assert code == 0, err
    assert "capture: graph-breaks" in out and "since the model could not be captured" in out
    assert out.rstrip().endswith("passed")

    source.write_text(ENTRY_POINT.format(hidden=1024))  # another length: no stale bytecode
    code, out, err = run(capsys, "check", target, "--baseline", baseline, "--format", "json")
    result = json.loads(out)
    assert code == 1 and result["regressed"]
    assert result["capture"] == "graph-breaks" and result["capture_failure"].startswith("could not capture")
    assert result["rows"][0]["figure"] == "unoptimized peak" and result["rows"][0]["status"] == "REGRESSED"


def test_check_on_the_module_path_and_a_baseline_of_another_path(tmp_path, capsys):
    source = tmp_path / "netdef.py"
    source.write_text(ENTRY_POINT.format(hidden=128))
    target, baseline = f"{source}:build", str(tmp_path / "memory.json")
    code, _, err = run(capsys, "check", target, "--baseline", baseline, "--budget-gb", BUDGET_GB, "--update",
                       "--trace-method", "modules")
    assert code == 0, err
    assert json.loads(Path(baseline).read_text())["capture"] == "modules"
    code, out, err = run(capsys, "check", target, "--baseline", baseline, "--trace-method", "modules")
    assert code == 0, err
    assert "capture: modules" in out and "as --trace-method modules asks" in out and err == ""

    code, _, err = run(capsys, "check", target, "--baseline", baseline)  # export falls back to graph-breaks
    line = one_line(err)
    assert code == 2 and "made on the modules path and this run on the graph-breaks path" in line
    assert "--trace-method modules" in line


def test_baseline_capture_must_be_a_string() -> None:
    base = {"format": "ckpt-planner-baseline", "version": 1, "model": "m", "unoptimized_peak_bytes": 1,
            "activation_bytes_by_node": {}, "plans": [], "capture": 3}
    with pytest.raises(BaselineError, match="'capture' should be str"):
        validate_baseline(base, "b.json")
