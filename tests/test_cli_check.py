"""``ckpt-planner check`` against baselines, and the pytest helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from planner.testing import assert_peak_memory

ROOT = Path(__file__).resolve().parents[1]

MODEL_SOURCE = '''
import torch

HIDDEN = {hidden}

def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(64, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 64)]
    return torch.nn.Sequential(*layers).train(), (torch.randn(512, 64),)
'''


def write_model(folder: Path, hidden: int) -> str:
    (folder / "netdef.py").write_text(MODEL_SOURCE.format(hidden=hidden))
    return str(folder / "netdef.py") + ":build"


def check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "planner.cli", "check", *args], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture()
def workdir(tmp_path):
    return tmp_path


def test_unchanged_passes_grown_fails_update_passes(workdir):
    target = write_model(workdir, hidden=256)
    baseline = workdir / "memory.json"
    created = check(target, "--baseline", str(baseline), "--update", "--budget-gb", "0.004")
    assert created.returncode == 0, created.stderr
    first = baseline.read_text()
    data = json.loads(first)
    assert data["model"] == "netdef.py:build" and data["plans"][0]["feasible"]  # relative to the baseline

    same = check(target, "--baseline", str(baseline), "--format", "json")
    assert same.returncode == 0, same.stderr
    result = json.loads(same.stdout)
    assert not result["regressed"] and result["grown_nodes"] == []
    assert result["rows"][0]["current"] == data["unoptimized_peak_bytes"]

    again = check(target, "--baseline", str(workdir / "again.json"), "--update", "--budget-gb", "0.004")
    assert again.returncode == 0
    assert (workdir / "again.json").read_text() == first, "two runs must give identical bytes"

    write_model(workdir, hidden=282)  # about 10 % more activation memory
    grown = check(target, "--baseline", str(baseline), "--junit", str(workdir / "junit.xml"))
    assert grown.returncode == 1, grown.stdout + grown.stderr
    assert "REGRESSED" in grown.stdout and "nodes whose saved activations grew" in grown.stdout
    assert "tanh: 0.50 MiB -> 0.55 MiB" in grown.stdout
    suite = ElementTree.parse(workdir / "junit.xml").getroot()
    assert suite.get("failures") == "1"
    assert suite.find("testcase/failure") is not None

    updated = check(target, "--baseline", str(baseline), "--update")
    assert updated.returncode == 0
    assert check(target, "--baseline", str(baseline)).returncode == 0


def test_budget_that_becomes_infeasible_is_a_regression(workdir):
    target = write_model(workdir, hidden=128)
    baseline = workdir / "memory.json"
    assert check(target, "--baseline", str(baseline), "--update", "--budget-gb", "0.0025").returncode == 0
    assert json.loads(baseline.read_text())["plans"][0]["feasible"]
    write_model(workdir, hidden=512)
    result = check(target, "--baseline", str(baseline))
    assert result.returncode == 1
    assert "smallest feasible budget" in result.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"format": "ckpt-planner-baseline", "version": 1, "model": "netdef:build"}', "has no"),
        ('{"format": "ckpt-planner-baseline", "version": 1, "model": "netdef:build", '
         '"unoptimized_peak_bytes": "big", "activation_bytes_by_node": {}, "plans": []}', "should be int"),
        ('[1, 2, 3]', "not a ckpt-planner baseline"),
        ('{"format": "ckpt-planner-baseline", "version": 1, "model": "other:build", '
         '"unoptimized_peak_bytes": 1, "activation_bytes_by_node": {}, "plans": []}', "baseline is for model"),
    ],
)
def test_bad_baselines_are_clear_errors(workdir, content, message):
    target = write_model(workdir, hidden=64)
    baseline = workdir / "memory.json"
    if content is not None:
        baseline.write_text(content)
    result = check(target, "--baseline", str(baseline))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    if content is not None:
        assert baseline.read_text() == content, "a failed check must not touch the baseline"


def test_bad_tolerance_is_a_usage_error(workdir):
    target = write_model(workdir, hidden=64)
    result = check(target, "--baseline", str(workdir / "b.json"), "--update", "--tolerance", "lots")
    assert result.returncode == 2 and "tolerance" in result.stderr


def test_assert_peak_memory_helper():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 64))
    x = torch.randn(256, 64)
    peak = assert_peak_memory(model, (x,), max_gb=1.0)
    assert peak > 256 * 1024 * 4
    with pytest.raises(AssertionError, match="largest saved activations: relu 1.0 MiB"):
        assert_peak_memory(model, (x,), max_gb=peak / 2**30 * 0.9)


def test_assert_peak_memory_splits_the_peak_by_kind():
    """Where parameters and their gradients make most of the peak, the message says so, largest
    first, and the kinds add up to the peak."""
    import re

    from planner.core.simulate import PEAK_KINDS

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    x = torch.randn(64, 1024)
    with pytest.raises(AssertionError) as failed:
        assert_peak_memory(model, (x,), max_gb=0.001)
    message = str(failed.value)
    split = message.split(": ", 1)[1].split("; largest saved activations")[0]
    kinds = re.findall(r"([a-z ]+) ([0-9.]+) MiB \(([0-9]+)%\)", split)
    assert [kind.strip() for kind, _, _ in kinds][:2] == ["parameters and buffers", "parameter gradients"], message
    assert all(kind.strip() in PEAK_KINDS for kind, _, _ in kinds)
    peak_mib = int(re.search(r"\((\d+) > ", message).group(1)) / 2**20
    assert abs(sum(float(size) for _, size, _ in kinds) - peak_mib) < 0.1 * len(kinds), message
    assert "at the backward of" in message and "largest saved activations: relu" in message


def test_missing_target_with_update_writes_no_baseline_and_no_junit(workdir):
    baseline, junit = workdir / "memory.json", workdir / "result.xml"
    result = check(str(workdir / "nowhere.py") + ":build", "--baseline", str(baseline), "--update",
                   "--junit", str(junit))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert not baseline.exists() and not junit.exists()


def test_baseline_plan_entries_of_the_wrong_type_are_named(workdir):
    target = write_model(workdir, hidden=64)
    baseline = workdir / "memory.json"
    content = json.dumps({"format": "ckpt-planner-baseline", "version": 1, "model": "netdef:build",
                          "unoptimized_peak_bytes": 1, "activation_bytes_by_node": {"relu": "big"}, "plans": []})
    baseline.write_text(content)
    result = check(target, "--baseline", str(baseline))
    assert result.returncode == 2 and "should map node names to byte counts" in result.stderr
    content = content.replace('{"relu": "big"}', "{}").replace('"plans": []', '"plans": [{"budget_bytes": "1 GB"}]')
    baseline.write_text(content)
    result = check(target, "--baseline", str(baseline))
    assert result.returncode == 2 and "plan 0 needs an integer 'budget_bytes'" in result.stderr
    assert baseline.read_text() == content


def run_check(folder: Path, *args: str) -> tuple[int, str]:
    """``ckpt-planner check`` in this process, in ``folder``: exit code and stderr."""
    import contextlib
    import io

    from planner.cli import main

    err = io.StringIO()
    saved_path = list(sys.path)  # an entry point's folder goes on sys.path: not for the tests after this one
    try:
        with contextlib.chdir(folder), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["check", *args])
    finally:
        sys.path[:] = saved_path
    return code, err.getvalue()


def test_another_models_baseline_is_refused_before_the_model_is_loaded(workdir):
    (workdir / "slow.py").write_text("def build():\n    raise RuntimeError('loaded and profiled')\n")
    (workdir / "b.json").write_text(json.dumps({
        "format": "ckpt-planner-baseline", "version": 1, "model": "netdef.py:build", "unoptimized_peak_bytes": 1,
        "activation_bytes_by_node": {}, "plans": []}))
    code, err = run_check(workdir, "slow.py:build", "--baseline", "b.json")
    assert code == 2 and "baseline is for model 'netdef.py:build', not 'slow.py:build'" in err, err
    assert "loaded and profiled" not in err


def test_two_models_py_in_two_folders_are_two_models(workdir):
    for folder, hidden in (("a", 64), ("b", 128)):
        (workdir / folder).mkdir()
        (workdir / folder / "models.py").write_text(MODEL_SOURCE.format(hidden=hidden))
    code, err = run_check(workdir, "a/models.py:build", "--baseline", "memory.json", "--update", "--budget-gb", "1")
    assert code == 0, err
    assert json.loads((workdir / "memory.json").read_text())["model"] == "a/models.py:build"
    code, err = run_check(workdir, "b/models.py:build", "--baseline", "memory.json")
    assert code == 2 and "baseline is for model 'a/models.py:build', not 'b/models.py:build'" in err, err
    assert run_check(workdir, "a/models.py:build", "--baseline", "memory.json")[0] == 0
    # from another working directory, the same file is the same model (paths relative to the baseline)
    assert run_check(workdir / "b", "../a/models.py:build", "--baseline", "../memory.json")[0] == 0
    # a baseline keyed by the file's stem alone is read as that model's
    data = json.loads((workdir / "memory.json").read_text())
    (workdir / "stem.json").write_text(json.dumps({**data, "model": "models:build"}))
    assert run_check(workdir, "a/models.py:build", "--baseline", "stem.json")[0] == 0
