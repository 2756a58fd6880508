"""Random command lines against a small corpus of good and broken targets: ``ckpt-planner``
always exits 0, 2 or 3 (1 only for a ``check`` regression), and a failure is one line on
stderr, never a traceback.

The corpus is built once per module: a tiny exported program, the same program exported under
``torch.no_grad()``, the archive truncated, a text file named ``.pt2``, an empty directory, a
HuggingFace directory whose ``config.json`` is broken, one whose ``config.json`` names an
unknown architecture, a path that does not exist, and entry points returning a tiny model, a
wider one (over 1 MiB), one on the ``meta`` device and one whose parameters are all frozen.
Budgets include 1 MiB and a ``--sweep`` of 100 points. Every example
runs ``planner.cli.main`` in-process with the corpus folder as working directory (the output
names ``--plot``, ``--junit`` and ``--baseline`` draw from are relative, so they land there),
and takes well under a second.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main

#: the longest one command line may take on the tiny corpus (a real run takes well under 1 s)
EXAMPLE_BOUND_S = 60.0

#: good targets come up more often, so that many examples get as far as planning
TARGETS = ("tiny.pt2", "tiny.pt2", "tiny.pt2", "entry.py:build", "entry.py:build", "truncated.pt2", "text.pt2",
           "empty_dir", "bad_hf", "missing.pt2", "entry.py:nothing", "no_colon", "no_grad.pt2", "unknown_hf",
           "entry.py:meta", "entry.py:frozen")
#: 1 MiB, in GiB
ONE_MIB_GB = repr(2**20 / 2**30)
OUTPUT_NAMES = ("out.png", "out.jpg", "plots/out.png", "b.json", "b.json", "missing_dir/b.json", "result.xml",
                "missing_dir/result.xml", "empty_dir", "text.pt2", "")

GARBAGE = st.one_of(
    st.sampled_from(("0", "-1", "1e9", "1e308", "nan", "inf", "-inf", "", " ", "abc", "--", "-v", "8x8x8",
                     "0x8", "2xq", "8x8:float5", "tpu9", "xml", "-5%", "1e400", "9" * 30, "0x10", "1_000")),
    st.integers(-(10**15), 10**15).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
)
BUDGETS = st.one_of(st.sampled_from(("1", "0.001", ONE_MIB_GB, "1e-4", "1e-5", "1e-6", "0.5")),
                    st.floats(1e-7, 4.0).map(repr))
#: each flag with values it should accept, and the subcommands that have it
FLAGS: dict[str, tuple[st.SearchStrategy[str] | None, tuple[str, ...]]] = {
    "--budget-gb": (BUDGETS, ("report", "check", "plan")),
    "--sweep": (st.sampled_from(("2", "5", "12", "100")), ("report",)),
    "--format": (st.sampled_from(("text", "json", "csv", "markdown")), ("report", "check", "plan")),
    "--plot": (st.sampled_from(OUTPUT_NAMES), ("report",)),
    "--bound-s": (st.sampled_from(("0", "0.5", "2")), ("report",)),
    "--no-bound": (None, ("report",)),
    "--target": (st.sampled_from(("h100", "cpu", "a100")), ("report",)),
    "--input-shape": (st.sampled_from(("8x8", "8x8:float32", "4x8", "8x8:int64")), ("report", "check")),
    "--batch-size": (st.integers(1, 8).map(str), ("report", "check")),
    "--seq-len": (st.integers(1, 8).map(str), ("report", "check")),
    "--image-size": (st.integers(1, 8).map(str), ("report", "check")),
    "--trust-pickle": (None, ("report", "check")),
    "--max-stages": (st.integers(1, 64).map(str), ("report", "check", "plan")),
    "--max-solve-s": (st.sampled_from(("0.5", "5", "1e-6")), ("report", "check", "plan")),
    "--exact": (None, ("report", "check", "plan")),
    "--simplify-attention-masks": (None, ("report", "check", "plan")),
    "-v": (None, ("report", "check", "plan")),
    "--baseline": (st.sampled_from(OUTPUT_NAMES), ("check",)),
    "--tolerance": (st.sampled_from(("5%", "0.1", "0")), ("check",)),
    "--update": (None, ("check",)),
    "--junit": (st.sampled_from(OUTPUT_NAMES), ("check",)),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz_corpus")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).train()
    torch.export.save(torch.export.export(model, (torch.randn(8, 8),), strict=False), root / "tiny.pt2")
    with torch.no_grad():
        torch.export.save(torch.export.export(model, (torch.randn(8, 8),), strict=False), root / "no_grad.pt2")
    data = (root / "tiny.pt2").read_bytes()
    (root / "truncated.pt2").write_bytes(data[: len(data) // 2])
    (root / "text.pt2").write_text("this is not an archive\n")
    (root / "empty_dir").mkdir()
    (root / "bad_hf").mkdir()
    (root / "bad_hf" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": ')
    (root / "unknown_hf").mkdir()
    (root / "unknown_hf" / "config.json").write_text(
        '{"architectures": ["FrobnicatorForCausalLM"], "model_type": "frobnicator", "hidden_size": 8}')
    (root / "entry.py").write_text(
        "import torch\n\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))\n"
        "    return model.train(), (torch.randn(8, 8),)\n\n"
        "def wide():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))\n"
        "    return model.train(), (torch.randn(64, 256),)\n\n"
        "def meta():\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))\n"
        "    return model.train(), (torch.randn(8, 8, device='meta'),)\n\n"
        "def frozen():\n"
        "    model, inputs = build()\n"
        "    return model.requires_grad_(False), inputs\n"
    )
    return root


@pytest.fixture(scope="module")
def scratch_corpus(corpus, tmp_path_factory) -> Path:
    """A copy of the corpus for the random command lines: their ``--update`` runs write baselines
    over corpus files, which must not change what the fixed command lines meet."""
    scratch = tmp_path_factory.mktemp("fuzz_scratch")
    shutil.copytree(corpus, scratch, dirs_exist_ok=True)
    return scratch


@st.composite
def command_lines(draw) -> list[str]:
    command = draw(st.sampled_from(("report", "check", "plan")))
    argv = [command]
    if draw(st.integers(0, 9)):  # now and then no target at all
        argv.append(draw(st.sampled_from(TARGETS)))
    if draw(st.integers(0, 4)):  # mostly a budget
        argv += ["--budget-gb", draw(BUDGETS if draw(st.integers(0, 3)) else GARBAGE)]
    if command == "check" and draw(st.integers(0, 4)):
        argv += ["--baseline", draw(st.sampled_from(OUTPUT_NAMES))]
    own_flags = sorted(flag for flag, (_, commands) in FLAGS.items() if command in commands)
    for _ in range(draw(st.integers(0, 5))):
        # mostly a flag of this subcommand with a value it takes, sometimes another's or garbage
        flag = draw(st.sampled_from(own_flags if draw(st.integers(0, 9)) else sorted(FLAGS)))
        values = FLAGS[flag][0]
        argv.append(flag)
        if values is not None:
            argv.append(draw(values if draw(st.integers(0, 3)) else GARBAGE))
    if draw(st.integers(0, 9)) == 0:  # a flag missing its value at the end
        argv.append(draw(st.sampled_from(sorted(flag for flag, (values, _) in FLAGS.items() if values is not None))))
    return argv


def run_in(folder: Path, argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - started


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(argv=command_lines())
def test_every_command_line_exits_cleanly(scratch_corpus, argv):
    code, out, err, elapsed = run_in(scratch_corpus, argv)
    allowed = {0, 1, 2, 3} if argv[0] == "check" else {0, 2, 3}
    assert code in allowed, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code in (2, 3):
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), (argv, err)
    assert elapsed < EXAMPLE_BOUND_S, (argv, elapsed)


@pytest.mark.parametrize("argv", [
    ["report", "tiny.pt2", "--budget-gb", "1", "--sweep", "1"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--input-shape", "8x8", "--input-shape", "8x8"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--input-shape", "4x8"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--bound-s", "-1"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--max-stages", "0"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--max-solve-s", "nan"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--plot", "empty_dir"],
    ["report", "bad_hf", "--budget-gb", "1"],
    ["report", "truncated.pt2", "--budget-gb", "1"],
    ["report", "text.pt2", "--budget-gb", "1"],
    ["check", "tiny.pt2", "--baseline", "missing_dir/b.json", "--update", "--budget-gb", "1"],
    ["check", "tiny.pt2", "--baseline", "empty_dir", "--update", "--budget-gb", "1"],
    ["check", "tiny.pt2", "--baseline", "text.pt2"],
    ["check", "entry.py:build", "--baseline", "b.json", "--update", "--junit", "missing_dir/r.xml"],
    ["plan", "entry.py:nothing", "--budget-gb", "1"],
    ["plan", "no_colon", "--budget-gb", "1"],
    ["plan", "entry.py:build", "--budget-gb", "1e-9"],
    ["report", "tiny.pt2", "--budget-gb", "1e-12"],
    ["report", "tiny.pt2", "--budget-gb", "1", "--sweep", "101"],
    ["report", "unknown_hf", "--budget-gb", "1"],
    ["plan", "entry.py:meta", "--budget-gb", "1"],
    ["plan", "entry.py:frozen", "--budget-gb", "1"],
    ["plan", "entry.py:wide", "--budget-gb", ONE_MIB_GB],
])
def test_known_bad_command_lines_are_one_line(corpus, argv):
    code, _, err, _ = run_in(corpus, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code in (2, 3) and len(lines) == 1 and lines[0].startswith("ckpt-planner: "), (argv, code, err)
    assert not (corpus / "missing_dir").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "unknown_hf", "--budget-gb", "1"], "save_pretrained directory of a transformers model"),
    (["plan", "entry.py:meta", "--budget-gb", "1"], "materialise the model first"),
    (["plan", "entry.py:frozen", "--budget-gb", "1"], "nothing to train"),
    (["plan", "entry.py:wide", "--budget-gb", ONE_MIB_GB], "the smallest feasible budget is"),
])
def test_each_refusal_says_what_to_do(corpus, argv, says):
    code, _, err, _ = run_in(corpus, argv)
    assert code == (3 if "feasible" in says else 2) and says in err, (argv, code, err)


def test_a_tiny_model_at_one_mib_a_no_grad_export_and_a_sweep_of_100_plan(corpus):
    """A budget of 1 MiB over a model of a few KiB plans (nothing to recompute), the peak shown
    in KiB; a program exported under ``torch.no_grad()`` is the same graph and plans the same;
    ``--sweep 100`` plans every distinct point there is (here one)."""
    import json

    code, out, err, _ = run_in(corpus, ["report", "tiny.pt2", "--budget-gb", ONE_MIB_GB, "--format", "json",
                                        "--no-bound", "--sweep", "100"])
    assert code == 0, err
    tiny = json.loads(out)
    assert tiny["plan"]["predicted_peak_bytes"] <= tiny["plan"]["budget_bytes"] == 2**20
    assert len(tiny["pareto"]) == 1
    code, text, err, _ = run_in(corpus, ["report", "tiny.pt2", "--budget-gb", ONE_MIB_GB, "--no-bound"])
    assert code == 0 and " KiB" in text and "0.0 MiB" not in text, text
    code, out, err, _ = run_in(corpus, ["report", "no_grad.pt2", "--budget-gb", ONE_MIB_GB, "--format", "json",
                                        "--no-bound"])
    assert code == 0, err
    no_grad = json.loads(out)
    assert no_grad["unoptimized"]["predicted_peak_bytes"] == tiny["unoptimized"]["predicted_peak_bytes"]


@pytest.mark.parametrize("budget", ["1", "0.5GB"])
def test_a_budget_given_as_a_string_is_one_line_naming_the_number(budget):
    from planner import InputError, enable, optimize
    from planner.integrations.hf import PlannerCallback

    model, inputs = torch.nn.Linear(4, 4), (torch.randn(2, 4),)
    for call in (lambda: optimize(model, inputs, budget_gb=budget), lambda: enable(model, inputs, budget_gb=budget),
                 lambda: PlannerCallback(budget_gb=budget)):
        with pytest.raises(InputError) as refused:
            call()
        message = str(refused.value)
        assert "\n" not in message and f"the string {budget!r}" in message, message
        assert ("budget_gb=1 " if budget == "1" else "budget_gb=6 for 6 GiB") in message, message


def test_a_good_command_line_plans(corpus):
    code, out, err, _ = run_in(corpus, ["report", "tiny.pt2", "--budget-gb", "1", "--format", "json", "--no-bound"])
    assert code == 0, err
    assert '"predicted_peak_bytes"' in out
    assert os.path.exists(corpus / "tiny.pt2")
